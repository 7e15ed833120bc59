"""``Engine``: the front of the serving loop, in vLLM v1's layering.

Each ``step``: the ``Scheduler`` (host only) plans which requests run and their tokens (``SchedulerOutput``);
the ``ModelRunner`` releases and admits what changed and runs the jitted step program (``step.py``:
allocation, KV write, attention for every KV cache group, sampling), returning a ``StepReport``, which
``Scheduler.update_from_output`` books into the requests (``request.check_stop`` says which are done); the
``OutputProcessor`` gives their text and stop strings. Snapshots and checkpoints: ``checkpoint.py``.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Callable

import jax
import numpy as np

from hkv_jax.allocator.host_tier import host_tier_blocks, host_usage
from hkv_jax.allocator.state import Layout
from hkv_jax.attention import check_kernel
from hkv_jax.engine import checkpoint
from hkv_jax.engine.config import EngineConfig
from hkv_jax.engine.output_processor import OutputProcessor
from hkv_jax.engine.request import Request, RequestsView
from hkv_jax.engine.runner import ModelRunner
from hkv_jax.engine.sampling_params import ENGINE_DEFAULTS, KNOB, EngineDefault, SamplingParams, is_integer
from hkv_jax.engine.scheduler import NO_TOKENS, Scheduler
from hkv_jax.engine.stats import HostUsage, KVUsage, Stats
from hkv_jax.engine.step import EngineState
from hkv_jax.models.hf_config import with_kv_cache_dtype
from hkv_jax.models.protocol import PagedModel
from hkv_jax.planner import plan as plan_cache


class Engine:
    """A serving loop around the jitted step for a model with the ``hkv_jax.models.PagedModel`` protocol.

    ``Engine(model, EngineConfig(num_blocks=...))``, or the config's fields as keywords
    (``Engine(model, num_blocks=96, max_requests=4)``). ``mesh`` (``hkv_jax.sharding.make_mesh``): serve
    tensor-parallel over its ``model`` axis; the results equal a single-device engine's. ``detokenize``
    (token ids -> text): the text that stop strings and ``text`` need.

    ``temperature`` (0: greedy), ``top_p``, ``top_k``, ``min_p`` and the three penalties are settable
    defaults for requests whose ``SamplingParams`` leave them ``None``, checked at each step (a value out
    of range: ``ValueError`` from ``step``, nothing changed).
    """

    def __init__(self, model, config: EngineConfig | None = None, *, mesh: jax.sharding.Mesh | None = None,
                 detokenize: Callable[[list[int]], str] | None = None, **fields):
        if not isinstance(model, PagedModel):
            raise TypeError(f"{type(model).__name__} is not a PagedModel (cfg.layers, cfg.vocab_size, paged)")
        config = EngineConfig(**fields) if config is None else config
        vocab = model.cfg.vocab_size
        for name in ("max_top_logprobs", "max_logit_bias"):
            if getattr(config, name) > vocab:
                raise ValueError(f"{name} must be an integer in [0, vocab_size], got {getattr(config, name)!r}")
        self.config, self.vocab_size, self.model_layers = config, vocab, model.cfg.layers
        layers = with_kv_cache_dtype(model.cfg.layers, config.kv_cache_dtype)  # the cache's dtypes
        self.kv_cache_config = plan_cache(layers, block_size=config.block_size, policy=config.policy,
                                          num_blocks=config.num_blocks)
        unit = self.kv_cache_config.hash_block_size
        if config.max_model_len < unit:  # no block could ever fill, and the prefix cache's arrays would be empty
            raise ValueError(f"max_model_len {config.max_model_len} is under one block: a request must have room "
                             f"for at least {unit} tokens (the prefix cache's hash unit)")
        need = self.kv_cache_config.blocks_per_request(config.max_model_len)
        if config.num_blocks - 1 < need:
            raise ValueError(f"a pool of {config.num_blocks} blocks (null block included) cannot hold one request of "
                             f"max_model_len {config.max_model_len} tokens: it needs {need} blocks and the null block")
        self.layout = Layout.from_config(self.kv_cache_config, max_model_len=config.max_model_len,
                                         max_requests=config.max_requests,
                                         window_aware_eviction=config.window_aware_eviction)
        check_kernel(self.kv_cache_config, config.impl, self.layout.max_blocks)
        if config.host_cache_bytes and mesh is not None:
            raise ValueError("host_cache_bytes: the host tier serves a single-device engine, not one on a mesh")
        host_blocks = host_tier_blocks(config.host_cache_bytes, self.block_bytes, self.layout.num_groups)
        draft = getattr(config.speculative, "model", None)
        if draft is not None and draft.cfg.vocab_size != vocab:
            raise ValueError(f"the draft model's vocabulary ({draft.cfg.vocab_size} tokens) is not the target's "
                             f"({vocab})")
        self.stats = Stats()
        self.runner = ModelRunner(model, self.kv_cache_config, self.layout, buckets=config.buckets, impl=config.impl,
                                  seed=config.seed, vectorised=config.vectorised, decode_steps=config.decode_steps,
                                  max_call_seconds=config.max_call_seconds,
                                  max_top_logprobs=config.max_top_logprobs, max_logit_bias=config.max_logit_bias,
                                  mesh=mesh, stats=self.stats, speculative=config.speculative,
                                  host_blocks=host_blocks, host_unit=config.host_cache_unit,
                                  host_supersede=config.host_cache_supersede)
        # With Mamba layers, prefill chunks end on the Mamba groups' block boundaries (the planner may have
        # raised their block size above config.block_size), where a state is kept.
        mamba = self.layout.mamba_groups
        spec = config.speculative
        self.scheduler = Scheduler(max_requests=config.max_requests, token_budget=config.token_budget,
                                   block_size=self.layout.block_sizes[mamba[0]] if mamba else config.block_size,
                                   align=bool(mamba), prefix_caching=config.prefix_caching,
                                   vectorised=config.vectorised,
                                   num_speculative=spec.num_speculative_tokens if spec else 0,
                                   num_blocks=config.num_blocks, stats=self.stats)
        self.processor = OutputProcessor(detokenize)
        self._requests = RequestsView(self.scheduler.book_pending)
        self.sampling_defaults = dict(ENGINE_DEFAULTS)
        self._checked_defaults: tuple[tuple, dict] = ((), {})  # the defaults last checked, and as checked
        self._last_order, self._last_rows = [], None  # request ids of last_output's rows, and their index

    # --- requests ------------------------------------------------------------------------------

    @property
    def requests(self) -> RequestsView:
        """Every request by id (read-only), its tokens and ``computed`` count up to date when read."""
        return self._requests

    def add_request(self, prompt, params: SamplingParams | int, stop: tuple[int, ...] = (), **fields) -> int:
        """Queue a request for ``prompt`` (token ids); returns its id. ``params``: its ``SamplingParams``, or
        ``max_new_tokens`` with the other fields as keywords (``stop`` too). ``ValueError`` for a bad prompt
        (``check_prompt``), one that cannot fit ``max_model_len``, or params this engine cannot serve."""
        if not isinstance(params, SamplingParams):
            params = SamplingParams(max_new_tokens=params, stop=stop, **fields)
        elif stop or fields:
            raise TypeError("pass stop and the other fields inside SamplingParams")
        prompt = self.check_prompt(prompt, params.max_new_tokens)
        c = self.config
        params.check(self.vocab_size, c.max_top_logprobs, c.max_logit_bias, self.detokenize is not None)
        return self.scheduler.add(prompt, params, params.bias_entries(self.vocab_size, c.max_logit_bias))

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

    def abort(self, rid: int) -> bool:
        """End request ``rid`` now (its client went away): it leaves the queue or the batch with the tokens
        generated so far, and the next step frees its blocks (full ones stay in the prefix cache). Returns
        ``False`` if it had already ended; ``KeyError`` for an id never added."""
        aborted = self.scheduler.abort(rid)
        self.stats.aborted += aborted
        return aborted

    def forget(self, rid: int) -> Request:
        """Drop finished request ``rid`` from ``requests`` and return it; ``ValueError`` before it is done."""
        return self.scheduler.forget(rid)

    def text(self, rid: int, stable: bool = False) -> str:
        """The text of request ``rid``'s generated tokens, up to its stop string if one ended it (vLLM's
        output text). ``stable``: while it runs, leave out the end that later tokens may still change (up to
        3 trailing U+FFFD, and the last characters, which might begin a stop string), so that streamed
        pieces add up to the final text."""
        return self.processor.text(self.requests[rid], stable)

    def prompt_logprobs(self, prompt, top: int = 0) -> list[tuple[float, list[tuple[int, float]]] | None]:
        """Each token of ``prompt``'s log-probability given the tokens before it, under the model's raw
        logits (vLLM's ``prompt_logprobs``): ``None`` for the first token, then ``(log-probability, [(token,
        log-probability)] of the ``top`` likeliest tokens, likeliest first)`` per token. It runs the
        uncached forward (``hkv_jax.engine.score``), compiled once per prompt-buffer size, and changes
        nothing. ``ValueError`` for a bad prompt or ``top`` over ``max_top_logprobs``."""
        if not self.runner.can_score:
            raise TypeError("prompt_logprobs needs a ScoringModel (hidden and logits besides paged)")
        prompt = self.check_prompt(prompt)
        most = self.config.max_top_logprobs
        if not is_integer(top) or not 0 <= top <= most:
            raise ValueError(f"top must be an integer in [0, {most}] (the engine's max_top_logprobs), got {top!r}")
        logprob, ids, values = self.runner.score(prompt)
        return [None] + [(float(logprob[j]), list(zip(ids[j, :top].tolist(), values[j, :top].tolist())))
                         for j in range(len(prompt) - 1)]

    # --- stepping ------------------------------------------------------------------------------

    def step(self) -> list[tuple[int, int]]:
        """Run one step (up to ``decode_steps`` decode steps); returns the (request id, token) pairs sampled
        in it, in step order (``step_tokens`` returns them as two arrays)."""
        rids, tokens = self.step_tokens()
        return list(zip(rids.tolist(), tokens.tolist()))

    def step_tokens(self) -> tuple[np.ndarray, np.ndarray]:
        """``step()`` without a Python object per token: request ids ``i64[n]`` and tokens ``i32[n]``."""
        t0 = time.perf_counter()
        defaults = self._defaults()
        out = self.scheduler.schedule()
        if not out.request_ids and out.changes is None:
            return NO_TOKENS
        plan = self.runner.plan(out, defaults)
        t_dispatch = time.perf_counter()
        if out.changes is not None:
            self.runner.prepare(out.changes)
        self.scheduler.sent(out)
        if not out.request_ids:  # only releases
            jax.block_until_ready(self.runner.state.alloc.counts)
        else:
            timed = self.runner.timed(out)
            compiled = self.runner.compilations() if timed else 0
            report = self.runner.execute(out, plan)
            self._last_order, self._last_rows = out.request_ids, None
            self.stats.device_seconds += time.perf_counter() - t_dispatch
            sampled = self.scheduler.update_from_output(out, report, self.processor.stop_string)
            t = time.perf_counter()
            self.stats.seconds += t - t0
            if timed and self.runner.compilations() == compiled:
                self.runner.time_call(out, t - t0, len(report))
            return sampled
        t = time.perf_counter()
        self.stats.device_seconds += t - t_dispatch
        self.stats.seconds += t - t0
        return NO_TOKENS

    def _defaults(self) -> dict:
        """The engine's sampling defaults, checked once per change (this runs every step)."""
        values = tuple(self.sampling_defaults.values())
        if values != self._checked_defaults[0]:
            self._checked_defaults = values, {n: KNOB[n].check(v) for n, v in self.sampling_defaults.items()}
        return self._checked_defaults[1]

    def run(self, progress: Callable[[int, int], None] | None = None) -> dict[int, list[int]]:
        """Step until every request is done; ``progress(done, total)`` after each step."""
        while self.has_work:
            self.step()
            if progress:
                progress(sum(r.done for r in self.requests.values()), len(self.requests))
        return {rid: r.generated for rid, r in self.requests.items()}

    def compile_admissions(self) -> None:
        """Compile the program that admits and releases requests for every prompt-buffer size a step can send
        (a step admits at most ``min(max_requests, token_budget)`` prompts), so no request waits for it."""
        self.runner.compile_admissions(min(self.config.max_requests, self.config.token_budget))

    def compile_scoring(self) -> None:
        """Compile ``prompt_logprobs``'s program for every prompt size up to ``max_model_len``."""
        self.runner.compile_scoring()

    @staticmethod
    def compilations() -> int:
        """Step programs compiled in this process (``ModelRunner.compilations``)."""
        return ModelRunner.compilations()

    # --- snapshots (``checkpoint.py``) ------------------------------------------------------------

    def snapshot(self) -> tuple[EngineState, dict]:
        """A copy of the device state and the host's bookkeeping (the step donates the live state)."""
        return checkpoint.snapshot(self.runner, self.scheduler)

    def restore(self, snap: tuple[EngineState, dict]) -> None:
        """Go back to a snapshot (it stays valid: restoring copies it again)."""
        checkpoint.restore(self.runner, self.scheduler, snap)

    def fork(self, rid: int, seed: int | None = None) -> int:
        """A new running request continuing ``rid`` (same tokens so far), sharing its full blocks, sampling
        with its own ``seed`` (``None``: the engine's key)."""
        return checkpoint.fork(self.runner, self.scheduler, rid, seed)

    def save(self, path: str | Path) -> None:
        """Save the whole engine (allocator + KV memory + host bookkeeping) under ``path`` with orbax."""
        checkpoint.save(self.runner, self.scheduler, path)

    def load(self, path: str | Path) -> None:
        """Restore what ``save`` wrote (the engine must have been built with the same model and sizes)."""
        checkpoint.load(self.runner, self.scheduler, path)

    # --- reading the state ---------------------------------------------------------------------------

    def kv_usage(self) -> KVUsage:
        """The KV pool's blocks (the null block left out) and free ones, and the requests running and waiting."""
        free = int(self.runner.state.alloc.block_pool.free_queue.num_free)
        return KVUsage(self.config.num_blocks - 1, free, len(self.scheduler.running), len(self.scheduler.waiting))

    @property
    def block_bytes(self) -> int:
        """Bytes of one block: a page of every shared tensor (a group's block, in the pool or the host tier)."""
        return self.kv_cache_config.bytes_per_block

    def host_usage(self) -> HostUsage | None:
        """What the host tier holds and has moved (read back from the device), ``None`` without one."""
        host = self.runner.state.host
        if host is None:
            return None
        u = host_usage(self.layout, host)
        return HostUsage(u["blocks"], u["cached_per_group"], self.block_bytes, u["hit_tokens"], u["blocks_down"],
                         u["blocks_up"], u["superseded"])

    def reset_stats(self) -> None:
        """Start the counters (``stats``) from zero."""
        self.stats.__init__()

    def blocks_in_use(self) -> list[int]:
        """Blocks held per KV cache group (distinct non-null table entries of live requests)."""
        live = [r.slot for r in self.requests.values() if r.slot >= 0]
        tables = self.layout.config_tables(np.asarray(self.state.alloc.tables)[live])  # per group [live, M * k]
        return [len(set(t.ravel()) - {0}) for t in tables]

    @property
    def last_rows(self) -> dict[int, int]:
        """Request id -> its row in ``last_output.logits`` (the requests the last step planned)."""
        if self._last_rows is None:
            self._last_rows = {rid: i for i, rid in enumerate(self._last_order)}
        return self._last_rows

    detokenize = property(lambda self: self.processor.detokenize,
                          lambda self, f: setattr(self.processor, "detokenize", f),
                          doc="Token ids -> text (``None``: no text, no stop strings).")
    state = property(lambda self: self.runner.state, lambda self, v: setattr(self.runner, "state", v),
                     doc="The device state (``EngineState``).")
    last_output = property(lambda self: self.runner.last_output, doc="The last step's ``StepOutput``, on the device.")
    params = property(lambda self: self.runner.params)
    statics = property(lambda self: self.runner.statics)
    has_work = property(lambda self: self.scheduler.has_work,
                        doc="Whether a step would do anything: requests waiting or running, or blocks still to free.")
    running = property(lambda self: self.scheduler.running, doc="Running request ids, in admission order.")
    waiting = property(lambda self: self.scheduler.waiting, doc="Waiting request ids, front first.")
    decode_steps = property(lambda self: self.runner.decode_steps)
    max_call_seconds = property(lambda self: self.runner.max_call_seconds,
                                lambda self, v: setattr(self.runner, "max_call_seconds", v))
    token_budget = property(lambda self: self.config.token_budget)
    max_top_logprobs = property(lambda self: self.config.max_top_logprobs)
    max_logit_bias = property(lambda self: self.config.max_logit_bias)
    # The defaults for requests whose SamplingParams leave a value None (ENGINE_DEFAULTS), settable.
    temperature, top_p, top_k, min_p = EngineDefault(), EngineDefault(), EngineDefault(), EngineDefault()
    repetition_penalty, presence_penalty, frequency_penalty = EngineDefault(), EngineDefault(), EngineDefault()

