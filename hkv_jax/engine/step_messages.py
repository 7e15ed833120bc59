"""The messages of a step: ``StepPlan`` (the host's decision, one array in), ``StepOutput`` (what the step
program returns, on the device) and ``StepReport`` (its report rows, read back to the host), and the
columns and rows they carry (``SAMPLING``, ``REPORT_ROWS``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
import numpy as np

from hkv_jax.engine.sampling_params import KNOBS

# Each entry's sampling in ``StepPlan.data``, after ``slots`` and ``want`` (``R`` int32 words each, float32
# values as their bits): name, dtype, and the value that leaves it out (greedy, no cut, no seed, no
# penalty). ``prompt_len`` tells the penalties which of a request's tokens are its prompt, and
# ``min_tokens`` when the bias entries of value -inf (its stop tokens) stop applying. Speculative
# decoding: ``drafts``, the most draft tokens the entry may verify (0: it decodes one token), and
# ``token_limit``, the most tokens it may ever hold (no draft runs past it).
SAMPLING = tuple((k.name, k.dtype, k.neutral) for k in KNOBS) + (
    ("prompt_len", np.int32, 0),
    ("min_tokens", np.int32, 0),
    ("drafts", np.int32, 0),
    ("token_limit", np.int32, 0),
)


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class StepPlan:
    """The host's decision for one step, packed in one array (one transfer): ``data: i32[(12 + 2M)R]``.

    ``slots`` (``data[:R]``): requests to run in order (-1: padding); ``want`` (``data[R:2R]``): tokens
    each (0: padding); then each entry's sampling (``SAMPLING``: temperature, 0 is greedy; top-p; top-k,
    0 is none; min-p; seed, -1 is none: it draws from the engine's key; the three penalties; the
    prompt's length; min_tokens); then ``M = bias_slots`` logit-bias entries per request: their token
    ids (``[M, R]``, -1: none) and values (``[M, R]``, float32 bits; -inf: a stop token masked until
    the request has ``min_tokens`` tokens). The vectorised step wants decoding requests (``want == 1``,
    running) first, then other running ones, then waiting ones.
    """

    data: jax.Array
    bias_slots: int = field(default=0, metadata={"static": True})

    @staticmethod
    def pack(slots: np.ndarray, want: np.ndarray, bias: tuple[np.ndarray, np.ndarray] | None = None,
             **sampling) -> "StepPlan":
        """The plan of ``slots`` and ``want`` (``[R]`` each) on the host; ``sampling``: values of
        ``SAMPLING``'s names, ``[R]`` or one for all (a name left out: its neutral value); ``bias``: the
        logit-bias entries' token ids ``i32[R, M]`` (-1: none) and values ``f32[R, M]``."""
        unknown = set(sampling) - {name for name, _, _ in SAMPLING}
        if unknown:
            raise TypeError(f"unknown sampling values {sorted(unknown)}")
        columns = [np.broadcast_to(np.asarray(sampling.get(name, off), dtype), np.shape(slots)).view(np.int32)
                   for name, dtype, off in SAMPLING]
        if bias is not None:
            ids, values = bias
            columns += [ids.T.ravel(), values.astype(np.float32).T.ravel().view(np.int32)]
        return StepPlan(np.concatenate([slots, want, *columns]).astype(np.int32),
                        0 if bias is None else bias[0].shape[1])

    def _part(self, i: int, width: int = 1):
        R = self.data.shape[0] // (2 + len(SAMPLING) + 2 * self.bias_slots)
        return self.data[i * R:(i + width) * R]

    @property
    def slots(self):
        return self._part(0)

    @property
    def want(self):
        return self._part(1)

    def sampling(self) -> dict[str, jax.Array]:
        """Each entry's sampling by ``SAMPLING`` name, ``[R]`` of its dtype (inside the step)."""
        return {name: jax.lax.bitcast_convert_type(self._part(2 + i), dtype)
                for i, (name, dtype, _) in enumerate(SAMPLING)}

    def logit_bias(self) -> tuple[jax.Array, jax.Array]:
        """The bias entries: token ids ``i32[R, M]`` (-1: none) and values ``f32[R, M]`` (inside the step)."""
        M, first = self.bias_slots, 2 + len(SAMPLING)
        ids = self._part(first, M).reshape(M, -1).T
        values = jax.lax.bitcast_convert_type(self._part(first + M, M).reshape(M, -1).T, jnp.float32)
        return ids, values


