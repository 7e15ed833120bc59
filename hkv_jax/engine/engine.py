"""The host side of serving: which requests run and how many tokens each gets.

``Engine`` keeps the requests (prompt, generated tokens, computed count) and
a continuous-batching policy in Python: running requests first (one token
when decoding, a chunk of at most the remaining token budget when still
prefilling), then waiting ones while budget and request slots last. The plan
lists the decoding requests first, then the running ones with a chunk, then
the waiting ones (the order the vectorised step batches them in). Every
other decision runs on the device (``step.py``): ``prepare`` when a step
releases or admits requests (only the new prompts travel), then ``step``.
When the allocator refuses a request (``ok=False``), the latest admitted
running request is preempted in the next step and waits at the front of the
queue; its prefix may come back from the cache.

While every running request decodes and no waiting one can start (the
steady state of a full batch), the host keeps them as arrays (``_Decoding``):
it plans such a step from them, finds the finished requests with array
operations, and keeps their sampled tokens as arrays until ``Engine.requests``
is read or a request finishes (``step_tokens`` returns them as arrays too). Any
other step takes the per-request pass, which rebuilds those arrays.

Models with Mamba layers: a chunk that starts inside a block stops at the
next block boundary, so a Mamba state block, once full, holds the state
after exactly its last token (vLLM's 'align' mode; see ``hkv_jax.recurrent``).

Snapshots: ``snapshot``/``restore`` (copies, since the step donates its
state), ``fork`` (the child shares its parent's full blocks), and
``save``/``load`` of the whole engine (allocator + KV memory) with orbax.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import json
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from hkv_jax.allocator import ops
from hkv_jax.allocator.state import Layout, init_state
from hkv_jax.cache import init_cache, mesh_model_size
from hkv_jax.engine.score import prompt_logprobs
from hkv_jax.engine.step import SAMPLING, Changes, EngineState, StepPlan, StepStatic, decode_steps, prepare, step
from hkv_jax.planner import plan as plan_cache
from hkv_jax.sharding import param_shardings, replicated


# Module-level, so engines with the same model graph and sizes share compilations.
_STEP = jax.jit(step, static_argnums=0, donate_argnums=2)
_DECODE_STEPS = jax.jit(decode_steps, static_argnums=(0, 1), donate_argnums=3)
_PREPARE = jax.jit(prepare, static_argnums=(0, 3), donate_argnums=1)
_FORK = jax.jit(ops.fork, static_argnums=0, donate_argnums=1)
_PROMPT_LOGPROBS = jax.jit(prompt_logprobs, static_argnums=(0, 1, 2))
# New prompts travel in a flat buffer of a power-of-two size, at least this many tokens: few shapes of
# the (small) prepare program.
_MIN_PROMPT_BUFFER = 64
_NO_TOKENS = (np.zeros(0, np.int64), np.zeros(0, np.int32))
# Calls whose decode tokens may wait in a decode-only record before they are booked anyway: bounds
# the record's arrays (and the cost of passing them on when a request finishes) in long decodes.
_MAX_PENDING = 256
# Report rows ok, num_new, cache_hit, sampled of a lane that decoded one token and sampled it.
_CLEAN_DECODE = np.array([1, 1, 0, 1], np.int32)[:, None]


@functools.cache
def _sender(placement: jax.sharding.Sharding):
    """A copy to ``placement`` through a jitted identity: its C++ dispatch moves a small host array about 5x
    faster than ``jax.device_put`` (about 7 against 36 us on CPU)."""
    return jax.jit(lambda x: x, out_shardings=placement)


def _prompt_buffer(tokens: int) -> int:
    """The size of the prompt buffer that carries ``tokens`` prompt tokens to the device."""
    return max(_MIN_PROMPT_BUFFER, 1 << (tokens - 1).bit_length())


def _prompt_buffers(tokens: int) -> list[int]:
    """Every prompt-buffer size up to the one that carries ``tokens`` tokens."""
    return [_MIN_PROMPT_BUFFER << i for i in range((_prompt_buffer(tokens) // _MIN_PROMPT_BUFFER).bit_length())]


def _integer(x) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


def _number(x) -> bool:
    return isinstance(x, (int, float, np.integer, np.floating)) and not isinstance(x, bool)


# A request's sampling values: what each must be (``None`` leaves it to the engine).
_SAMPLING_RULES = {
    "temperature": (lambda x: _number(x) and 0 <= x < float("inf"), "finite and >= 0"),
    "top_p": (lambda x: _number(x) and 0 < x <= 1, "in (0, 1]"),
    "top_k": (lambda x: _integer(x) and x >= 0, "an integer >= 0 (0: no limit)"),
    "min_p": (lambda x: _number(x) and 0 <= x <= 1, "in [0, 1]"),
    "seed": (lambda x: _integer(x) and 0 <= x < 2**31, "an integer in [0, 2**31)"),
    "repetition_penalty": (lambda x: _number(x) and 0 < x < float("inf"), "finite and > 0 (1: none)"),
    "presence_penalty": (lambda x: _number(x) and -2 <= x <= 2, "in [-2, 2]"),
    "frequency_penalty": (lambda x: _number(x) and -2 <= x <= 2, "in [-2, 2]"),
}
# The values an engine sets for the requests that set none (``Engine.temperature`` ...).
_ENGINE_SAMPLING = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
                    "frequency_penalty")


def _checked_sampling(**values) -> dict:
    """``values`` (``_SAMPLING_RULES`` names) as Python numbers, ``None`` kept; ``ValueError`` for one out
    of range."""
    out = {}
    for name, value in values.items():
        ok, what = _SAMPLING_RULES[name]
        if value is not None and not ok(value):
            raise ValueError(f"{name} must be {what}, got {value!r}")
        out[name] = None if value is None else int(value) if _integer(value) else float(value)
    return out


def _book_logprobs(r: Request, rows: np.ndarray) -> None:
    """Append ``k`` generated tokens' log-probabilities to ``r``: ``rows: i32[k, 1 + 2N]``, the report's rows
    from ``logprob`` on (the sampled token's, then ``N`` likeliest tokens and theirs, as float32 bits)."""
    r.logprobs += rows[:, 0].view(np.float32).tolist()
    if r.num_top_logprobs:
        n, N = r.num_top_logprobs, (rows.shape[1] - 1) // 2
        ids, values = rows[:, 1:1 + n].tolist(), rows[:, 1 + N:1 + N + n].view(np.float32).tolist()
        r.top_logprobs += [list(zip(i, v)) for i, v in zip(ids, values)]


def _nbytes(tree) -> int:
    return sum(np.asarray(x).nbytes for x in jax.tree.leaves(tree))


@dataclass
class Request:
    """A request as the host sees it. Read it through ``Engine.requests`` after a step: steps where every
    running request decodes book their tokens into ``generated`` and ``computed`` only when
    ``Engine.requests`` is read (or the request finishes, or 256 calls passed), so an object kept from
    before a step can lag."""

    rid: int
    prompt: list[int]
    max_new_tokens: int
    slot: int = -1
    admitted: bool = False      # add_request ran (its tokens live in the allocator)
    computed: int = 0           # tokens with KV in the cache
    generated: list[int] = field(default_factory=list)
    cache_hit: int = 0          # prefix-cache tokens of its first (or post-preemption) schedule
    preemptions: int = 0
    salt: int = 0               # cache salt: requests hit only blocks cached under the same salt
    max_chunk: int = 1 << 30    # lowered when even alone it could not get blocks for a chunk
    stop: tuple[int, ...] = ()  # tokens that end it (EOS); included in ``generated``
    stop_strings: tuple[str, ...] = ()  # text that ends it (``add_request``); its tokens stay in ``generated``
    stop_string: str | None = None      # the one of ``stop_strings`` that ended it
    aborted: bool = False       # ``Engine.abort`` ended it early
    temperature: float | None = None  # its sampling (None: the engine's value; see ``add_request``)
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = None     # its draws' seed (None: the engine's key)
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token, bias) added to its logits before sampling
    min_tokens: int = 0         # its stop tokens are masked, and stop strings not looked for, until it has these
    logprobs: list[float] | None = None  # each generated token's log-probability, if asked (``add_request``)
    num_top_logprobs: int = 0   # likeliest tokens listed per generated token (``add_request``)
    top_logprobs: list[list[tuple[int, float]]] | None = None  # per generated token: (token, log-probability)
    # ``time.time()`` when ``add_request`` queued it, when its first token was booked, when it finished or
    # was aborted (a token is booked when the step that sampled it returns).
    arrival_time: float = 0.0
    first_token_time: float | None = None
    finished_time: float | None = None

    @property
    def prompt_len(self) -> int:
        return len(self.prompt)

    @property
    def total(self) -> int:
        """Known tokens: prompt + generated."""
        return len(self.prompt) + len(self.generated)

    @property
    def done(self) -> bool:
        """Whether it produced all its tokens, a stop token or a stop string, or was aborted."""
        return self.finish_reason is not None

    @property
    def finish_reason(self) -> str | None:
        """Why it ended, in vLLM's words: ``"stop"`` (a stop token or stop string), ``"length"``
        (``max_new_tokens`` generated), ``"abort"`` (``Engine.abort``); ``None`` while it is not done."""
        if self.aborted:
            return "abort"
        if self.stop_string is not None or (self.generated and self.generated[-1] in self.stop):
            return "stop"
        return "length" if len(self.generated) >= self.max_new_tokens else None


