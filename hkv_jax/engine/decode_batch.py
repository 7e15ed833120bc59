"""The running requests while every one of them decodes, as arrays (the steady state of a full batch).

The scheduler plans such a step from this record without a pass over the requests, and books its tokens
with array operations; the tokens wait here (``pending``) until something reads the requests
(``Scheduler.book_pending``), a request finishes, or ``MAX_PENDING`` calls passed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from hkv_jax.engine.request import Request

# Calls whose decode tokens may wait in a record before they are booked anyway: bounds the record's arrays
# (and the cost of passing them on when a request finishes) in long decodes.
MAX_PENDING = 256


def book_logprobs(r: Request, logprob: np.ndarray, top_ids: np.ndarray, top_logprobs: np.ndarray) -> None:
    """Append ``k`` generated tokens' log-probabilities to ``r``: ``logprob: f32[k]`` (the sampled tokens'),
    ``top_ids: i32[k, N]`` and ``top_logprobs: f32[k, N]`` (the ``N`` likeliest tokens and theirs)."""
    r.logprobs += logprob.tolist()
    if n := r.num_top_logprobs:
        r.top_logprobs += [list(zip(i, v)) for i, v in zip(top_ids[:, :n].tolist(), top_logprobs[:, :n].tolist())]


@dataclass
class DecodeBatch:
    """The running requests, in running order, when every one of them decodes, with what a decode-only
    step needs per request as arrays. ``version``: the scheduler's running-set version it was built at
    (it is valid while that holds)."""

    version: int
    rids: list[int]
    requests: list[Request]
    slots: np.ndarray          # i32[n]
    rid_array: np.ndarray      # i64[n]: ``rids``
    tokens_left: np.ndarray    # i64[n]: max_new_tokens - generated (pending tokens counted)
    stops: np.ndarray          # i32[k]: every stop token of these requests (a candidate filter)
    logprobs: bool             # some of them keep their tokens' log-probabilities
    # Tokens of booked steps not yet in the requests' ``generated`` and ``computed``: i32[k, n] blocks.
    pending: list[np.ndarray] = field(default_factory=list)
    # Their log-probabilities, kept only when some request asked: (f32[k, n], i32[k, N, n], f32[k, N, n]).
    pending_logprobs: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = field(default_factory=list)
    # The slots, token counts and draft tokens (i32[R] each; drafts None without any) of a step that decodes
    # them all: every such step plans the same, so the scheduler builds them once.
    step_arrays: tuple[np.ndarray, np.ndarray, np.ndarray | None] | None = None

    @staticmethod
    def of(version: int, requests: list[Request]) -> "DecodeBatch":
        """The record of ``requests``, which must all be decoding."""
        rids = [r.rid for r in requests]
        return DecodeBatch(version, rids, requests, np.array([r.slot for r in requests], np.int32),
                           np.array(rids, np.int64),
                           np.array([r.max_new_tokens - len(r.generated) for r in requests], np.int64),
                           np.array(sorted({t for r in requests for t in r.stop}), np.int32),
                           any(r.logprobs is not None for r in requests))

    def add(self, tokens: np.ndarray, logprobs: tuple[np.ndarray, np.ndarray, np.ndarray] | None) -> None:
        """Keep ``k`` more steps' tokens ``i32[k, n]`` (and log-probabilities) pending."""
        self.pending.append(tokens)
        if self.logprobs:
            self.pending_logprobs.append(logprobs)
        self.tokens_left -= tokens.shape[0]
        if len(self.pending) >= MAX_PENDING:
            self.flush()

    def flush(self, cols: list[int] | None = None) -> None:
        """Move the pending tokens into the requests at positions ``cols`` (default: all of them, and
        nothing stays pending)."""
        if not self.pending:
            return
        block = np.concatenate(self.pending) if len(self.pending) > 1 else self.pending[0]   # [k, n]
        logprobs = [np.concatenate(p) for p in zip(*self.pending_logprobs)] if self.pending_logprobs else None
        k = block.shape[0]
        if cols is None:
            self.pending, self.pending_logprobs = [], []
            cols = range(len(self.requests))
        for i, toks in zip(cols, block[:, cols].T.tolist()):
            r = self.requests[i]
            r.computed += k
            r.generated += toks
            if r.logprobs is not None:
                book_logprobs(r, *(x[..., i] for x in logprobs))

    def take(self, version: int, keep: list[int]) -> "DecodeBatch":
        """The record of the requests at positions ``keep`` (their pending tokens with them)."""
        return DecodeBatch(version, [self.rids[i] for i in keep], [self.requests[i] for i in keep],
                           self.slots[keep], self.rid_array[keep], self.tokens_left[keep], self.stops,
                           self.logprobs, [p[:, keep] for p in self.pending],
                           [tuple(x[..., keep] for x in p) for p in self.pending_logprobs])
