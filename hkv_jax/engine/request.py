"""A request as the host sees it, its status, and the one rule that decides when it stops.

``check_stop`` is the only host-side stop rule; the device's multi-step decode loop leaves early with
``may_stop``, its array form (``tests/test_engine_parts.py`` checks that they agree).
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field, fields

import numpy as np

from hkv_jax.engine.sampling_params import KNOB, SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"      # queued, or preempted and queued again
    RUNNING = "running"      # holds a slot and computes tokens
    FINISHED = "finished"    # see ``Request.finish_reason``


class FinishReason(enum.StrEnum):
    """Why a request ended, in vLLM's (and OpenAI's) words."""

    STOP = "stop"      # a stop token or a stop string
    LENGTH = "length"  # ``max_new_tokens`` generated
    ABORT = "abort"    # ``Engine.abort``


def check_stop(params: SamplingParams, num_generated: int, last_token: int | None,
               stop_string: str | None = None) -> FinishReason | None:
    """Whether a request with ``params`` stops after its ``num_generated``-th token ``last_token``
    (``stop_string``: the stop string its text now holds, found by the output processor)."""
    if stop_string is not None or (last_token is not None and last_token in params.stop):
        return FinishReason.STOP
    return FinishReason.LENGTH if num_generated >= params.max_new_tokens else None


def may_stop(tokens_left, tokens, stop_ids, xp=np):
    """``check_stop`` for a batch, as the device loop applies it (no stop strings: a batch with stop strings
    never runs several steps a call). ``tokens_left``: tokens each lane may still generate after
    ``tokens``; ``stop_ids``: every stop token of the batch (-1 padded). A lane whose request stops is
    always flagged; one whose token stops another request of the batch may be too (the host's
    ``check_stop`` then decides), which only ends a multi-step call early. ``xp``: ``numpy`` on the host,
    ``jax.numpy`` inside a program."""
    return (tokens_left <= 0) | xp.isin(tokens, stop_ids)


class ParamsValue:
    """A request's read-only view of one per-request sampling value of its ``SamplingParams`` (``KNOBS``)."""

    def __set_name__(self, owner, name: str) -> None:
        if name not in KNOB:
            raise TypeError(f"{name!r} is not a sampling value ({', '.join(KNOB)})")
        self.name = name

    def __get__(self, request, owner=None):
        return self if request is None else getattr(request.params, self.name)


