"""The device side of the engine: its state, the jitted programs, and which of them a step runs.

``ModelRunner`` owns the ``EngineState`` (allocator, KV memory, sampling key), the model's parameters, the
step program per token bucket (and its lean variant for decode steps where no block moves), the
multi-step decode program and the plan last sent. ``execute`` runs one ``SchedulerOutput`` and returns a
``StepReport`` (named rows, read back to the host).
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import replace

import jax
import numpy as np
from flax import nnx

from hkv_jax.allocator import ops
from hkv_jax.allocator.host_tier import host_memory_kind, init_host_tier
from hkv_jax.allocator.state import Layout, init_state
from hkv_jax.cache import init_cache, mesh_model_size
from hkv_jax.engine.changes import Changes, prompt_buffer, prompt_buffers
from hkv_jax.engine.decode_batch import DecodeBatch
from hkv_jax.engine.sampler import engine_key
from hkv_jax.engine.scheduler import SchedulerOutput
from hkv_jax.engine.score import prompt_logprobs
from hkv_jax.engine.speculative import DraftModelSpec, DraftModelStatic
from hkv_jax.engine.stats import Stats
from hkv_jax.engine.step import EngineState, StepStatic, decode_steps, prepare, release_to_host, step
from hkv_jax.engine.step_messages import SAMPLING, StepPlan, StepReport
from hkv_jax.models.protocol import ScoringModel
from hkv_jax.sharding import param_shardings, replicated

# Module-level, so engines with the same model graph and sizes share compilations.
STEP = jax.jit(step, static_argnums=0, donate_argnums=2)
DECODE_STEPS = jax.jit(decode_steps, static_argnums=(0, 1), donate_argnums=3)
PREPARE = jax.jit(prepare, static_argnums=(0, 3), donate_argnums=1)
RELEASE_TO_HOST = jax.jit(release_to_host, static_argnums=0, donate_argnums=3)
FORK = jax.jit(ops.fork, static_argnums=0, donate_argnums=1)
PROMPT_LOGPROBS = jax.jit(prompt_logprobs, static_argnums=(0, 1, 2))


def nbytes(tree) -> int:
    return sum(np.asarray(x).nbytes for x in jax.tree.leaves(tree))


@functools.cache
def _sender(placement: jax.sharding.Sharding):
    """A copy to ``placement`` through a jitted identity: its C++ dispatch moves a small host array about 5x
    faster than ``jax.device_put`` (about 7 against 36 us on CPU)."""
    return jax.jit(lambda x: x, out_shardings=placement)


class ModelRunner:
    """The device state and programs of an engine serving ``model`` with KV cache layout ``layout`` (see
    ``Engine`` for the arguments)."""

    def __init__(self, model, kv_cache_config, layout: Layout, *, buckets: list[int], impl: str, seed: int,
                 vectorised: bool, decode_steps: int, max_call_seconds: float | None, max_top_logprobs: int,
                 max_logit_bias: int, mesh: jax.sharding.Mesh | None, stats: Stats, speculative=None,
                 host_blocks: int = 0, host_unit: int = 0, host_supersede: bool = True):
        if mesh is not None:
            mesh_model_size(mesh)  # checks the axis names
        self.layout, self.mesh, self.stats = layout, mesh, stats
        self.can_score = isinstance(model, ScoringModel)
        graphdef, params = nnx.split(model)
        if mesh is not None:
            params = jax.device_put(params, param_shardings(params, model.cfg, mesh))
        self.params, params_def = jax.tree.flatten(params)
        self.statics = [StepStatic(graphdef, params_def, layout, b, impl, vectorised, top_logprobs=max_top_logprobs)
                        for b in buckets]
        self._lean = [replace(s, lean=True) for s in self.statics]
        self.vectorised = vectorised
        self.max_top_logprobs, self.max_logit_bias = max_top_logprobs, max_logit_bias
        self.decode_steps = decode_steps if vectorised else 1  # the per-request allocator: one step a call
        self.max_call_seconds = max_call_seconds
        # The last timed decode call's seconds per step and the requests it decoded.
        self.step_seconds: tuple[float, int] | None = None
        # Slots whose next decode only counts a token (the last report's ``idle_next``).
        self._idle_next = np.zeros(layout.max_requests, bool)
        # Committed to their devices from the start, as a checkpoint restores them: a restored state then
        # runs the programs already compiled.
        self.placement = (jax.sharding.SingleDeviceSharding(jax.devices()[0]) if mesh is None
                          else replicated(mesh))
        # Speculative decoding: the step programs that draft and verify (a step where no request drafts
        # runs the others).
        self._speculative = self._spec_params = None
        if speculative is not None:
            self._spec_params = self.params  # a draft model's parameters follow the target's
            if isinstance(speculative, DraftModelSpec):
                draft_graph, draft_params = nnx.split(speculative.model)
                draft_leaves, draft_def = jax.tree.flatten(jax.device_put(draft_params, self.placement))
                self._spec_params = self.params + draft_leaves
                speculative = DraftModelStatic(draft_graph, draft_def, speculative.num_speculative_tokens)
            self._speculative = [replace(s, speculative=speculative) for s in self.statics]
        alloc, key = jax.device_put((init_state(layout), engine_key(seed)), self.placement)
        cache = init_cache(kv_cache_config, mesh)
        cache = cache if mesh is not None else jax.device_put(cache, self.placement)
        host = None
        if host_blocks:
            host = init_host_tier(layout, cache.buffers, host_blocks, max(buckets), host_memory_kind(), host_unit,
                                  host_supersede)
        self.state = EngineState(alloc, cache, key, host)
        self._sent: tuple[np.ndarray, StepPlan] | None = None  # the last plan sent: its host data, device copy
        self._packed: tuple[DecodeBatch, tuple, StepPlan] | None = None  # a decode-only record's plan
        self.last_output = None  # the last step's StepOutput, on the device

    def on_mesh(self):
        """The context the programs are traced and run in: the engine's mesh, if any."""
        return contextlib.nullcontext() if self.mesh is None else jax.set_mesh(self.mesh)

    # --- plans ------------------------------------------------------------------------------

    def plan(self, out: SchedulerOutput, defaults: dict) -> StepPlan:
        """``out`` packed for the device, with the engine's sampling ``defaults`` for requests that set none.
        Every step of one decode-only record plans the same: it is packed (and sent) once."""
        values = tuple(defaults.values())
        d = out.decode_batch
        if d is not None and self._packed is not None and self._packed[0] is d and self._packed[1] == values:
            return self._packed[2]
        plan = StepPlan.pack(out.slots, out.num_tokens, **self._sampling(out.requests, defaults, out.num_drafts))
        if d is not None:
            self._packed = d, values, plan
        return plan

    def _sampling(self, requests: list, defaults: dict, drafts: np.ndarray | None = None) -> dict:
        """``StepPlan.pack``'s sampling arguments for ``requests``: each value by ``SAMPLING`` name, ``[R]``
        each: its own, else the engine's default (no seed: none), its prompt's length, ``min_tokens`` and
        token limit, and ``drafts`` (``i32[R]``, ``None``: none); neutral past them. With ``max_logit_bias``,
        also their bias entries (``bias``)."""
        R, n = self.layout.max_requests, len(requests)
        columns = {} if drafts is None else {"drafts": drafts}
        for name, dtype, neutral in SAMPLING:
            if name == "drafts":
                continue
            default = defaults.get(name, neutral)
            columns[name] = np.full(R, neutral, dtype)
            columns[name][:n] = [default if (v := getattr(r, name)) is None else v for r in requests]
        if self.max_logit_bias:
            ids = np.full((R, self.max_logit_bias), -1, np.int32)
            values = np.zeros((R, self.max_logit_bias), np.float32)
            for i, r in enumerate(requests):
                for j, (t, v) in enumerate(r.bias):
                    ids[i, j], values[i, j] = t, v
            columns["bias"] = ids, values
        return columns

    def _send(self, plan: StepPlan) -> StepPlan:
        """``plan`` on the device: the last copy sent when it is the same plan, else a new transfer (passing
        the host array itself costs a transfer per call, a large part of a lean step on CPU)."""
        if self._sent is not None and self._sent[0] is plan.data:
            return self._sent[1]
        self._sent = plan.data, replace(plan, data=_sender(self.placement)(plan.data))
        self.stats.host_to_device_bytes += plan.data.nbytes
        return self._sent[1]

    # --- programs ---------------------------------------------------------------------------

    def prepare(self, changes: Changes) -> None:
        """Release and admit what ``changes`` says (with a host tier, what the released requests' hits need
        goes down first)."""
        host = self.state.host
        if host is not None and (changes.free.any() or changes.preempt.any()):
            host = RELEASE_TO_HOST(self.layout, self.state.alloc, self.state.cache, host, changes)
            self.state = replace(self.state, host=host)
        with self.on_mesh():
            alloc = PREPARE(self.layout, self.state.alloc, changes, self.vectorised)
        self.state = replace(self.state, alloc=alloc)
        self.stats.host_to_device_bytes += nbytes(changes)
        self.stats.prepare_calls += 1

    def execute(self, out: SchedulerOutput, plan: StepPlan) -> StepReport:
        """Run ``plan`` (of ``out``): several decode steps in one program when ``out`` allows it and they fit
        ``max_call_seconds``, else one step (the lean program first when every lane's next decode only counts
        its token). The reports come back for ``out``'s lanes only."""
        k = len(out.request_ids)
        steps = self._steps_per_call(k) if out.multi_step and self.decode_steps > 1 else 1
        speculative = out.num_drafts is not None
        if speculative:  # one report per sampled position
            data = self._run(plan, False, int(out.num_drafts.sum()))[:, :, :k]
        elif steps > 1:
            data = self._run_decode_steps(plan, out.decode_batch, steps)[:, :, :k]  # no step of them admits
        else:
            lean = (out.num_decoding == k and out.changes is None and self.vectorised
                    and bool(self._idle_next[out.slots[:k]].all()))
            data = self._run(plan, lean)[None, :, :k]
        report = StepReport(data, speculative)
        self._idle_next[:] = False
        self._idle_next[out.slots[:k][report.idle_next[-1] != 0]] = True
        return report

    def timed(self, out: SchedulerOutput) -> bool:
        """Whether a call running ``out`` sets the pace of later multi-step calls (``time_call``)."""
        return (out.decode_batch is not None and out.num_drafts is None and self.decode_steps > 1
                and self.max_call_seconds is not None)

    def time_call(self, out: SchedulerOutput, seconds: float, steps: int) -> None:
        """A timed call (``timed``) that compiled nothing took ``seconds`` for ``steps`` steps of ``out``."""
        self.step_seconds = seconds / steps, len(out.request_ids)

    def _steps_per_call(self, requests: int) -> int:
        """Decode steps the next call of several, over ``requests`` requests, may run: ``decode_steps``, or as
        many as fit ``max_call_seconds`` at the last timed rate (one until a call has been timed). That rate
        is scaled up in proportion when more requests decode now than then: a step's cost grows less than
        its batch, so the bound still holds when the batch grows."""
        if self.max_call_seconds is None:
            return self.decode_steps
        if self.step_seconds is None:
            return 1
        seconds, then = self.step_seconds
        seconds *= max(1.0, requests / then)
        return max(1, min(self.decode_steps, int(self.max_call_seconds / seconds)))

    def _bucket(self, tokens: int) -> int:
        """Index of the smallest token bucket (``self.statics``) that holds ``tokens``."""
        return next(i for i, s in enumerate(self.statics) if s.token_budget >= tokens)

    def _run(self, plan: StepPlan, lean: bool, drafts: int | None = None) -> np.ndarray:
        """The step program(s) for ``plan`` (the lean one first when ``lean``; the speculative one for
        ``drafts`` draft tokens at most): the report read back."""
        bucket = self._bucket(int(plan.want.sum()) + (drafts or 0))
        full = self.statics if drafts is None else self._speculative
        for static in ([self._lean[bucket]] if lean else []) + [full[bucket]]:
            if static.lean:  # it reads and writes neither the block pool nor the prefix cache: not passed
                kept, host = self.state.alloc, self.state.host
                part = replace(self.state, alloc=replace(kept, block_pool=None, step_cached=None), host=None)
                with self.on_mesh():
                    part, out = STEP(static, self.params, part, self._send(plan))
                self.state = replace(part, alloc=replace(part.alloc, block_pool=kept.block_pool,
                                                         step_cached=kept.step_cached), host=host)
            else:
                params = self.params if static.speculative is None else self._spec_params
                with self.on_mesh():
                    self.state, out = STEP(static, params, self.state, self._send(plan))
            self.stats.device_to_host += 1
            report = np.asarray(out.report)
            if report[0].any() or not static.lean:  # row "ok": the lean program applied the step
                break
            self.stats.lean_misses += 1
        self.stats.count_program(("lean " if static.lean else "speculative " if static.speculative else "")
                                 + str(static.token_budget))
        self.last_output = out  # stays on the device; the host reads only its report
        return report

    def _run_decode_steps(self, plan: StepPlan, d: DecodeBatch, steps: int) -> np.ndarray:
        """Up to ``steps`` (at most ``decode_steps``) decode steps of ``plan`` (every request of ``d`` decodes)
        in one program: the reports of the steps it ran, ``i32[steps, rows, R]``."""
        R, n = self.layout.max_requests, len(d.rids)
        left = np.zeros(R, np.int32)
        left[:n] = np.minimum(d.tokens_left, steps)  # the program stops after a lane's last allowed token
        stops = np.full(1 << max(len(d.stops) - 1, 0).bit_length(), -1, np.int32)  # few shapes
        stops[:len(d.stops)] = d.stops
        static = self.statics[self._bucket(n)]
        with self.on_mesh():
            self.state, out = DECODE_STEPS(static, self.decode_steps, self.params, self.state, self._send(plan),
                                           left, stops)
        self.stats.host_to_device_bytes += nbytes((left, stops))
        self.stats.device_to_host += 1
        self.stats.multi_step_calls += 1
        reports = np.asarray(out.report)
        reports = reports[reports[:, 0, 0] >= 0]  # the steps run (row "ok" of the others is -1)
        if not len(reports):  # the first step needs the allocator's sequential fallback: the full step runs
            return self._run(plan, lean=False)[None]
        self.stats.count_program(f"multi-step {static.token_budget}", len(reports))
        self.last_output = out
        return reports

    def fork(self, parent_slot: int, slot: int) -> None:
        """The request in ``slot`` shares the full blocks of the one in ``parent_slot``."""
        with self.on_mesh():
            self.state = replace(self.state, alloc=FORK(self.layout, self.state.alloc, parent_slot, slot))

    # --- scoring and warm-up ------------------------------------------------------------------

    def score(self, prompt: list[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``score.prompt_logprobs`` of ``prompt`` in a prompt buffer, with the ``max_top_logprobs``
        likeliest tokens (one program per buffer size), read back."""
        tokens = np.zeros(prompt_buffer(len(prompt)), np.int32)
        tokens[:len(prompt)] = prompt
        static = self.statics[0]
        return jax.device_get(PROMPT_LOGPROBS(static.graphdef, static.params_def, self.max_top_logprobs,
                                              self.params, tokens))

    def compile_scoring(self) -> None:
        """Compile ``score``'s program for every prompt-buffer size up to ``max_model_len`` tokens."""
        for size in prompt_buffers(self.layout.max_model_len):
            self.score([0] * size)

    def compile_admissions(self, max_admitted: int) -> None:
        """Compile ``prepare``'s program for every prompt-buffer size a step admitting ``max_admitted``
        requests of ``max_model_len`` tokens can send. Each call admits and releases nothing."""
        R = self.layout.max_requests
        none, slots = np.zeros(R, bool), np.full(R, -1, np.int32)
        for size in prompt_buffers(max_admitted * self.layout.max_model_len):
            changes = Changes(free=none, preempt=none, slots=slots, prompts=np.zeros(size, np.int32),
                              lens=np.zeros(R, np.int32), salts=np.zeros(R, np.uint32))
            with self.on_mesh():
                self.state = replace(self.state, alloc=PREPARE(self.layout, self.state.alloc, changes,
                                                               self.vectorised))

    @staticmethod
    def compilations() -> int:
        """Step programs compiled in this process (one per model graph, allocator layout and token bucket,
        plus the multi-step decode programs)."""
        return STEP._cache_size() + DECODE_STEPS._cache_size()