# Rows of ``StepOutput.report``; a step with ``StepStatic.top_logprobs = N`` adds ``N`` rows of token ids
# and ``N`` of their log-probabilities (float32 bits).
REPORT_ROWS = ("ok", "num_new", "cache_hit", "sampled", "tokens", "idle_next", "logprob", "drafted")


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class StepOutput:
    """Per entry of ``StepPlan.slots``: ``report: i32[8 + 2N, R]`` (rows ``REPORT_ROWS``: allocated, new
    tokens computed, cache-hit tokens, whether a token was sampled, the token or -1, whether the
    request's next decode step would only count its token, the sampled token's log-probability
    under the model's logits, before temperature and the cuts, as float32 bits, and the draft tokens it
    verified; then, for ``N = StepStatic.top_logprobs``, the ``N`` likeliest tokens, likeliest first, and
    their log-probabilities) and ``logits: f32[R, vocab]`` at each entry's last computed position (left
    on the device).

    A speculative step (``StepStatic.speculative``, ``k`` draft tokens) reports ``i32[k + 1, 8 + 2N, R]``:
    one report per emitted position, as if each had been a decode step of its own (position ``j``:
    ``sampled`` where the entry emitted ``j + 1`` tokens or more, ``num_new`` 1 there but for position 0's
    own count, ``drafted`` at position 0 only), and ``logits: f32[R, k + 1, vocab]``, those each token
    was sampled from."""

    report: jax.Array
    logits: jax.Array

    def row(self, name: str) -> jax.Array:
        """One row of ``report`` by name (``REPORT_ROWS``)."""
        return self.report[REPORT_ROWS.index(name)]


# The leading report rows of a lane that decoded one token, allocated and sampled it.
_CLEAN_DECODE = np.array([1, 1, 0, 1], np.int32)[:, None]
assert REPORT_ROWS[:len(_CLEAN_DECODE)] == ("ok", "num_new", "cache_hit", "sampled")


@dataclass(frozen=True)
class StepReport:
    """The reports of consecutive steps of one plan, read back to the host, by name:
    ``data: i32[steps, 8 + 2N, n]`` (``StepOutput.report`` of each step, its first ``n`` lanes; a
    speculative step's positions count as steps). ``speculative``: the report of one speculative step,
    where a lane may emit fewer tokens than there are positions."""

    data: np.ndarray
    speculative: bool = False

    def __len__(self) -> int:
        return self.data.shape[0]

    def steps(self, part: slice) -> "StepReport":
        """The reports of the steps in ``part``."""
        return StepReport(self.data[part], self.speculative)

    def _row(self, name: str) -> np.ndarray:
        return self.data[:, REPORT_ROWS.index(name)]

    ok = property(lambda self: self._row("ok"))                # i32[steps, n]: the lane was allocated
    num_new = property(lambda self: self._row("num_new"))      # i32[steps, n]: tokens computed
    cache_hit = property(lambda self: self._row("cache_hit"))  # i32[steps, n]: prefix-cache tokens
    sampled = property(lambda self: self._row("sampled"))      # i32[steps, n]: a token was sampled
    tokens = property(lambda self: self._row("tokens"))        # i32[steps, n]: the token, or -1
    idle_next = property(lambda self: self._row("idle_next"))  # i32[steps, n]: its next decode only counts
    logprob = property(lambda self: self._row("logprob").view(np.float32))  # f32[steps, n]
    drafted = property(lambda self: self._row("drafted"))      # i32[steps, n]: draft tokens verified

    @property
    def top_ids(self) -> np.ndarray:
        """``i32[steps, N, n]``: the likeliest tokens, likeliest first."""
        N = (self.data.shape[1] - len(REPORT_ROWS)) // 2
        return self.data[:, len(REPORT_ROWS):len(REPORT_ROWS) + N]

    @property
    def top_logprobs(self) -> np.ndarray:
        """``f32[steps, N, n]``: their log-probabilities."""
        N = (self.data.shape[1] - len(REPORT_ROWS)) // 2
        return self.data[:, len(REPORT_ROWS) + N:].view(np.float32)

    def clean_decodes(self) -> np.ndarray:
        """``bool[steps]``: the steps where every lane decoded one token, allocated and sampled (one compare of
        the four rows: this runs every decode step)."""
        return (self.data[:, :len(_CLEAN_DECODE)] == _CLEAN_DECODE).all((1, 2))
