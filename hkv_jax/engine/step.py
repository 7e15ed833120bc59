"""The jitted serving step: everything after the host's scheduling decision, in one XLA program.

``step(static, params, state, plan)`` frees and preempts what the host
asks, admits new requests, runs the allocator (prefix lookup, allocation,
block caching) for every scheduled request, builds the attention metadata,
runs the model's paged forward (KV write + attention for every group),
samples a token for every request whose known tokens are all computed, and
appends it. The host reads back only ``StepOutput.tokens`` / ``sampled`` /
``ok`` / ``num_new`` / ``cache_hit`` (one transfer).
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
from flax import nnx

from hkv_jax.allocator import ops
from hkv_jax.allocator.state import AllocatorState, Layout
from hkv_jax.attention import make_metadata
from hkv_jax.cache import KVCache
from kernels_pallas.reference import query_positions


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class EngineState:
    """Everything on the device: allocator, KV memory and the sampling key."""

    alloc: AllocatorState
    cache: KVCache
    key: jax.Array


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class StepPlan:
    """The host's decision for one step (fixed shapes; R request slots, A admissions).

    ``free, preempt: bool[R]``; ``new_slot: i32[A]`` (-1: none) with
    ``new_tokens: i32[A, max_model_len]``, ``new_len: i32[A]``, ``new_salt: u32[A]``;
    ``slots: i32[R]`` requests to run in order and ``want: i32[R]`` tokens each
    (0: padding); ``temperature, top_p: f32[]``.
    """

    free: jax.Array
    preempt: jax.Array
    new_slot: jax.Array
    new_tokens: jax.Array
    new_len: jax.Array
    new_salt: jax.Array
    slots: jax.Array
    want: jax.Array
    temperature: jax.Array
    top_p: jax.Array


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class StepOutput:
    """Per entry of ``StepPlan.slots``: what happened (``[R]`` each; ``logits: f32[R, vocab]``)."""

    ok: jax.Array
    num_new: jax.Array
    cache_hit: jax.Array
    sampled: jax.Array
    tokens: jax.Array
    logits: jax.Array


@dataclass(frozen=True)
class StepStatic:
    """The static part of a step (jit cache key): model graph, allocator layout, token budget, kernel."""

    graphdef: nnx.GraphDef
    layout: Layout
    token_budget: int
    impl: str = "auto"


def sample(logits: jax.Array, key: jax.Array, temperature: jax.Array, top_p: jax.Array) -> jax.Array:
    """Greedy when ``temperature == 0``, else temperature + nucleus (top-p) sampling; ``logits: [B, V]``."""
    greedy = jnp.argmax(logits, axis=-1)
    scaled = logits / jnp.maximum(temperature, 1e-6)
    order = jnp.argsort(-scaled, axis=-1)
    sorted_logits = jnp.take_along_axis(scaled, order, axis=-1)
    probs = jax.nn.softmax(sorted_logits, axis=-1)
    outside = jnp.cumsum(probs, axis=-1) - probs > top_p  # keep the smallest prefix reaching top_p
    choice = jax.random.categorical(key, jnp.where(outside, -jnp.inf, sorted_logits), axis=-1)
    drawn = jnp.take_along_axis(order, choice[:, None], axis=-1)[:, 0]
    return jnp.where(temperature > 0, drawn, greedy).astype(jnp.int32)


def _releases(layout: Layout, alloc: AllocatorState, plan: StepPlan) -> AllocatorState:
    def body(al, x):
        slot, free, preempt = x
        al = jax.lax.cond(free, lambda a: ops.free(layout, a, slot), lambda a: a, al)
        return jax.lax.cond(preempt, lambda a: ops.preempt(layout, a, slot), lambda a: a, al), None

    slots = jnp.arange(plan.free.shape[0], dtype=jnp.int32)
    return jax.lax.scan(body, alloc, (slots, plan.free, plan.preempt))[0]


def _admit(layout: Layout, alloc: AllocatorState, plan: StepPlan) -> AllocatorState:
    def body(al, x):
        slot, toks, n, salt = x
        return jax.lax.cond(slot >= 0, lambda a: ops.add_request(layout, a, slot, toks, n, salt),
                            lambda a: a, al), None

    return jax.lax.scan(body, alloc, (plan.new_slot, plan.new_tokens, plan.new_len, plan.new_salt))[0]


def _schedule(layout: Layout, alloc: AllocatorState, plan: StepPlan):
    """Allocate for every planned request in order: ``(alloc, ok, n, hit, start)`` per entry."""
    def run(a, slot, want):
        a, r = ops.schedule(layout, a, slot, want)
        return a, (r.ok, jnp.where(r.ok, r.num_new_tokens, 0), jnp.where(r.ok, r.cache_hit_tokens, 0))

    def skip(a, slot, want):
        return a, (jnp.bool_(False), jnp.int32(0), jnp.int32(0))

    def body(a, x):
        slot, want = x
        a, (ok, n, hit) = jax.lax.cond(want > 0, run, skip, a, jnp.maximum(slot, 0), want)
        return a, (ok, n, hit, jnp.where(ok, a.num_computed[jnp.maximum(slot, 0)] - n, 0))

    return jax.lax.scan(body, alloc, (plan.slots, plan.want))


def step(static: StepStatic, params: nnx.State, state: EngineState, plan: StepPlan):
    """One serving step (jit with ``static`` static and ``state`` donated): ``(state, StepOutput)``."""
    layout, budget = static.layout, static.token_budget
    alloc = ops.new_step(layout, state.alloc)
    alloc = _admit(layout, _releases(layout, alloc, plan), plan)
    alloc, (ok, n, hit, start) = _schedule(layout, alloc, plan)

    # The ragged batch: entry s computes positions [start_s, start_s + n_s).
    qsl = jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum(n)]).astype(jnp.int32)
    seq_lens = start + n
    seq, pos, valid = query_positions(qsl, seq_lens, budget)
    slot_of = jnp.maximum(plan.slots, 0)
    tokens = jnp.where(valid, alloc.tokens[slot_of[seq], jnp.minimum(pos, layout.max_model_len - 1)], 0)
    tables = alloc.tables[slot_of]                                          # [R, G, M]
    metadata = make_metadata(state.cache, layout.config_tables(tables),
                             qsl, seq_lens, budget)
    model = nnx.merge(static.graphdef, params)
    logits, cache = model.paged(tokens, jnp.where(valid, pos, 0), state.cache, metadata, static.impl)

    last = logits[jnp.maximum(qsl[1:] - 1, 0)]                              # [R, V]
    do_sample = ok & (seq_lens == alloc.num_tokens[slot_of])
    key, sub = jax.random.split(state.key)
    new_tokens = sample(last, sub, plan.temperature, plan.top_p)

    def append(a, x):
        slot, tok, go = x
        return jax.lax.cond(go, lambda b: ops.append_token(layout, b, slot, tok), lambda b: b, a), None

    alloc = jax.lax.scan(append, alloc, (slot_of, new_tokens, do_sample))[0]
    out = StepOutput(ok=ok, num_new=n, cache_hit=hit, sampled=do_sample,
                     tokens=jnp.where(do_sample, new_tokens, -1), logits=last)
    return EngineState(alloc, cache, key), out