@dataclass
class Stats:
    """Counters over the engine's life."""

    steps: int = 0
    tokens_computed: int = 0
    prompt_tokens: int = 0
    cache_hit_tokens: int = 0
    generated: int = 0
    preemptions: int = 0
    aborted: int = 0
    host_to_device_bytes: int = 0   # plans (when they change), releases and new prompts
    device_to_host: int = 0         # reads of a step's report (one per step; two after a lean miss)
    prepare_calls: int = 0          # steps that released or admitted requests
    bucket_steps: dict[str, int] = field(default_factory=dict)  # steps per program: token bucket, "lean " ones
    lean_misses: int = 0            # lean steps that found a block to move (the full step ran after)
    array_steps: int = 0            # decode-only steps planned and booked with arrays, not per request
    multi_step_calls: int = 0       # programs that ran several decode steps (``decode_steps > 1``)
    seconds: float = 0.0            # in ``step()``
    device_seconds: float = 0.0     # ... from the first program's dispatch to the report's arrival


@dataclass
class _Decoding:
    """The running requests when every one of them decodes (the steady state a step leaves most often),
    in running order, with what a decode-only step needs per request as arrays."""

    rids: list[int]
    requests: list[Request]
    slots: np.ndarray          # i32[n]
    rid_array: np.ndarray      # i64[n]: ``rids``
    tokens_left: np.ndarray    # i64[n]: max_new_tokens - generated (pending tokens counted)
    stops: np.ndarray          # i32[k]: every stop token of these requests (a candidate filter)
    logprobs: bool             # some of them keep their tokens' log-probabilities
    # Tokens of booked steps not yet in the requests' ``generated`` and ``computed``: i32[k, n] blocks.
    # Appending them request by request costs more than the step itself at large batches, so they wait
    # until something reads the requests (``Engine.requests``) or a request finishes.
    pending: list[np.ndarray] = field(default_factory=list)
    # Their reports' rows from ``logprob`` on (i32[k, 1 + 2N, n] blocks: ``_book_logprobs``), kept only when
    # some of these requests asked for log-probabilities.
    pending_logprobs: list[np.ndarray] = field(default_factory=list)
    # The plan of a step that decodes them all, with the engine's sampling values it was packed for:
    # every such step plans the same, so it is packed (and sent to the device) once.
    plan: tuple[tuple[float, float], StepPlan] | None = None

    @staticmethod
    def of(requests: list[Request]) -> "_Decoding":
        """The record of ``requests``, which must all be decoding."""
        rids = [r.rid for r in requests]
        return _Decoding(rids, requests, np.array([r.slot for r in requests], np.int32), np.array(rids, np.int64),
                         np.array([r.max_new_tokens - len(r.generated) for r in requests], np.int64),
                         np.array(sorted({t for r in requests for t in r.stop}), np.int32),
                         any(r.logprobs is not None for r in requests))

    def flush(self, cols: list[int] | None = None) -> None:
        """Move the pending tokens into the requests at positions ``cols`` (default: all of them, and
        nothing stays pending)."""
        if not self.pending:
            return
        block = np.concatenate(self.pending) if len(self.pending) > 1 else self.pending[0]   # [k, n]
        logprobs = np.concatenate(self.pending_logprobs) if self.pending_logprobs else None
        k = block.shape[0]
        if cols is None:
            self.pending, self.pending_logprobs = [], []
            cols = range(len(self.requests))
        for i, toks in zip(cols, block[:, cols].T.tolist()):
            r = self.requests[i]
            r.computed += k
            r.generated += toks
            if r.logprobs is not None:
                _book_logprobs(r, logprobs[:, :, i])

    def take(self, keep: list[int]) -> "_Decoding":
        """The record of the requests at positions ``keep`` (their pending tokens with them)."""
        return _Decoding([self.rids[i] for i in keep], [self.requests[i] for i in keep], self.slots[keep],
                         self.rid_array[keep], self.tokens_left[keep], self.stops, self.logprobs,
                         [p[:, keep] for p in self.pending], [p[..., keep] for p in self.pending_logprobs])