@dataclass
class Request:
    """A request as the host sees it. Read it through ``Engine.requests`` after a step: steps where every
    running request decodes book their tokens into ``generated`` and ``computed`` only when
    ``Engine.requests`` is read (or the request finishes, or 256 calls passed), so an object kept from
    before a step can lag."""

    rid: int
    prompt: list[int]
    params: SamplingParams
    bias: tuple[tuple[int, float], ...] = ()  # ``params.bias_entries``: (token, bias) added to its logits
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    slot: int = -1
    admitted: bool = False      # its tokens live in the allocator
    computed: int = 0           # tokens with KV in the cache
    generated: list[int] = field(default_factory=list)
    cache_hit: int = 0          # prefix-cache tokens of its first (or post-preemption) schedule
    preemptions: int = 0
    salt: int = 0               # cache salt: requests hit only blocks cached under the same salt
    max_chunk: int = 1 << 30    # lowered when even alone it could not get blocks for a chunk
    stop_string: str | None = None  # the one of ``params.stop_strings`` that ended it
    logprobs: list[float] | None = None  # each generated token's log-probability (``params.logprobs``)
    top_logprobs: list[list[tuple[int, float]]] | None = None  # per generated token: (token, log-probability)
    # Speculative decoding: whether it still drafts (it stops when its drafts give too little), the
    # speculative steps it took part in, and its draft tokens verified and accepted so far.
    drafting: bool = True
    spec_steps: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    # ``time.time()`` when it was queued, when its first token was booked, when it finished or was aborted.
    arrival_time: float = 0.0
    first_token_time: float | None = None
    finished_time: float | None = None

    def __post_init__(self):
        self.drafting &= self.params.speculative
        if self.logprobs is None and self.params.logprobs:
            self.logprobs = []
        if self.top_logprobs is None and self.params.top_logprobs:
            self.top_logprobs = []

    @property
    def prompt_len(self) -> int:
        return len(self.prompt)

    @property
    def token_limit(self) -> int:
        """The most tokens it can ever hold: prompt + ``max_new_tokens``."""
        return len(self.prompt) + self.params.max_new_tokens

    @property
    def total(self) -> int:
        """Known tokens: prompt + generated."""
        return len(self.prompt) + len(self.generated)

    @property
    def done(self) -> bool:
        """Whether it finished (``finish_reason`` says why)."""
        return self.status is RequestStatus.FINISHED

    @property
    def aborted(self) -> bool:
        return self.finish_reason is FinishReason.ABORT

    def finish(self, reason: FinishReason, now: float) -> None:
        """Mark it finished: it leaves its slot (the scheduler frees the slot's blocks)."""
        self.status, self.finish_reason, self.slot, self.finished_time = RequestStatus.FINISHED, reason, -1, now

    # Its params by their names (``r.max_new_tokens``, ``r.stop``, ``r.temperature`` ...), read-only.
    temperature, top_p, top_k, min_p = ParamsValue(), ParamsValue(), ParamsValue(), ParamsValue()
    seed, repetition_penalty, presence_penalty = ParamsValue(), ParamsValue(), ParamsValue()
    frequency_penalty = ParamsValue()
    max_new_tokens = property(lambda self: self.params.max_new_tokens)
    stop = property(lambda self: self.params.stop)
    stop_strings = property(lambda self: self.params.stop_strings)
    min_tokens = property(lambda self: self.params.min_tokens)
    num_top_logprobs = property(lambda self: self.params.top_logprobs)
    logit_bias = property(lambda self: self.bias)

    def to_dict(self) -> dict:
        """Its fields as JSON-able values (``from_dict`` reads them back)."""
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        return {**d, "params": self.params.to_dict(), "status": self.status.value,
                "finish_reason": None if self.finish_reason is None else self.finish_reason.value}

    @staticmethod
    def from_dict(d: dict) -> "Request":
        d = dict(d)
        d["params"] = SamplingParams.from_dict(d["params"])
        d["status"] = RequestStatus(d["status"])
        d["finish_reason"] = None if d["finish_reason"] is None else FinishReason(d["finish_reason"])
        d["bias"] = tuple(tuple(e) for e in d["bias"])
        if d["top_logprobs"] is not None:
            d["top_logprobs"] = [[tuple(e) for e in row] for row in d["top_logprobs"]]
        return Request(**d)


# A request stops drafting when its drafts cost more than they give: once this many of its draft tokens
# were verified and fewer than this share of them accepted, or once it took part in this many speculative
# steps (with a draft or not: a step that may draft runs alone in its program, and samples every position)
# and accepted fewer than this many tokens per step (a speculative step of 4 positions costs about 1.4
# decode steps of Gemma 3 270M on a CPU). A request that drafts no more steps as without speculation,
# several steps a program and in the lean program where it can.
JUDGE_AFTER = 64
MIN_ACCEPTANCE = 0.1
JUDGE_AFTER_STEPS = 8
MIN_ACCEPTED_PER_STEP = 0.5


def keeps_drafting(steps: int, draft_tokens: int, accepted_tokens: int) -> bool:
    """Whether a request that took part in ``steps`` speculative steps, with ``draft_tokens`` verified and
    ``accepted_tokens`` accepted so far, goes on drafting."""
    return ((draft_tokens < JUDGE_AFTER or accepted_tokens >= MIN_ACCEPTANCE * draft_tokens)
            and (steps < JUDGE_AFTER_STEPS or accepted_tokens >= MIN_ACCEPTED_PER_STEP * steps))


class RequestsView(Mapping):
    """Requests by id, read-only, as ``Engine.requests`` shows them. ``booked`` returns the scheduler's
    dict with every token booked (``Scheduler.book_pending``): a decode-only run records its tokens as
    arrays and books them into the requests when they are read, so each read goes through it."""

    def __init__(self, booked: Callable[[], dict[int, Request]]):
        self._booked = booked

    def __getitem__(self, rid: int) -> Request:
        return self._booked()[rid]

    def __iter__(self) -> Iterator[int]:
        return iter(self._booked())

    def __len__(self) -> int:
        return len(self._booked())

    def __repr__(self) -> str:
        return f"RequestsView({dict(self)!r})"
