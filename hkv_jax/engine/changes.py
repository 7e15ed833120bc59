"""The scheduler's messages: ``SchedulerOutput`` (one step's plan) and in it ``Changes`` (the step's
releases and admissions, as the step program takes them).

Plain Python and numpy, so the scheduler imports neither the step program nor jax (``step.py`` registers
``Changes`` as a pytree); and the sizes of the prompt buffer, which the runner compiles ``prepare`` for.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from hkv_jax.engine.decode_batch import DecodeBatch
    from hkv_jax.engine.request import Request

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


@dataclass(frozen=True)
class SchedulerOutput:
    """One step's plan: the requests it runs, in plan order, and what changes before it runs.

    ``request_ids`` and ``requests``: the planned requests (decoding first, then running ones with a
    chunk, then waiting ones); ``slots: i32[R]`` their slots and ``num_tokens: i32[R]`` the tokens each
    computes (-1 and 0 past them); ``num_decoding`` of them decode one token and ``num_running`` were
    running; ``admitted``: ids of the waiting ones admitted now; ``changes``: the releases and the
    admitted prompts (``None``: nothing to change); ``decode_batch``: the decode-only record this plan
    came from (every running request decodes), or ``None``; ``multi_step``: whether several decode
    steps may run in one call (a decode-only plan that no waiting request could join); ``num_drafts:
    i32[R]``: speculative decoding, the most draft tokens each decoding request may verify (budget they
    took besides ``num_tokens``; ``None``: none anywhere)."""

    request_ids: list[int]
    requests: list[Request]
    slots: np.ndarray
    num_tokens: np.ndarray
    num_decoding: int
    num_running: int
    admitted: list[int]
    changes: Changes | None
    decode_batch: DecodeBatch | None = None
    multi_step: bool = False
    num_drafts: np.ndarray | None = None