class Engine:
    """A serving loop around the jitted step for an NNX model with the ``paged`` protocol
    (``hkv_jax.models.tiny.TinyLM.paged``: ``cfg.layers``, ``cfg.vocab_size`` and ``paged``).

    ``token_budget`` caps the tokens computed per step. The step is compiled once per size in
    ``token_buckets`` (default: ``max_requests`` and ``token_budget``), and each step runs the smallest
    that holds its tokens: a decode-only step does not pay for prefill-sized arrays. Pass one bucket
    to compile once. ``vectorised=False`` runs the allocator request by request (the exact statement,
    for tests and comparisons). Raises ``ValueError`` for sizes that cannot serve, before anything
    is compiled.

    ``mesh`` (``hkv_jax.sharding.make_mesh``: axes ``data`` and ``model``): serve tensor-parallel over its
    ``model`` axis (weights split Megatron-style, the KV pool split by KV head where the heads divide,
    the allocator replicated; see ``hkv_jax.sharding``). The results equal a single-device engine's.

    ``decode_steps``: while every running request decodes and no waiting one can start, one call of
    ``step()`` runs up to this many decode steps in one program (one dispatch and one report read for
    all of them; it stops early at a finished or refused request), returns the tokens of all of them,
    and leaves the last one's logits in ``last_output``. The tokens and the states equal those of single
    steps. 1 (the default) runs one step per call.

    ``max_call_seconds`` (with ``decode_steps > 1``): about the longest such a call should take, since a
    request that arrives meanwhile waits for it and its tokens stream out at its end. A call then runs as
    many steps as fit at the last timed decode call's seconds per step (at most ``decode_steps``), and one
    step until a call has been timed; calls that compiled a program are not timed. So cheap steps (a
    small model, an accelerator) share one dispatch and report read, and slow ones run one at a time.
    ``None`` (the default): always up to ``decode_steps``. ``hkv demo``, ``generate`` and ``serve`` run
    ``decode_steps=32, max_call_seconds=0.02``.

    ``temperature`` (0, the default: greedy), ``top_p`` (1.0), ``top_k`` (0: none), ``min_p`` (0.0),
    ``repetition_penalty`` (1.0: none), ``presence_penalty`` and ``frequency_penalty`` (0.0) are the
    sampling of the requests that set none of their own (``add_request``), read and checked at every
    step (a value out of range: ``ValueError`` from ``step()``, nothing changed).

    ``detokenize`` (token ids -> text, e.g. ``TextCodec.decode``): the text of generated tokens, which
    requests with stop strings (``add_request(..., stop_strings=)``) and ``text`` need.

    ``max_top_logprobs``: the most likeliest tokens a request may ask to see, with their log-probabilities,
    per generated token (``add_request(..., top_logprobs=)``). 0 (the default) leaves that out of the
    step; ``N > 0`` makes every step find the ``N`` likeliest tokens of every row and read them back.

    ``max_logit_bias``: the most logit-bias entries a request may carry (``add_request(..., logit_bias=,
    min_tokens=)``: ``min_tokens`` takes one per stop token). 0 (the default) leaves them out of the
    plan and the step; ``M > 0`` sends ``2M`` more words per request with each new plan, and steps where
    some request has an entry add them to its logits.
    """

    def __init__(self, model, *, num_blocks: int, block_size: int = 16, max_requests: int = 8,
                 max_model_len: int = 256, token_budget: int = 64, policy: str = "vllm",
                 impl: str = "auto", seed: int = 0, prefix_caching: bool = True,
                 window_aware_eviction: bool = False, vectorised: bool = True,
                 token_buckets: tuple[int, ...] | None = None, mesh: jax.sharding.Mesh | None = None,
                 decode_steps: int = 1, max_call_seconds: float | None = None,
                 detokenize: Callable[[list[int]], str] | None = None,
                 max_top_logprobs: int = 0, max_logit_bias: int = 0):
        for name, value in (("token_budget", token_budget), ("max_requests", max_requests),
                            ("max_model_len", max_model_len), ("block_size", block_size),
                            ("decode_steps", decode_steps)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if max_call_seconds is not None and not (_number(max_call_seconds) and 0 < max_call_seconds < float("inf")):
            raise ValueError(f"max_call_seconds must be a positive number of seconds or None, got {max_call_seconds!r}")
        if not _integer(max_top_logprobs) or not 0 <= max_top_logprobs <= model.cfg.vocab_size:
            raise ValueError(f"max_top_logprobs must be an integer in [0, vocab_size], got {max_top_logprobs!r}")
        if not _integer(max_logit_bias) or not 0 <= max_logit_bias <= model.cfg.vocab_size:
            raise ValueError(f"max_logit_bias must be an integer in [0, vocab_size], got {max_logit_bias!r}")
        buckets = sorted(set(token_buckets or (min(max_requests, token_budget), token_budget)))
        if buckets[0] < 1 or buckets[-1] != token_budget:
            raise ValueError(f"token_buckets must be positive and end at token_budget {token_budget}, got {buckets}")
        self.config = plan_cache(model.cfg.layers, block_size=block_size, policy=policy, num_blocks=num_blocks)
        need = self.config.blocks_per_request(max_model_len)
        if num_blocks - 1 < need:
            raise ValueError(f"a pool of {num_blocks} blocks (null block included) cannot hold one request of "
                             f"max_model_len {max_model_len} tokens: it needs {need} blocks besides the null block")
        self.layout = Layout.from_config(self.config, max_model_len=max_model_len, max_requests=max_requests,
                                         window_aware_eviction=window_aware_eviction)
        if mesh is not None:
            mesh_model_size(mesh)  # checks the axis names
        self.mesh = mesh
        graphdef, params = nnx.split(model)
        if mesh is not None:
            params = jax.device_put(params, param_shardings(params, model.cfg, mesh))
        self.params, params_def = jax.tree.flatten(params)
        self.vocab_size = model.cfg.vocab_size
        self.detokenize = detokenize
        self.model_layers = model.cfg.layers
        self._align = any(self.layout.is_mamba(g) for g in range(self.layout.num_groups))
        self.token_budget = token_budget
        self.max_top_logprobs = max_top_logprobs
        self.max_logit_bias = max_logit_bias
        self.statics = [StepStatic(graphdef, params_def, self.layout, b, impl, vectorised,
                                   top_logprobs=max_top_logprobs) for b in buckets]
        self._lean = [replace(s, lean=True) for s in self.statics]
        self.vectorised = vectorised
        self.decode_steps = decode_steps if vectorised else 1  # the per-request engine: one step a call
        self.max_call_seconds = max_call_seconds
        # The last timed decode call's seconds per step and the requests it decoded.
        self._step_seconds: tuple[float, int] | None = None
        # Slots whose next decode only counts a token (the last report's ``idle_next``).
        self._idle_next = np.zeros(max_requests, bool)
        # Committed to their devices from the start, as a checkpoint restores them: a restored state then
        # runs the programs already compiled.
        self._placement = placement = (jax.sharding.SingleDeviceSharding(jax.devices()[0]) if mesh is None
                                       else replicated(mesh))
        alloc, key = jax.device_put((init_state(self.layout), jax.random.PRNGKey(seed)), placement)
        cache = init_cache(self.config, mesh)
        self.state = EngineState(alloc, cache if mesh is not None else jax.device_put(cache, placement), key)
        self._sent: tuple[np.ndarray, StepPlan] | None = None  # the last plan sent: its host data, device copy
        self._requests: dict[int, Request] = {}
        self.waiting: list[int] = []   # request ids, front first
        self.running: list[int] = []   # admission order
        self._to_free: list[int] = []  # slots freed in the next step
        self._to_preempt: list[int] = []
        self._next_id = 0
        self.stats = Stats()
        self.temperature, self.top_p, self.top_k, self.min_p = 0.0, 1.0, 0, 0.0
        self.repetition_penalty, self.presence_penalty, self.frequency_penalty = 1.0, 0.0, 0.0
        self._engine_sampling: tuple[tuple, dict] = ((), {})  # the values last checked, and as checked
        # Without prefix caching every admission gets a salt of its own, so nothing ever hits.
        self.prefix_caching = prefix_caching
        self._admissions = 0
        self._hold_admissions = False
        self.last_output = None  # the last step's StepOutput, on the device
        self._last_order: list[int] = []  # request ids of last_output's rows
        self._last_rows: dict[int, int] | None = None
        self._decoding: _Decoding | None = None

    # --- requests -------------------------------------------------------------------------

    @property
    def requests(self) -> dict[int, Request]:
        """Every request by id, with its ``generated`` tokens and ``computed`` count up to date."""
        if self._decoding is not None:
            self._decoding.flush()
        return self._requests

    def add_request(self, prompt, max_new_tokens: int, stop: tuple[int, ...] = (), *,
                    stop_strings: str | tuple[str, ...] = (),
                    temperature: float | None = None, top_p: float | None = None, top_k: int | None = None,
                    min_p: float | None = None, repetition_penalty: float | None = None,
                    presence_penalty: float | None = None, frequency_penalty: float | None = None,
                    seed: int | None = None, logprobs: bool = False, top_logprobs: int = 0,
                    logit_bias: dict[int, float] | None = None, min_tokens: int = 0) -> int:
        """Queue a request; returns its id. It ends after ``max_new_tokens``, at a token in ``stop`` (e.g.
        the model's EOS ids), or once the text of its generated tokens (``Engine(detokenize=)``) holds one
        of ``stop_strings``: it keeps the tokens up to that one, ``Request.stop_string`` names the string,
        and ``text`` gives the text before it. A step whose batch holds a request with stop strings books
        its tokens request by request (no decode-only record), as it must look at each one's text.

        Its own sampling (``hkv_jax.engine.sample``; ``None``: the engine's value of each step):
        ``temperature`` (0: greedy), ``top_p``, ``top_k`` (0: no limit) and ``min_p``; vLLM's penalties
        (``hkv_jax.engine.step.penalize``, greedy requests too): ``repetition_penalty`` (1: none) on every
        token seen, ``presence_penalty`` and ``frequency_penalty`` on generated ones. ``seed`` (in
        [0, 2**31)) makes its sampled tokens reproducible: each draw's key comes from the seed and the
        token's position only, so the same request samples the same tokens in any batch, engine or step
        order (given the same logits). ``logprobs``: keep each generated token's log-probability under
        the model (its logits before temperature and the cuts) in ``Request.logprobs``. ``top_logprobs``
        (at most the engine's ``max_top_logprobs``): also list, per generated token, the
        ``top_logprobs`` likeliest tokens with theirs in ``Request.top_logprobs`` (likeliest first;
        implies ``logprobs``).

        ``logit_bias`` (token -> value in [-100, 100], OpenAI's range) is added to its logits before the
        penalties and the sampling (not to what ``logprobs`` reports). ``min_tokens``: it generates at
        least this many tokens before a stop token can be sampled (vLLM's ``min_tokens``: they are
        masked until then) and before its stop strings are looked for. Both take entries of the
        engine's ``max_logit_bias``: one per bias, and one per stop token while ``min_tokens`` is set.

        Raises ``ValueError`` for a bad prompt (``check_prompt``), when it cannot fit ``max_model_len`` or
        for sampling values out of range."""
        if not _integer(max_new_tokens) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
        prompt = self.check_prompt(prompt, max_new_tokens)
        stop_strings = (stop_strings,) if isinstance(stop_strings, str) else tuple(stop_strings)
        if not all(isinstance(x, str) and x for x in stop_strings):
            raise ValueError(f"stop_strings must be non-empty strings, got {stop_strings!r}")
        if stop_strings and self.detokenize is None:
            raise ValueError("stop_strings need the engine's detokenize (Engine(..., detokenize=codec.decode))")
        if not _integer(top_logprobs) or not 0 <= top_logprobs <= self.max_top_logprobs:
            raise ValueError(f"top_logprobs must be an integer in [0, {self.max_top_logprobs}] (the engine's "
                             f"max_top_logprobs), got {top_logprobs!r}")
        sampling = _checked_sampling(temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p, seed=seed,
                                     repetition_penalty=repetition_penalty, presence_penalty=presence_penalty,
                                     frequency_penalty=frequency_penalty)
        bias = self._bias_entries(logit_bias, min_tokens, stop, max_new_tokens)
        rid = self._next_id
        self._next_id += 1
        self._requests[rid] = Request(rid, prompt, max_new_tokens, stop=tuple(int(t) for t in stop),
                                      stop_strings=stop_strings, logprobs=[] if logprobs or top_logprobs else None,
                                      num_top_logprobs=top_logprobs, top_logprobs=[] if top_logprobs else None,
                                      logit_bias=bias, min_tokens=min_tokens, arrival_time=time.time(), **sampling)
        self.waiting.append(rid)
        return rid

    def check_prompt(self, prompt, max_new_tokens: int = 0) -> list[int]:
        """``prompt`` as a list of ints, checked: ``ValueError`` when it is empty, holds a token outside the
        vocabulary, or leaves no room in ``max_model_len`` for ``max_new_tokens`` more tokens."""
        prompt = [int(t) for t in prompt]
        if not prompt:
            raise ValueError("a prompt needs at least one token")
        if not all(0 <= t < self.vocab_size for t in prompt):
            raise ValueError(f"prompt tokens must lie in [0, {self.vocab_size})")
        if len(prompt) + max_new_tokens > self.layout.max_model_len:
            raise ValueError(f"prompt ({len(prompt)}) + max_new_tokens ({max_new_tokens}) exceeds "
                             f"max_model_len {self.layout.max_model_len}")
        return prompt

    def _bias_entries(self, logit_bias, min_tokens, stop, max_new_tokens: int) -> tuple[tuple[int, float], ...]:
        """``add_request``'s ``logit_bias`` and ``min_tokens`` checked, as the request's bias entries (a stop
        token under ``min_tokens``: -inf, which ``bias_logits`` lifts once it has that many tokens)."""
        if not _integer(min_tokens) or not 0 <= min_tokens <= max_new_tokens:
            raise ValueError(f"min_tokens must be an integer in [0, max_new_tokens], got {min_tokens!r}")
        if not isinstance(logit_bias, dict | None):
            raise ValueError(f"logit_bias must be a dict of token -> bias, got {type(logit_bias).__name__}")
        entries = []
        for t, v in (logit_bias or {}).items():
            if not _integer(t) or not 0 <= t < self.vocab_size or not _number(v) or not -100 <= v <= 100:
                raise ValueError(f"logit_bias maps tokens in [0, {self.vocab_size}) to values in [-100, 100], "
                                 f"got {t!r}: {v!r}")
            entries.append((int(t), float(v)))
        if min_tokens:
            entries += [(int(t), float("-inf")) for t in dict.fromkeys(stop)]
        if len(entries) > self.max_logit_bias:
            raise ValueError(f"logit_bias and min_tokens need {len(entries)} bias entries (one per bias, one per "
                             f"stop token under min_tokens); the engine has max_logit_bias {self.max_logit_bias}")
        return tuple(entries)

    def text(self, rid: int, stable: bool = False) -> str:
        """The text of request ``rid``'s generated tokens (``detokenize``), up to its stop string if one
        ended it (vLLM's output text). ``stable``: while it runs, leave out the end that later tokens may
        still change (up to 3 trailing U+FFFD, the most a character whose bytes are not all there yet
        shows as, and the last characters, which might begin a stop string), so that streamed pieces of
        it add up to the final text."""
        if self.detokenize is None:
            raise ValueError("text needs the engine's detokenize (Engine(..., detokenize=codec.decode))")
        r = self.requests[rid]
        text = self.detokenize(r.generated)
        if r.stop_string is not None:
            return text[:self._stop_strings_in(r, text)[r.stop_string]]
        if stable and not r.done:
            held = min(len(text) - len(text.rstrip("\ufffd")), 3) + max(map(len, r.stop_strings), default=1) - 1
            return text[:max(len(text) - held, 0)]
        return text

    def _reached_stop_string(self, r: Request) -> bool:
        """Whether ``r``'s text holds one of its stop strings (the earliest becomes ``r.stop_string``). It runs
        after each of ``r``'s tokens, so a string not found before ends in the newest token's text: the
        text of the last few tokens is searched (a token holds at least a quarter of a character, as
        byte-fallback pieces do), and the whole text only on a hit, so a long generation is not decoded
        whole every step."""
        tail = self.detokenize(r.generated[-4 * (max(map(len, r.stop_strings)) + 2):])
        if not any(s in tail for s in r.stop_strings):
            return False
        found = self._stop_strings_in(r, self.detokenize(r.generated))
        if found:
            r.stop_string = min(found, key=found.get)
        return bool(found)

    def _stop_strings_in(self, r: Request, text: str) -> dict[str, int]:
        """The index in ``text`` of each of ``r``'s stop strings found there, first occurrence. Under
        ``min_tokens`` only a string that ends after the text of its first ``min_tokens`` tokens counts,
        as in vLLM, which looks for them only in the text that comes after."""
        floor = len(self.detokenize(r.generated[:r.min_tokens])) if r.min_tokens else 0
        at = {s: text.find(s, max(floor - len(s) + 1, 0)) for s in r.stop_strings}
        return {s: i for s, i in at.items() if i >= 0}

    def prompt_logprobs(self, prompt, top: int = 0) -> list[tuple[float, list[tuple[int, float]]] | None]:
        """Each token of ``prompt``'s log-probability given the tokens before it, under the model's raw
        logits (vLLM's ``prompt_logprobs``; OpenAI's ``echo`` with ``logprobs``): ``None`` for the first
        token (nothing comes before it), then ``(log-probability, [(token, log-probability)] of the
        ``top`` likeliest tokens at that position, likeliest first)`` per token.

        It runs the model's uncached forward (``hkv_jax.engine.score``), compiled once per prompt-buffer
        size (powers of two, at least 64 tokens: ``compile_scoring``), whatever ``top``, and changes
        nothing: not the cache, not the requests. ``ValueError`` for a bad prompt (``check_prompt``) or
        ``top`` over ``max_top_logprobs``."""
        prompt = self.check_prompt(prompt)
        if not _integer(top) or not 0 <= top <= self.max_top_logprobs:
            raise ValueError(f"top must be an integer in [0, {self.max_top_logprobs}] (the engine's "
                             f"max_top_logprobs), got {top!r}")
        tokens = np.zeros(_prompt_buffer(len(prompt)), np.int32)
        tokens[:len(prompt)] = prompt
        logprob, ids, values = self._score(tokens)
        return [None] + [(float(logprob[j]), list(zip(ids[j, :top].tolist(), values[j, :top].tolist())))
                         for j in range(len(prompt) - 1)]

    def _score(self, tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``score.prompt_logprobs`` of a prompt buffer, with the ``max_top_logprobs`` likeliest tokens (one
        program per buffer size), read back."""
        static = self.statics[0]
        return jax.device_get(_PROMPT_LOGPROBS(static.graphdef, static.params_def, self.max_top_logprobs,
                                               self.params, tokens))

    def compile_scoring(self) -> None:
        """Compile ``prompt_logprobs``'s program for every prompt-buffer size a prompt of up to
        ``max_model_len`` tokens takes (each takes about 1.5 s for Gemma 3 270M on a CPU), so that no
        scoring request waits for one later."""
        for size in _prompt_buffers(self.layout.max_model_len):
            self._score(np.zeros(size, np.int32))

    def abort(self, rid: int) -> bool:
        """End request ``rid`` now (its client went away): it leaves the queue or the batch with the tokens
        generated so far, and the next step frees its blocks (full ones stay in the prefix cache). Returns
        ``False`` if it had already ended; ``KeyError`` for an id never added."""
        requests = self.requests  # books the decode tokens still pending
        if rid not in requests:
            raise KeyError(f"no request {rid}")
        r = requests[rid]
        if rid in self.waiting:
            self.waiting.remove(rid)
        elif rid in self.running:
            self.running.remove(rid)
        else:
            return False
        if r.slot >= 0:  # its tokens live in the allocator (admitted, refused or preempted): free them
            if r.slot in self._to_preempt:
                self._to_preempt.remove(r.slot)
            self._to_free.append(r.slot)
            r.slot = -1
        r.aborted, r.finished_time = True, time.time()
        self.stats.aborted += 1
        self._decoding = None  # the next step plans request by request and rebuilds the record
        return True

    def forget(self, rid: int) -> Request:
        """Drop finished request ``rid`` from ``requests`` and return it, so that a long-running server's
        record of past requests does not grow without end. ``ValueError`` while it is not done."""
        r = self.requests[rid]
        if not r.done:
            raise ValueError(f"request {rid} is not done")
        return self._requests.pop(rid)

    def _free_slot(self) -> int:
        used = {r.slot for r in self.requests.values() if r.slot >= 0} | set(self._to_free)
        return next((s for s in range(self.layout.max_requests) if s not in used), -1)

    # --- one step -------------------------------------------------------------------------

    def _chunk(self, r: Request, budget: int) -> int:
        """Tokens ``r`` computes this step: what is left, within the budget and its chunk limit."""
        left = len(r.prompt) + len(r.generated) - r.computed
        if left == 1:  # decoding (the usual case, first)
            return min(1, budget)
        n = min(left, budget, r.max_chunk)
        bs = self.layout.block_size
        if self._align and r.computed % bs:
            n = min(n, bs - r.computed % bs)  # Mamba: stop at the block boundary
        return n

    def _plan(self) -> tuple[StepPlan, Changes | None, list[int], list[int], int, int]:
        """This step's plan (decoding requests, then running ones with a chunk, then waiting ones), its
        releases and admissions (``None`` when there are none), the planned request ids, the admitted
        ones, and how many of the planned requests decode one token and how many are running.
        ``ValueError`` (before anything changes) for an engine sampling value out of range."""
        values = tuple(getattr(self, name) for name in _ENGINE_SAMPLING)
        if values != self._engine_sampling[0]:  # checked once per change: this runs every step
            self._engine_sampling = values, _checked_sampling(**dict(zip(_ENGINE_SAMPLING, values)))
        engine = self._engine_sampling[1]
        R = self.layout.max_requests
        budget = self.token_budget
        hold, self._hold_admissions = self._hold_admissions, False
        d = self._decoding
        if d is not None and len(d.rids) <= budget and (hold or not self.waiting or len(d.rids) in (R, budget)):
            n = len(d.rids)  # every running request decodes, and no waiting one can start: no pass over them
            sampling = values
            if d.plan is None or d.plan[0] != sampling:
                slots = np.full(R, -1, np.int32)
                slots[:n] = d.slots
                want = np.zeros(R, np.int32)
                want[:n] = 1
                d.plan = sampling, StepPlan.pack(slots, want, **self._sampling(d.requests, engine))
            return d.plan[1], self._changes([]), d.rids, [], n, n
        decoding: list[tuple[int, int]] = []  # (request id, tokens)
        chunked: list[tuple[int, int]] = []
        requests = self.requests
        for rid in self.running:
            r = requests[rid]
            if budget > 0 and len(r.prompt) + len(r.generated) - r.computed == 1:  # decoding: the usual case
                decoding.append((rid, 1))
                budget -= 1
                continue
            n = self._chunk(r, budget)
            if n > 0:
                (decoding if n == 1 else chunked).append((rid, n))
                budget -= n
        picks = decoding + chunked
        admit: list[int] = []
        for rid in list(self.waiting):
            if hold or budget <= 0 or len(picks) >= R:
                break
            r = self.requests[rid]
            if not r.admitted:
                if r.slot < 0:
                    r.slot = self._free_slot()
                    if r.slot < 0:
                        break
                admit.append(rid)
            n = self._chunk(r, budget)
            picks.append((rid, n))
            budget -= n
        order = [rid for rid, _ in picks]
        slots = np.full(R, -1, np.int32)
        want = np.zeros(R, np.int32)
        slots[:len(picks)] = [self.requests[rid].slot for rid in order]
        want[:len(picks)] = [n for _, n in picks]
        plan = StepPlan.pack(slots, want, **self._sampling([requests[rid] for rid in order], engine))
        return plan, self._changes(admit), order, admit, len(decoding), len(decoding) + len(chunked)

    def _sampling(self, requests: list[Request], engine: dict) -> dict:
        """``StepPlan.pack``'s sampling arguments for ``requests``: each value by ``SAMPLING`` name, ``[R]``
        each: its own, else the ``engine``'s (no seed: none), its prompt's length and ``min_tokens``;
        neutral (greedy) past them. With ``max_logit_bias``, also their bias entries (``bias``)."""
        R, n = self.layout.max_requests, len(requests)
        columns = {}
        for name, dtype, off in SAMPLING:
            default = engine.get(name, off)
            columns[name] = np.full(R, off, dtype)
            columns[name][:n] = [default if (v := getattr(r, name)) is None else v for r in requests]
        if self.max_logit_bias:
            ids = np.full((R, self.max_logit_bias), -1, np.int32)
            values = np.zeros((R, self.max_logit_bias), np.float32)
            for i, r in enumerate(requests):
                for j, (t, v) in enumerate(r.logit_bias):
                    ids[i, j], values[i, j] = t, v
            columns["bias"] = ids, values
        return columns

    def _changes(self, admit: list[int]) -> Changes | None:
        """The releases of this step and the prompts of the requests it admits (``None``: nothing)."""
        if not (admit or self._to_free or self._to_preempt):
            return None
        R = self.layout.max_requests
        free = np.zeros(R, bool)
        free[self._to_free] = True
        preempt = np.zeros(R, bool)
        preempt[self._to_preempt] = True
        slots = np.full(R, -1, np.int32)
        lens = np.zeros(R, np.int32)
        salts = np.zeros(R, np.uint32)
        prompts: list[int] = []
        for i, rid in enumerate(admit):
            r = self.requests[rid]
            if not self.prefix_caching:
                self._admissions += 1
                r.salt = self._admissions
            toks = r.prompt + r.generated
            slots[i], lens[i], salts[i] = r.slot, len(toks), r.salt
            prompts += toks
        buffer = np.zeros(_prompt_buffer(len(prompts)), np.int32)
        buffer[:len(prompts)] = prompts
        return Changes(free=free, preempt=preempt, slots=slots, prompts=buffer, lens=lens, salts=salts)

    def step(self) -> list[tuple[int, int]]:
        """Run one step (up to ``decode_steps`` decode steps: see the class); returns the (request id, token)
        pairs sampled in it, in step order (``step_tokens`` returns them as two arrays)."""
        rids, tokens = self.step_tokens()
        return list(zip(rids.tolist(), tokens.tolist()))

    def step_tokens(self) -> tuple[np.ndarray, np.ndarray]:
        """``step()`` without a Python object per token: the request ids ``i64[n]`` and tokens ``i32[n]``
        sampled in it, in step order. At hundreds of requests a step, building the pairs costs more
        host time than the rest of the step's bookkeeping."""
        t0 = time.perf_counter()
        plan, changes, order, admit, decoding, running = self._plan()
        if not order and changes is None:
            return _NO_TOKENS
        t_dispatch = time.perf_counter()
        if changes is not None:
            with self._on_mesh():
                alloc = _PREPARE(self.layout, self.state.alloc, changes, self.vectorised)
            self.state = replace(self.state, alloc=alloc)
            self.stats.host_to_device_bytes += _nbytes(changes)
            self.stats.prepare_calls += 1
            self._to_free, self._to_preempt = [], []
        for rid in admit:
            self.requests[rid].admitted = True
        if not order:  # only releases
            jax.block_until_ready(self.state.alloc.counts)
            t = time.perf_counter()
            self.stats.device_seconds += t - t_dispatch
            self.stats.seconds += t - t0
            return _NO_TOKENS
        k = len(order)
        d = self._decoding
        multi = self.decode_steps > 1 and order is getattr(d, "rids", None)  # a decode-only record
        steps = (self._steps_per_call(k) if multi
                 and (not self.waiting or k in (self.layout.max_requests, self.token_budget)) else 1)
        timed = multi and self.max_call_seconds is not None
        compiled = Engine.compilations() if timed else 0
        if steps > 1:
            reports = self._run_decode_steps(plan, d, steps)[:, :, :k]  # no step of them could admit a request
        else:
            # A decode step whose requests the last report found idle runs the lean program (checked
            # there: if a block would move after all, it applies nothing and the full step runs).
            slots = plan.slots[:k]
            lean = decoding == k and changes is None and self.vectorised and bool(self._idle_next[slots].all())
            reports = self._run(plan, lean)[None, :, :k]
        self._last_order, self._last_rows = order, None
        self.stats.device_seconds += time.perf_counter() - t_dispatch
        sampled = self._apply(order, running, plan, reports)
        t = time.perf_counter()
        self.stats.seconds += t - t0
        if timed and Engine.compilations() == compiled:
            self._step_seconds = (t - t0) / len(reports), k
        return sampled

    def _steps_per_call(self, requests: int) -> int:
        """Decode steps the next call of several, over ``requests`` requests, may run: ``decode_steps``, or as
        many as fit ``max_call_seconds`` at the last timed rate (one until a call has been timed). That rate
        is scaled up in proportion when more requests decode now than then: a step's cost grows less than
        its batch, so the bound still holds when the batch grows."""
        if self.max_call_seconds is None:
            return self.decode_steps
        if self._step_seconds is None:
            return 1
        seconds, then = self._step_seconds
        seconds *= max(1.0, requests / then)
        return max(1, min(self.decode_steps, int(self.max_call_seconds / seconds)))

    def _apply(self, order: list[int], running: int, plan: StepPlan,
               reports: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Book the reports of consecutive steps of one plan (``i32[steps, rows, len(order)]``); returns their
        sampled request ids and tokens in step order. The leading steps that decoded every request of
        the decode-only record, each allocated and sampled, are booked at once with arrays."""
        self._idle_next[:] = False
        self._idle_next[plan.slots[:len(order)][reports[-1, 5] != 0]] = True
        d = self._decoding
        clean = 0
        if order is getattr(d, "rids", None):
            ok = (reports[:, :4] == _CLEAN_DECODE).all((1, 2))
            clean = len(ok) if ok.all() else int(ok.argmin())
        rids, tokens = self._book_decodes(d, reports[:clean]) if clean else _NO_TOKENS
        self.stats.steps += len(reports)
        self.stats.array_steps += clean
        for report in reports[clean:]:  # at most one: a window stops at the first step the host must see
            events = self._book(order, running, plan, report)
            if events:
                rids = np.concatenate([rids, np.array([rid for rid, _ in events], np.int64)])
                tokens = np.concatenate([tokens, np.array([tok for _, tok in events], np.int32)])
        return rids, tokens

    def _book(self, order: list[int], running: int, plan: StepPlan, report: np.ndarray) -> list[tuple[int, int]]:
        """Apply a step's report to the requests it planned (``order``; the first ``running`` of them were
        running); returns the sampled (request id, token) pairs."""
        ok, n, hit, sampled, tokens = report[:5].tolist()
        now = time.time()
        events = []
        refused = []
        stats = self.stats
        requests = self.requests
        stats.tokens_computed += sum(n)  # 0 on refused lanes
        for i, rid in enumerate(order):
            r = requests[rid]
            if not ok[i]:
                refused.append((rid, int(plan.want[i])))
                continue
            if i >= running:  # a waiting request starts running
                self.waiting.remove(rid)
                self.running.append(rid)
                r.cache_hit = hit[i]
                stats.cache_hit_tokens += hit[i]
                stats.prompt_tokens += r.total
            r.computed += hit[i] + n[i]
            if sampled[i]:
                tok = tokens[i]
                generated = r.generated
                if not generated:
                    r.first_token_time = now
                generated.append(tok)
                if r.logprobs is not None:
                    _book_logprobs(r, report[None, 6:, i])
                events.append((rid, tok))
                if ((r.stop_strings and len(generated) > r.min_tokens and self._reached_stop_string(r))
                        or len(generated) >= r.max_new_tokens or tok in r.stop):  # Request.done
                    self.running.remove(rid)
                    self._to_free.append(r.slot)
                    r.slot, r.finished_time = -1, now
        stats.generated += len(events)
        if refused:
            self._handle_refusals(refused)
        live = [requests[rid] for rid in self.running] if self.vectorised else []
        # (A request about to sample its first token stays out of the record: its first token is booked now.
        # So does a batch with stop strings: each step's text must be looked at.)
        decoding = live and all(r.total - r.computed == 1 and r.generated and not r.stop_strings for r in live)
        self._decoding = _Decoding.of(live) if decoding else None
        return events

    def _book_decodes(self, d: _Decoding, reports: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``_book`` for ``k`` steps that decoded every running request (``d``), each allocated and sampled
        (``reports: i32[k, rows, n]``; only the last step may finish a request), with array operations: the
        tokens wait in ``d.pending``, and only finished requests get theirs now."""
        tokens = reports[:, 4]
        k, n = tokens.shape
        d.pending.append(tokens)
        if d.logprobs:
            d.pending_logprobs.append(reports[:, 6:])
        if len(d.pending) >= _MAX_PENDING:
            d.flush()
        self.stats.tokens_computed += k * n
        self.stats.generated += k * n
        d.tokens_left -= k
        done = d.tokens_left <= 0
        last = tokens[-1]
        if len(d.stops):
            for i in np.flatnonzero(np.isin(last, d.stops)).tolist():
                done[i] |= int(last[i]) in d.requests[i].stop
        rids = np.tile(d.rid_array, k)
        if done.any():
            finished = np.flatnonzero(done).tolist()
            d.flush(finished)
            now = time.time()
            for i in finished:
                r = d.requests[i]
                self._to_free.append(r.slot)
                r.slot, r.finished_time = -1, now
            keep = np.flatnonzero(~done).tolist()
            self._decoding = d.take(keep) if keep else None
            self.running = [d.rids[i] for i in keep]
        return rids, tokens.ravel()

    def _bucket(self, tokens: int) -> int:
        """Index of the smallest token bucket (``self.statics``) that holds ``tokens``."""
        return next(i for i, s in enumerate(self.statics) if s.token_budget >= tokens)

    def _send(self, plan: StepPlan) -> StepPlan:
        """``plan`` on the device, as the programs take it: the last copy sent when ``plan`` is the same plan
        (the decode-only record packs its plan once and steps repeat it), else a new transfer. Passing the
        host array itself costs a transfer per call, a large part of a lean step on CPU."""
        if self._sent is not None and self._sent[0] is plan.data:
            return self._sent[1]
        self._sent = plan.data, replace(plan, data=_sender(self._placement)(plan.data))
        self.stats.host_to_device_bytes += plan.data.nbytes
        return self._sent[1]

    def _run(self, plan: StepPlan, lean: bool) -> np.ndarray:
        """The step program(s) for ``plan`` (the lean one first when ``lean``): the report read back."""
        tokens = int(plan.want.sum())
        bucket = self._bucket(tokens)
        for static in ([self._lean[bucket]] if lean else []) + [self.statics[bucket]]:
            if static.lean:  # it reads and writes neither the block pool nor the prefix cache: not passed
                kept = self.state.alloc
                part = replace(self.state, alloc=replace(kept, bp=None, step_cached=None))
                with self._on_mesh():
                    part, out = _STEP(static, self.params, part, self._send(plan))
                self.state = replace(part, alloc=replace(part.alloc, bp=kept.bp, step_cached=kept.step_cached))
            else:
                with self._on_mesh():
                    self.state, out = _STEP(static, self.params, self.state, self._send(plan))
            self.stats.device_to_host += 1
            report = np.asarray(out.report)
            if report[0].any() or not static.lean:
                break
            self.stats.lean_misses += 1
        key = ("lean " if static.lean else "") + str(static.token_budget)
        self.stats.bucket_steps[key] = self.stats.bucket_steps.get(key, 0) + 1
        self.last_output = out  # stays on the device; the host reads only its report
        return report

    def _run_decode_steps(self, plan: StepPlan, d: _Decoding, steps: int) -> np.ndarray:
        """Up to ``steps`` (at most ``decode_steps``) decode steps of ``plan`` (every request of ``d`` decodes)
        in one program: the reports of the steps it ran, ``i32[steps, rows, R]``."""
        R, n = self.layout.max_requests, len(d.rids)
        left = np.zeros(R, np.int32)
        left[:n] = np.minimum(d.tokens_left, steps)  # the program stops after a lane's last allowed token
        stops = np.full(1 << max(len(d.stops) - 1, 0).bit_length(), -1, np.int32)  # few shapes
        stops[:len(d.stops)] = d.stops
        static = self.statics[self._bucket(n)]
        with self._on_mesh():
            self.state, out = _DECODE_STEPS(static, self.decode_steps, self.params, self.state, self._send(plan),
                                            left, stops)
        self.stats.host_to_device_bytes += _nbytes((left, stops))
        self.stats.device_to_host += 1
        self.stats.multi_step_calls += 1
        reports = np.asarray(out.report)
        reports = reports[reports[:, 0, 0] >= 0]  # the steps run
        if not len(reports):  # the first step needs the allocator's sequential fallback: the full step runs
            return self._run(plan, lean=False)[None]
        key = f"multi-step {static.token_budget}"
        self.stats.bucket_steps[key] = self.stats.bucket_steps.get(key, 0) + len(reports)
        self.last_output = out
        return reports

    @property
    def last_rows(self) -> dict[int, int]:
        """Request id -> its row in ``last_output.logits`` (the requests the last step planned)."""
        if self._last_rows is None:
            self._last_rows = {rid: i for i, rid in enumerate(self._last_order)}
        return self._last_rows

    def _on_mesh(self):
        """The context the programs are traced and run in: the engine's mesh, if any."""
        return contextlib.nullcontext() if self.mesh is None else jax.set_mesh(self.mesh)

    def _handle_refusals(self, refused: list[tuple[int, int]]) -> None:
        """vLLM's policy: a refused running request preempts the latest admitted running one (itself,
        if it is the latest) and no new request is admitted next step; a refused waiting request just
        waits. A request refused while it runs alone retries with half the chunk."""
        running_refused = [(rid, want) for rid, want in refused if rid in self.running]
        if running_refused:
            self._hold_admissions = True
            if len(self.running) > 1:
                victim = self.running.pop()
                r = self.requests[victim]
                self._to_preempt.append(r.slot)
                r.computed = 0
                r.admitted = self.prefix_caching  # without caching: re-admitted under a new salt
                r.preemptions += 1
                self.stats.preemptions += 1
                self.waiting.insert(0, victim)
                return
            if self._to_free:
                return  # finished requests free their blocks at the start of the next step
            rid, want = running_refused[0]
        elif self.running or self._to_free:
            return  # waiting requests retry once blocks come free
        else:
            rid, want = refused[0]
        r = self.requests[rid]
        if want <= 1:
            raise RuntimeError(f"request {rid} ({r.total} tokens) does not fit the KV pool "
                               f"({self.layout.num_blocks} blocks) even alone")
        r.max_chunk = want // 2

    @property
    def has_work(self) -> bool:
        """Whether a step would do anything: requests waiting or running, or blocks still to free."""
        return bool(self.waiting or self.running or self._to_free)

    def run(self, progress: Callable[[int, int], None] | None = None) -> dict[int, list[int]]:
        """Step until every request is done; ``progress(done, total)`` after each step."""
        while self.has_work:
            self.step()
            if progress:
                progress(sum(r.done for r in self.requests.values()), len(self.requests))
        return {rid: r.generated for rid, r in self.requests.items()}

    def compile_admissions(self) -> None:
        """Compile the program that admits and releases requests for every size of the prompt buffer a step
        can send, so that no request waits for one of those compiles later (each takes seconds for a real
        model on a CPU). The buffer holds the prompts a step admits; a step admits at most
        ``min(max_requests, token_budget)`` requests of at most ``max_model_len`` tokens. Each call admits and
        releases nothing: the state stays as it was."""
        R = self.layout.max_requests
        none, slots = np.zeros(R, bool), np.full(R, -1, np.int32)
        for size in _prompt_buffers(min(R, self.token_budget) * self.layout.max_model_len):
            changes = Changes(free=none, preempt=none, slots=slots, prompts=np.zeros(size, np.int32),
                              lens=np.zeros(R, np.int32), salts=np.zeros(R, np.uint32))
            with self._on_mesh():
                self.state = replace(self.state, alloc=_PREPARE(self.layout, self.state.alloc, changes, self.vectorised))

    @staticmethod
    def compilations() -> int:
        """Step programs compiled in this process (one per model graph, allocator layout and token bucket,
        plus the multi-step decode programs of engines with ``decode_steps > 1``)."""
        return _STEP._cache_size() + _DECODE_STEPS._cache_size()

    # --- snapshots ------------------------------------------------------------------------

    def _host_state(self) -> dict:
        return {"requests": self.requests, "waiting": self.waiting, "running": self.running,
                "to_free": self._to_free, "to_preempt": self._to_preempt, "next_id": self._next_id,
                "admissions": self._admissions, "hold_admissions": self._hold_admissions}

    def _set_host_state(self, h: dict) -> None:
        self._requests, self.waiting, self.running = h["requests"], h["waiting"], h["running"]
        self._to_free, self._to_preempt, self._next_id = h["to_free"], h["to_preempt"], h["next_id"]
        self._admissions, self._hold_admissions = h["admissions"], h["hold_admissions"]
        # Rebuilt by the next step's pass over the requests; tokens pending in the old record belonged to
        # the requests replaced here.
        self._decoding = None

    def snapshot(self) -> tuple[EngineState, dict]:
        """A copy of the device state and the host's bookkeeping (the step donates the live state)."""
        return jax.tree.map(jnp.copy, self.state), copy.deepcopy(self._host_state())

    def restore(self, snap: tuple[EngineState, dict]) -> None:
        """Go back to a snapshot (it stays valid: restoring copies it again)."""
        state, host = snap
        self.state = jax.tree.map(jnp.copy, state)
        self._set_host_state(copy.deepcopy(host))

    def fork(self, rid: int, seed: int | None = None) -> int:
        """A new running request continuing ``rid`` (same tokens so far); it shares ``rid``'s full blocks.
        It samples like ``rid`` but with its own ``seed`` (``None``: the engine's key), so that forks of a
        seeded request do not all draw the same tokens."""
        parent, seed = self.requests[rid], _checked_sampling(seed=seed)["seed"]
        if self._align:
            raise ValueError("fork needs an attention-only model: a Mamba state cannot be shared part-way")
        if rid not in self.running:
            raise ValueError(f"request {rid} is not running")
        slot = self._free_slot()
        if slot < 0:
            raise RuntimeError("no free request slot to fork into")
        with self._on_mesh():
            self.state = replace(self.state, alloc=_FORK(self.layout, self.state.alloc, parent.slot, slot))
        child = copy.deepcopy(parent)
        child.rid, child.slot, child.seed = self._next_id, slot, seed
        child.computed = parent.computed // self.layout.block_size * self.layout.block_size
        self._next_id += 1
        self._requests[child.rid] = child
        self.running.append(child.rid)
        self._decoding = None
        return child.rid

    def save(self, path: str | Path) -> None:
        """Save the whole engine (allocator + KV memory + host bookkeeping) under ``path`` with orbax."""
        import orbax.checkpoint as ocp

        path = Path(path).absolute()
        with ocp.StandardCheckpointer() as ckpt:
            ckpt.save(path / "state", self.state)
        host = self._host_state()
        host = {**host, "requests": {k: vars(r) for k, r in host["requests"].items()}}
        (path / "host.json").write_text(json.dumps(host))

    def load(self, path: str | Path) -> None:
        """Restore what ``save`` wrote (the engine must have been built with the same model and sizes)."""
        import orbax.checkpoint as ocp

        path = Path(path).absolute()
        with ocp.StandardCheckpointer() as ckpt:
            self.state = ckpt.restore(path / "state", jax.tree.map(jnp.zeros_like, self.state))
        host = json.loads((path / "host.json").read_text())
        host["requests"] = {int(k): Request(**r) for k, r in host["requests"].items()}
        self._set_host_state(host)

    # --- reporting ------------------------------------------------------------------------

    def blocks_in_use(self) -> list[int]:
        """Blocks held per KV cache group (distinct non-null table entries of live requests)."""
        live = [r.slot for r in self.requests.values() if r.slot >= 0]
        tables = self.layout.config_tables(np.asarray(self.state.alloc.tables)[live])  # per group [live, M * k]
        return [len(set(t.ravel()) - {0}) for t in tables]
