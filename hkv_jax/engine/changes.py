"""``Changes``: the scheduler's releases and admissions of one step, as the step program takes them.

A message from the scheduler (plain Python and numpy) to the runner's jitted ``prepare``: numpy arrays,
and nothing else of the step, so the scheduler imports neither the step program nor jax (``step.py``
registers ``Changes`` as a pytree); and the sizes of its prompt buffer, which the runner compiles
``prepare`` for.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# New prompts travel in a flat buffer of a power-of-two size, at least this many tokens: few shapes of
# the (small) prepare program.
MIN_PROMPT_BUFFER = 64


def prompt_buffer(tokens: int) -> int:
    """The size of the prompt buffer that carries ``tokens`` prompt tokens to the device."""
    return max(MIN_PROMPT_BUFFER, 1 << (tokens - 1).bit_length())


def prompt_buffers(tokens: int) -> list[int]:
    """Every prompt-buffer size up to the one that carries ``tokens`` tokens."""
    return [MIN_PROMPT_BUFFER << i for i in range((prompt_buffer(tokens) // MIN_PROMPT_BUFFER).bit_length())]


@dataclass(frozen=True)
class Changes:
    """Releases and admissions of one step (``R`` request slots, ``P`` prompt tokens).

    ``free, preempt: bool[R]`` per slot; ``slots: i32[R]`` admitted slots (-1: none), their prompts
    one after another in ``prompts: i32[P]`` (``lens: i32[R]`` tokens each; the rest is padding),
    ``salts: u32[R]`` their cache salts.
    """

    free: np.ndarray
    preempt: np.ndarray
    slots: np.ndarray
    prompts: np.ndarray
    lens: np.ndarray
    salts: np.ndarray
