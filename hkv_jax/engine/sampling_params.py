"""``SamplingParams``: how one request samples and when it stops, checked once, in one place.

Every surface (``Engine.add_request``, ``hkv serve``'s OpenAI fields, ``hkv generate`` and ``hkv demo``'s
flags) builds one of these; its fields are checked when it is built (``__post_init__``) and against an
engine's limits (vocabulary, ``max_top_logprobs``, ``max_logit_bias``, a detokenizer) when it is added
(``SamplingParams.check``). Nothing else checks them again.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields

import numpy as np


def is_integer(x) -> bool:
    """An int (numpy's too), not a bool."""
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


def is_number(x) -> bool:
    """An int or float (numpy's too), not a bool."""
    return isinstance(x, (int, float, np.integer, np.floating)) and not isinstance(x, bool)


@dataclass(frozen=True)
class Knob:
    """One sampling value that the step program takes per request: its dtype there, the value that
    leaves it out (greedy, no cut, no seed, no penalty), the rule a given value must meet, and what it
    does in words (the surfaces' help: ``hkv generate``'s flags)."""

    name: str
    dtype: type
    neutral: float
    ok: object   # value -> bool
    rule: str    # the rule in words, for the error
    help: str    # what it does, for the surfaces that list it

    def check(self, value):
        """``value`` as a Python number (``None`` kept); ``ValueError`` when it breaks the rule."""
        if value is None:
            return None
        if not self.ok(value):
            raise ValueError(f"{self.name} must be {self.rule}, got {value!r}")
        return int(value) if self.dtype is np.int32 else float(value)


# The one listing of the per-request sampling values. The step's plan carries them in this order
# (``hkv_jax.engine.step_messages.SAMPLING`` adds the prompt length and ``min_tokens``).
KNOBS = (
    Knob("temperature", np.float32, 0.0, lambda x: is_number(x) and 0 <= x < math.inf, "finite and >= 0",
         "softmax temperature (0: greedy)"),
    Knob("top_p", np.float32, 1.0, lambda x: is_number(x) and 0 < x <= 1, "in (0, 1]", "nucleus sampling mass"),
    Knob("top_k", np.int32, 0, lambda x: is_integer(x) and x >= 0, "an integer >= 0 (0: no limit)",
         "sample among the k likeliest tokens (0: all)"),
    Knob("min_p", np.float32, 0.0, lambda x: is_number(x) and 0 <= x <= 1, "in [0, 1]",
         "cut tokens below this fraction of the likeliest one's probability"),
    Knob("seed", np.int32, -1, lambda x: is_integer(x) and 0 <= x < 2**31, "an integer in [0, 2**31)",
         "the request's own sampling seed: the same tokens in any batch"),
    Knob("repetition_penalty", np.float32, 1.0, lambda x: is_number(x) and 0 < x < math.inf,
         "finite and > 0 (1: none)",
         "divide the positive logits of tokens seen so far by this, multiply the negative ones (1: none)"),
    Knob("presence_penalty", np.float32, 0.0, lambda x: is_number(x) and -2 <= x <= 2, "in [-2, 2]",
         "subtract this from the logits of tokens generated so far"),
    Knob("frequency_penalty", np.float32, 0.0, lambda x: is_number(x) and -2 <= x <= 2, "in [-2, 2]",
         "subtract this times its count from each generated token's logit"),
)
KNOB = {k.name: k for k in KNOBS}
# The values an engine sets for requests that set none of their own (``Engine.temperature`` ...; a seed is
# per request only).
ENGINE_DEFAULTS = {k.name: k.neutral for k in KNOBS if k.name != "seed"}


class EngineDefault:
    """An engine attribute that reads and sets its default for one sampling value (``ENGINE_DEFAULTS``; the
    value is checked at the next step)."""

    def __set_name__(self, owner, name: str) -> None:
        if name not in ENGINE_DEFAULTS:
            raise TypeError(f"{name!r} is not an engine sampling default ({', '.join(ENGINE_DEFAULTS)})")
        self.name = name

    def __get__(self, engine, owner=None):
        return self if engine is None else engine.sampling_defaults[self.name]

    def __set__(self, engine, value) -> None:
        engine.sampling_defaults[self.name] = value


@dataclass(frozen=True)
class SamplingParams:
    """One request's sampling and stopping (vLLM's ``SamplingParams``).

    ``max_new_tokens``: it ends after this many tokens. ``stop``: token ids that end it (e.g. the
    model's EOS ids; kept in its output). ``stop_strings``: text that ends it once the text of its
    tokens holds one (the engine needs a ``detokenize``); its tokens stay, ``Engine.text`` cuts the text
    before it. ``min_tokens``: no stop token can be sampled (they are masked) and no stop string is
    looked for until it has this many tokens.

    Sampling (``None``: the engine's value at each step, ``Engine.temperature`` ...): ``temperature``
    (0: greedy), ``top_p``, ``top_k`` (0: no limit), ``min_p``; vLLM's penalties, on greedy requests too:
    ``repetition_penalty`` (1: none) on every token seen, ``presence_penalty`` and ``frequency_penalty``
    on generated ones. ``seed`` makes its draws reproducible: each draw's key comes from the seed and
    the token's position, so it samples the same tokens in any batch or engine, given the same logits.

    ``logprobs``: keep each generated token's log-probability under the model's raw logits.
    ``top_logprobs``: also list that many likeliest tokens per generated token (implies ``logprobs``;
    at most the engine's ``max_top_logprobs``). ``logit_bias`` (token -> value in [-100, 100], OpenAI's
    range) is added to its logits before the penalties and the sampling.

    ``speculative``: on an engine with speculative decoding, whether this request drafts (False: it
    decodes one token a step; its tokens are the same either way).

    Building one checks every value that needs no engine (``ValueError``); ``check`` checks the rest.
    """

    max_new_tokens: int = 16
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = None
    stop: tuple[int, ...] = ()
    stop_strings: tuple[str, ...] = ()
    min_tokens: int = 0
    logprobs: bool = False
    top_logprobs: int = 0
    logit_bias: tuple[tuple[int, float], ...] = field(default=())  # a dict is accepted and kept as its items
    speculative: bool = True

    def __post_init__(self):
        def put(name, value):
            object.__setattr__(self, name, value)

        if not is_integer(self.max_new_tokens) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be a positive integer, got {self.max_new_tokens!r}")
        put("max_new_tokens", int(self.max_new_tokens))
        for knob in KNOBS:
            put(knob.name, knob.check(getattr(self, knob.name)))
        try:
            put("stop", tuple(int(t) for t in self.stop))
        except (TypeError, ValueError):
            raise ValueError(f"stop must be token ids, got {self.stop!r}") from None
        strings = (self.stop_strings,) if isinstance(self.stop_strings, str) else tuple(self.stop_strings)
        if not all(isinstance(s, str) and s for s in strings):
            raise ValueError(f"stop_strings must be non-empty strings, got {strings!r}")
        put("stop_strings", strings)
        if not is_integer(self.min_tokens) or not 0 <= self.min_tokens <= self.max_new_tokens:
            raise ValueError(f"min_tokens must be an integer in [0, max_new_tokens], got {self.min_tokens!r}")
        if not is_integer(self.top_logprobs) or self.top_logprobs < 0:
            raise ValueError(f"top_logprobs must be an integer in [0, max_top_logprobs], got {self.top_logprobs!r}")
        put("logprobs", bool(self.logprobs or self.top_logprobs))
        bias = self.logit_bias
        if isinstance(bias, dict):
            bias = tuple(bias.items())
        elif bias is None:
            bias = ()
        elif not isinstance(bias, tuple):
            raise ValueError(f"logit_bias must be a dict of token -> bias, got {type(bias).__name__}")
        put("logit_bias", bias)
        if not isinstance(self.speculative, (bool, np.bool_)):
            raise ValueError(f"speculative must be True or False, got {self.speculative!r}")
        put("speculative", bool(self.speculative))

    def check(self, vocab_size: int, max_top_logprobs: int, max_logit_bias: int, can_detokenize: bool) -> None:
        """``ValueError`` unless an engine with these limits can serve it (``bias_entries`` too)."""
        if self.stop_strings and not can_detokenize:
            raise ValueError("stop_strings need the engine's detokenize (Engine(..., detokenize=codec.decode))")
        if self.top_logprobs > max_top_logprobs:
            raise ValueError(f"top_logprobs must be an integer in [0, {max_top_logprobs}] (the engine's "
                             f"max_top_logprobs), got {self.top_logprobs!r}")
        self.bias_entries(vocab_size, max_logit_bias)

    def bias_entries(self, vocab_size: int, max_logit_bias: int) -> tuple[tuple[int, float], ...]:
        """Its ``(token, bias)`` entries as the step adds them: ``logit_bias``, then each stop token at -inf
        while ``min_tokens`` is set (the step lifts those once it has that many tokens). ``ValueError`` for
        a token outside the vocabulary, a value out of range, or more entries than ``max_logit_bias``."""
        entries = []
        for t, v in self.logit_bias:
            if not is_integer(t) or not 0 <= t < vocab_size or not is_number(v) or not -100 <= v <= 100:
                raise ValueError(f"logit_bias maps tokens in [0, {vocab_size}) to values in [-100, 100], "
                                 f"got {t!r}: {v!r}")
            entries.append((int(t), float(v)))
        if self.min_tokens:
            entries += [(t, float("-inf")) for t in dict.fromkeys(self.stop)]
        if len(entries) > max_logit_bias:
            raise ValueError(f"logit_bias and min_tokens need {len(entries)} bias entries (one per bias, one per "
                             f"stop token under min_tokens); the engine has max_logit_bias {max_logit_bias}")
        return tuple(entries)

    def to_dict(self) -> dict:
        """Its fields as JSON-able values (``from_dict`` reads them back)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @staticmethod
    def from_dict(d: dict) -> "SamplingParams":
        """The params ``to_dict`` wrote (JSON turns tuples into lists)."""
        d = dict(d)
        d["logit_bias"] = tuple(tuple(e) for e in d.get("logit_bias", ()))
        return SamplingParams(**d)
