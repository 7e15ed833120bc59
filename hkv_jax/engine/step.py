"""The jitted serving step: everything after the host's scheduling decision, on the device.

The programs, each with the state donated:

- ``prepare(layout, alloc, changes)`` frees and preempts what the host asks and
  admits new requests (their prompts in one flat buffer whose size is rounded
  up to a power of two; only the prompts' blocks are hashed). It runs only in
  steps that release or admit something, and it is small, so a new prompt size
  recompiles it, never the step.
- ``step(static, params, state, plan)`` (fixed shapes: one compilation per
  engine) runs the allocator for every scheduled request (prefix lookup,
  allocation, block caching), builds the attention metadata, runs the model's
  paged forward (KV write + attention for every group), computes logits only
  where a token is sampled, samples (greedy without a sort; temperature +
  top-p, top-k, min-p; vLLM's penalties; per-request seeds; logit biases and
  ``min_tokens``), and appends the sampled tokens.
- ``decode_steps(static, steps, params, state, plan, left, stops)`` runs up to
  ``steps`` decode steps of one plan in a ``while_loop`` (``Engine(decode_steps=K)``),
  stopping at the first step the host must look at.

A decode step where no request takes, fills or releases a block (most decode steps: each report
says which requests' next decode is such) runs a lean variant of the step (``StepStatic.lean``):
the allocator only counts the tokens, with no conditional in the program.

The allocator runs vectorised (``StepStatic.vectorised``, the default): the plan
lists decoding requests first (``decode_step``), then running requests that
compute a chunk (``schedule_batch`` over those lanes only), then waiting ones
(``prefill_batch``); a batched op whose conditions fail falls back to
``schedule_batch`` on its lanes, and a plan in another order runs sequentially.
``vectorised=False`` runs every stage request by request (``schedule`` per
request, one ``free`` / ``add_request`` / ``append_token`` each): the exact
statement the vectorised path is tested against. The host reads back one
``i32[7, R]`` array per step (``StepOutput.report``; more rows with top log-probabilities).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, fields, replace

import jax
import jax.numpy as jnp
from flax import nnx

from hkv_jax.allocator import host_tier, ops
from hkv_jax.allocator.decode import DecodePath
from hkv_jax.allocator.state import RUNNING, WAITING, AllocatorState, Layout, hash_once
from hkv_jax.attention import make_metadata
from hkv_jax.cache import KVCache
from hkv_jax.engine.changes import Changes
from hkv_jax.engine.request import may_stop
from hkv_jax.engine.sampler import bias_logits, penalize, sample, split_key
from hkv_jax.engine.speculative import DraftModelStatic, NgramSpec, accepted_drafts, model_drafts, ngram_drafts
from hkv_jax.engine.step_messages import REPORT_ROWS, StepOutput, StepPlan
from hkv_jax.recurrent import commit_accepted
from kernels_pallas.positions import query_positions

# The scheduler's message to ``prepare``: a pytree of arrays here (changes.py itself imports no jax).
jax.tree_util.register_dataclass(Changes, data_fields=[f.name for f in fields(Changes)], meta_fields=[])


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class EngineState:
    """Everything the step reads and writes: allocator, KV memory, sampling key and the host tier
    (``host_tier.HostTier`` in host memory; ``None`` without one)."""

    alloc: AllocatorState
    cache: KVCache
    key: jax.Array
    host: host_tier.HostTier | None = None


@dataclass(frozen=True)
class StepStatic:
    """The static part of a step (jit cache key): model graph and the tree structure of its parameters
    (the step takes them as a flat list, which jit flattens in C++; an ``nnx.State`` is flattened in
    Python on every call), allocator layout, token budget (the bucket), kernel, whether the allocator
    runs vectorised, ``lean``: the program for decode steps where no block moves (the allocator
    only counts tokens, ``ops.count_if_idle``; if a lane would move a block it applies nothing and
    reports no lane allocated), ``top_logprobs``: how many of the likeliest tokens each report
    lists with their log-probabilities (0: none), and ``speculative``: the drafting method of a
    speculative step (``None``: each decoding entry computes one token)."""

    __hash__ = hash_once

    graphdef: nnx.GraphDef
    params_def: jax.tree_util.PyTreeDef
    layout: Layout
    token_budget: int
    impl: str = "auto"
    vectorised: bool = True
    lean: bool = False
    top_logprobs: int = 0
    speculative: NgramSpec | DraftModelStatic | None = None

    @property
    def report_rows(self) -> int:
        """Rows of its ``StepOutput.report``."""
        return len(REPORT_ROWS) + 2 * self.top_logprobs


def prepare(layout: Layout, alloc: AllocatorState, changes: Changes, vectorised: bool = True) -> AllocatorState:
    """Free and preempt (slot order), then admit (in order): jit with ``layout``, ``vectorised`` static
    and ``alloc`` donated."""
    if vectorised:
        alloc = ops.release_batch(layout, alloc, changes.free, changes.preempt)
        return ops.admit_batch(layout, alloc, changes.slots, changes.prompts, changes.lens, changes.salts)

    def release(al, x):
        slot, free, preempt = x
        al = jax.lax.cond(free, lambda a: ops.free(layout, a, slot), lambda a: a, al)
        return jax.lax.cond(preempt, lambda a: ops.preempt(layout, a, slot), lambda a: a, al), None

    slots = jnp.arange(layout.max_requests, dtype=jnp.int32)
    alloc = jax.lax.scan(release, alloc, (slots, changes.free, changes.preempt))[0]
    starts = jnp.cumsum(changes.lens) - changes.lens
    cols = jnp.arange(layout.max_model_len)

    def admit(al, x):
        slot, start, n, salt = x
        row = changes.prompts[jnp.clip(start + cols, 0, changes.prompts.shape[0] - 1)]
        return jax.lax.cond(slot >= 0, lambda a: ops.add_request(layout, a, slot, row, n, salt), lambda a: a, al), None

    return jax.lax.scan(admit, alloc, (changes.slots, starts, changes.lens, changes.salts))[0]


# --- step ------------------------------------------------------------------------------------------


def _schedule_sequential(layout: Layout, alloc: AllocatorState, slots, want, lookahead):
    """Every planned request in order, one ``schedule`` each: ``(alloc, ok, n, hit)``."""
    return ops.schedule_batch(layout, alloc, slots, want, want > 0, lookahead)


def _schedule_vectorised(layout: Layout, alloc: AllocatorState, slots, want, lookahead):
    """The plan's three sections (decoding, running with a chunk, waiting), each batched; the same
    results as ``_schedule_sequential``.

    ``decode_step`` runs the decoding lanes; then, in two phases over one ``schedule_batch`` (so the
    program holds one copy of the sequential schedule), phase 0 runs the running lanes with a chunk
    and any decoding lanes ``decode_step`` left (its vectorised conditions failed), phase 1 runs
    ``prefill_batch`` on the waiting lanes and, where its conditions failed, ``schedule_batch`` on
    them. A plan in another order runs every lane in phase 0, in order. ``lookahead: i32[R]``: draft
    slots per lane (decoding lanes only).
    """
    R = want.shape[0]
    active = want > 0
    waiting = active & (alloc.status[slots] == WAITING)
    decoding = active & ~waiting & (want == 1)
    section = jnp.where(decoding, 0, jnp.where(waiting, 2, 1))
    in_order = jnp.all(~active | (jax.lax.cummax(jnp.where(active, section, 0)) == section))
    decoding &= in_order
    waiting &= in_order

    def decode(a):
        a, ok, path = ops.decode_step(layout, a, slots, fallback=False, mask=decoding, lookahead=lookahead)
        return a, ok, path == DecodePath.FALLBACK

    alloc, ok, redo = jax.lax.cond(jnp.any(decoding), decode, lambda a: (a, jnp.zeros(R, bool), jnp.bool_(False)),
                                   alloc)
    n, hit = ok.astype(jnp.int32), jnp.zeros(R, jnp.int32)
    sequential = active & ~waiting & ~(decoding & ~redo)

    def phase(i, carry):
        alloc, ok, n, hit, lanes = carry

        def prefill(c):
            alloc, ok, n, hit, _ = c
            alloc, ok_w, n_w, h_w, fast = ops.prefill_batch(layout, alloc, slots, want, fallback=False, mask=waiting)
            return (alloc, jnp.where(waiting, ok_w, ok), jnp.where(waiting, n_w, n), jnp.where(waiting, h_w, hit),
                    waiting & ~fast)

        carry = jax.lax.cond((i == 1) & jnp.any(waiting), prefill, lambda c: c, (alloc, ok, n, hit, lanes))
        alloc, ok, n, hit, lanes = carry

        def run(a):
            a, ok_s, n_s, h_s = ops.schedule_batch(layout, a, slots, want, lanes, lookahead)
            return a, jnp.where(lanes, ok_s, ok), jnp.where(lanes, n_s, n), jnp.where(lanes, h_s, hit)

        alloc, ok, n, hit = jax.lax.cond(jnp.any(lanes), run, lambda a: (a, ok, n, hit), alloc)
        return alloc, ok, n, hit, jnp.zeros(R, bool)

    alloc, ok, n, hit, _ = jax.lax.fori_loop(0, 2, phase, (alloc, ok, n, hit, sequential))
    return alloc, ok, n, hit


def _allocate(static: StepStatic, alloc: AllocatorState, slot_of, want, lookahead=None):
    """The allocator's part of a step: ``(alloc, ok, n, hit)`` per lane (``static.lean``: only count the
    tokens, applying nothing unless every lane is idle); ``lookahead: i32[R]``: draft slots per lane."""
    layout = static.layout
    if static.lean:
        active = want > 0
        alloc, lane_idle = ops.count_if_idle(layout, alloc, slot_of, active)
        ok = active & jnp.all(lane_idle | ~active)
        return alloc, ok, ok.astype(jnp.int32), jnp.zeros_like(slot_of)
    alloc = ops.new_step(layout, alloc)
    schedule = _schedule_vectorised if static.vectorised else _schedule_sequential
    return schedule(layout, alloc, slot_of, want, jnp.zeros_like(want) if lookahead is None else lookahead)


def _propose(static: StepStatic, draft_params: list[jax.Array], alloc: AllocatorState, plan: StepPlan, slot_of):
    """Each entry's draft (``static.speculative``; ``draft_params``: a draft model's parameters):
    ``(i32[R, k] tokens, i32[R] count)``; the count is 0 where the entry does not decode, may not draft
    (``drafts``), finds no n-gram, or has no room left under its token limit (a draft never takes it, nor
    ``max_model_len``, past the end). With Mamba layers a draft also ends where the entry's current Mamba
    block does, so the state verification keeps is rewritten in place (``recurrent.commit_accepted``)."""
    layout, cols, spec = static.layout, plan.sampling(), static.speculative
    T, C = alloc.num_tokens[slot_of], alloc.num_computed[slot_of]
    decoding = (plan.want == 1) & (alloc.status[slot_of] == RUNNING) & (T - C == 1)
    if isinstance(spec, NgramSpec):
        draft, count = ngram_drafts(alloc.tokens[slot_of], T, spec)
    else:
        model = nnx.merge(spec.graphdef, jax.tree.unflatten(spec.params_def, draft_params))
        # Only rows that may draft: the others' forwards would be thrown away.
        tokens = jnp.where((decoding & (cols["drafts"] > 0))[:, None], alloc.tokens[slot_of], 0)
        draft, count = model_drafts(model, tokens, T, spec.num_speculative_tokens)
    room = jnp.minimum(cols["token_limit"], layout.max_model_len) - T - 1
    for g in layout.mamba_groups:  # the step's tokens stay in the block of the Mamba state it rewrites
        room = jnp.minimum(room, layout.block_sizes[g] - 1 - C % layout.block_sizes[g])
    return draft, jnp.where(decoding, jnp.maximum(jnp.minimum(count, jnp.minimum(cols["drafts"], room)), 0), 0)


@dataclass(frozen=True)
class _Batch:
    """A step's ragged batch once the allocator ran (``_inputs``): entry ``s`` (lane ``s`` of the plan,
    request slot ``slot_of[s]``) computes positions ``[start_s, start_s + n_s + count_s)``: ``n_s`` known
    tokens, then ``count_s`` draft tokens; it is sampled at ``P`` positions (``at``: ``i32[R, P]`` token
    indices), its last known token and each draft token after it."""

    slot_of: jax.Array    # i32[R]
    n: jax.Array          # i32[R]: known tokens computed (0 where refused)
    start: jax.Array      # i32[R]
    count: jax.Array      # i32[R]: draft tokens computed
    P: int
    qsl: jax.Array        # i32[R + 1]: query start of each entry
    tokens: jax.Array     # i32[budget]
    pos: jax.Array        # i32[budget]
    valid: jax.Array      # bool[budget]
    metadata: object      # attention.AttentionMetadata
    at: jax.Array         # i32[R, P]


def _inputs(static: StepStatic, state: EngineState, plan: StepPlan, alloc: AllocatorState, ok, n, draft):
    """Stage 1: the model's inputs, ``(alloc, _Batch)``. A speculative step's drafts go after the known
    tokens in ``alloc``, where the forward and the penalties read them."""
    layout, budget = static.layout, static.token_budget
    slot_of = jnp.maximum(plan.slots, 0)
    n = jnp.where(ok, n, 0)
    start = jnp.where(ok, alloc.num_computed[slot_of] - n, 0)
    P = 1 if draft is None else static.speculative.num_speculative_tokens + 1  # sampled positions per entry
    count = jnp.zeros_like(n) if draft is None else jnp.where(ok, draft[1], 0)
    if draft is not None:
        j = jnp.arange(P - 1)[None, :]
        rows = jnp.where(j < count[:, None], slot_of[:, None], layout.max_requests)
        cols = alloc.num_tokens[slot_of][:, None] + j
        alloc = replace(alloc, tokens=alloc.tokens.at[rows, cols].set(draft[0], mode="drop"))
    qsl = jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum(n + count)]).astype(jnp.int32)
    seq_lens = start + n + count
    seq, pos, valid = query_positions(qsl, seq_lens, budget)
    tokens = jnp.where(valid, alloc.tokens[slot_of[seq], jnp.minimum(pos, layout.max_model_len - 1)], 0)
    tables = alloc.tables[slot_of]                                          # [R, G, M]
    metadata = make_metadata(state.cache, layout.config_tables(tables), qsl, seq_lens, budget,
                             record_positions=P if draft is not None and layout.mamba_groups else 0)
    last = jnp.maximum(qsl[1:] - 1, 0)
    at = jnp.minimum(jnp.maximum(last - count, 0)[:, None] + jnp.arange(P)[None, :], last[:, None])
    return alloc, _Batch(slot_of, n, start, count, P, qsl, tokens, pos, valid, metadata, at)


def _forward(static: StepStatic, params: list[jax.Array], state: EngineState, b: _Batch):
    """Stage 2: the model's paged forward (KV write and attention for every group), logits only at the
    sampled positions: ``(model, logits [R * P, V], cache)``."""
    model = nnx.merge(static.graphdef, jax.tree.unflatten(static.params_def, params))
    logits, cache = model.paged(b.tokens, jnp.where(b.valid, b.pos, 0), state.cache, b.metadata, static.impl,
                                sample_at=b.at.reshape(-1))
    return model, logits, cache


_PENALTIES = ("repetition_penalty", "presence_penalty", "frequency_penalty")
_DRAW = ("temperature", "top_p", "top_k", "min_p", "seed")  # the sampling columns ``sample`` takes


def _logits_processors(plan: StepPlan, alloc: AllocatorState, b: _Batch, columns, per_row, positions, rows_sample):
    """Stage 3: logit biases, then vLLM's penalties (their order there): ``(adjust, adjusted)``, whether any
    sampled row has any (``bool[R * P]``), and the function giving the scores the sampler then sees
    (``logits`` and the log-probabilities stay raw). ``columns()``: the plan's sampling values per row."""
    def bias():
        return None if not plan.bias_slots else tuple(per_row(x) for x in plan.logit_bias())

    def adjusted(logits):
        values, entries = columns(), bias()
        scores = logits if entries is None else bias_logits(logits, *entries, positions - values["prompt_len"],
                                                             values["min_tokens"])
        return penalize(scores, per_row(alloc.tokens[b.slot_of]), positions, values["prompt_len"],
                        *(values[name] for name in _PENALTIES))

    values, entries = columns(), bias()
    repetition, presence, frequency = (values[name] for name in _PENALTIES)
    adjust = rows_sample & ((repetition != 1) | (presence != 0) | (frequency != 0))
    if entries is not None:
        adjust |= rows_sample & jnp.any(entries[0] >= 0, axis=1)
    return adjust, adjusted


def _sample(static: StepStatic, state: EngineState, plan: StepPlan, alloc: AllocatorState, b: _Batch, ok, logits):
    """Stage 4, the sampler: ``(tokens i32[R * P], do_sample bool[R], key)``, each sampled row under its
    request's values, after the logits processors where some row has any."""
    R, P = b.slot_of.shape[0], b.P
    known = b.start + b.n                                                   # the index of the token sampled first
    do_sample = ok & (known == alloc.num_tokens[b.slot_of])
    key, sub = split_key(state.key)
    if static.lean:  # a lean step that applied nothing leaves everything as it was, the key too
        key = jnp.where(jnp.any(ok), key, state.key)

    def per_row(x):  # an entry's value for each of its P sampled rows
        return x if P == 1 else jnp.repeat(x, P, axis=0)

    positions = per_row(known) + (0 if P == 1 else jnp.tile(jnp.arange(P), R))
    rows_sample = (do_sample[:, None] & (jnp.arange(P)[None, :] <= b.count[:, None])).reshape(-1)

    def columns():
        """The plan's sampling values per sampled row. Read inside each branch of the conditional below, so
        that it takes the plan's one array: on a GPU each value passed in alone would be a kernel."""
        return {name: per_row(v) for name, v in plan.sampling().items()}

    def draw(scores):
        values = columns()
        return sample(scores, sub, position=positions, **{name: values[name] for name in _DRAW})

    adjust, adjusted = _logits_processors(plan, alloc, b, columns, per_row, positions, rows_sample)
    # A step where no sampled row has any skips them: a conditional on the tokens, so that no [R, V] copy is
    # made. On a GPU it runs inside XLA's CUDA graph (no loop in its branches), with no read by the host.
    new_tokens = jax.lax.cond(jnp.any(adjust), lambda: draw(adjusted(logits)), lambda: draw(logits))
    return new_tokens, do_sample, key


def _commit(static: StepStatic, alloc: AllocatorState, cache, model, b: _Batch, new_tokens, do_sample, draft):
    """Stage 5: the sampled tokens into the allocator: ``(alloc, cache, emitted i32[R] | None)``. A
    speculative step's rejection sampler keeps each entry's tokens up to the first that differs from its
    draft (``accepted_drafts``), and Mamba states move to the last accepted token."""
    layout, slot_of = static.layout, b.slot_of
    if draft is not None:
        sampled = new_tokens.reshape(slot_of.shape[0], b.P)
        emitted = jnp.where(do_sample, accepted_drafts(draft[0], b.count, sampled) + 1, 0)
        alloc = ops.accept_drafts(layout, alloc, slot_of, sampled, emitted, do_sample)
        if b.metadata.record_positions:
            cache = commit_accepted(model, cache, b.metadata, emitted)
        return alloc, cache, emitted
    if static.vectorised:
        return ops.append_batch(layout, alloc, slot_of, new_tokens, do_sample), cache, None

    def append(a, x):
        slot, tok, go = x
        return jax.lax.cond(go, lambda c: ops.append_token(layout, c, slot, tok), lambda c: c, a), None

    return jax.lax.scan(append, alloc, (slot_of, new_tokens, do_sample))[0], cache, None


def _report(static: StepStatic, alloc: AllocatorState, b: _Batch, ok, hit, do_sample, emitted, new_tokens, logits):
    """Stage 6: the host's report, one per sampled position (``i32[P, rows, R]``; position ``j > 0`` counts
    one computed draft token): ok, tokens computed, cache hits, sampled, the token, whether the lane's
    next decode only counts its token, the token's log-probability, drafts; then the top log-probabilities."""
    R, P = b.slot_of.shape[0], b.P
    _, idle_next = ops.count_if_idle(static.layout, alloc, b.slot_of, do_sample)
    scores = logits.astype(jnp.float32)
    lse = jax.nn.logsumexp(scores, axis=-1)
    logprob = jnp.take_along_axis(scores, new_tokens[:, None], axis=-1)[:, 0] - lse
    bits = functools.partial(jax.lax.bitcast_convert_type, new_dtype=jnp.int32)
    j = jnp.arange(P)[None, :]
    emits = j < (do_sample.astype(jnp.int32)[:, None] if emitted is None else emitted[:, None])   # [R, P]
    lane = functools.partial(jnp.broadcast_to, shape=(R, P))
    report = jnp.stack([lane(ok[:, None].astype(jnp.int32)), jnp.where(j == 0, b.n[:, None], emits),
                        jnp.where(j == 0, jnp.where(ok, hit, 0)[:, None], 0), emits.astype(jnp.int32),
                        jnp.where(emits, new_tokens.reshape(R, P), -1), lane(idle_next[:, None].astype(jnp.int32)),
                        bits(jnp.where(emits, logprob.reshape(R, P), 0.0)),
                        jnp.where(j == 0, b.count[:, None], 0)]).transpose(2, 0, 1)
    if static.top_logprobs:
        top, ids = jax.lax.top_k(scores, static.top_logprobs)                 # [R * P, N] each
        top_rows = [ids.astype(jnp.int32), bits(top - lse[:, None])]
        report = jnp.concatenate([report] + [x.reshape(R, P, -1).transpose(1, 2, 0) for x in top_rows], axis=1)
    return report


def _restore(static: StepStatic, state: EngineState, slot_of, want) -> EngineState:
    """The host tier's hits for the plan's waiting requests, before the allocator runs: their blocks are
    entered in the device prefix cache and their pages copied up (``host_tier.restore``)."""
    alloc, host, up = host_tier.restore(static.layout, state.alloc, state.host, slot_of, want > 0)
    buffers = host_tier.copy_pages(host.buffers, state.cache.buffers, up, host.memory_kind, to_host=False)
    return replace(state, alloc=alloc, cache=replace(state.cache, buffers=buffers), host=host)


def _store(layout: Layout, blocks, alloc: AllocatorState, cache: KVCache, host: host_tier.HostTier):
    """Device blocks ``blocks`` (``host_tier.store``, the blocks first, then zeros; none or few in most decode
    steps: then nothing or a narrow program runs), their pages copied down to the host tier."""
    def run(width, host):
        host, down = host_tier.store(layout, blocks[:width], alloc, host)
        return replace(host, buffers=host_tier.copy_pages(cache.buffers, host.buffers, down, host.memory_kind,
                                                          to_host=True))

    return host_tier.by_count(jnp.sum(blocks > 0), blocks.shape[0], run, host)


def release_to_host(layout: Layout, alloc: AllocatorState, cache: KVCache, host: host_tier.HostTier,
                    changes: Changes) -> host_tier.HostTier:
    """Before ``prepare`` releases the requests ``changes`` frees or preempts: the blocks a hit ending where
    their cached prefix ends needs go down to the host tier (``host_tier.released_blocks``), and the earlier
    end windows of their prefixes to the LRU's head (``host_tier.supersede``; jit with ``layout`` static
    and ``host`` donated)."""
    go = changes.free | changes.preempt
    host = _store(layout, host_tier.released_blocks(layout, host, alloc, go), alloc, cache, host)
    return host_tier.supersede(layout, host, alloc, go)


def _compute(static: StepStatic, params: list[jax.Array], state: EngineState, plan: StepPlan, alloc, ok, n, hit,
             draft=None, before=None):
    """The rest of a step once the allocator ran (``alloc`` and its lanes' ``ok, n, hit``), in its stages:
    inputs, forward, logits processors and sampler, token commit, report: ``(state, StepOutput)``.
    ``draft``: a speculative step's drafts (``_propose``), whose slots the allocator held: each entry also
    computes them, is sampled after its last known token and after each of them, and emits the sampled
    tokens up to the first that differs from the draft. With a host tier, the blocks the step computed
    (``host_tier.computed_blocks`` from ``before``: ``host_tier.at_start`` at the step's start) go down at the end."""
    alloc, b = _inputs(static, state, plan, alloc, ok, n, draft)
    model, logits, cache = _forward(static, params, state, b)
    new_tokens, do_sample, key = _sample(static, state, plan, alloc, b, ok, logits)
    alloc, cache, emitted = _commit(static, alloc, cache, model, b, new_tokens, do_sample, draft)
    report = _report(static, alloc, b, ok, hit, do_sample, emitted, new_tokens, logits)
    host = state.host
    if host is not None and before is not None:
        host = _store(static.layout, host_tier.computed_blocks(static.layout, host, before, alloc), alloc, cache,
                      host)
    if draft is None:
        return EngineState(alloc, cache, key, host), StepOutput(report=report[0], logits=logits)
    R = b.slot_of.shape[0]
    return EngineState(alloc, cache, key, host), StepOutput(report=report, logits=logits.reshape(R, b.P, -1))


def step(static: StepStatic, params: list[jax.Array], state: EngineState, plan: StepPlan):
    """One serving step (jit with ``static`` static and ``state`` donated): ``(state, StepOutput)``.
    ``params``: the model's parameters as the leaves of ``static.params_def`` (then a draft model's). With
    ``static.speculative``, decoding entries draft and verify their drafts in it too."""
    slot_of = jnp.maximum(plan.slots, 0)
    params, draft_params = params[:static.params_def.num_leaves], params[static.params_def.num_leaves:]
    draft = None if static.speculative is None else _propose(static, draft_params, state.alloc, plan, slot_of)
    before = None
    if state.host is not None and not static.lean:  # a lean step caches nothing, so no block moves
        state = _restore(static, state, slot_of, plan.want)
        before = host_tier.at_start(state.alloc)
    alloc, ok, n, hit = _allocate(static, state.alloc, slot_of, plan.want, None if draft is None else draft[1])
    return _compute(static, params, state, plan, alloc, ok, n, hit, draft, before)


def decode_steps(static: StepStatic, steps: int, params: list[jax.Array], state: EngineState, plan: StepPlan,
                 left: jax.Array, stops: jax.Array):
    """Up to ``steps`` decode steps of ``plan`` in one program (jit with ``static`` and ``steps`` static,
    ``state`` donated): every planned request, running, decodes one token per step. The allocator part
    of each is ``decode_step`` without its sequential fallback, so the states and reports equal those of
    as many ``step`` calls.

    It stops after a step the host must look at: a lane refused or not sampled, a lane's last token
    (``left: i32[R]``: tokens each planned lane may still generate) or a token in ``stops: i32[S]``
    (every stop token of the planned requests, -1 padded); and before a step that needs the fallback
    (that step does not run: the caller runs it with ``step``). Returns ``(state, StepOutput)``:
    ``report: i32[steps, rows, R]``, one report per step run (-1 everywhere for the others), and the last
    step's ``logits``.
    """
    layout = static.layout
    slot_of, active = jnp.maximum(plan.slots, 0), plan.want > 0
    state = replace(state, alloc=ops.new_step(layout, state.alloc))  # the clock, renumbered once

    def body(carry):
        i, state, reports, logits, _ = carry
        alloc = ops.new_step(layout, state.alloc, renumber=False)
        alloc, ok, path = ops.decode_step(layout, alloc, slot_of, fallback=False, mask=active)
        ran = path != DecodePath.FALLBACK  # the fallback's steps: this one does not run (decode_step applied nothing)

        def run():
            return _compute(static, params, state, plan, alloc, ok, ok.astype(jnp.int32), jnp.zeros_like(slot_of),
                            before=host_tier.at_start(state.alloc))

        # The skipped step returns ``alloc`` too (unchanged but for ``new_step``, which the full step
        # repeats): the state before it is then dead, and XLA updates the pool and cache in place.
        skip = (replace(state, alloc=alloc), StepOutput(jnp.full_like(reports[0], -1), logits))
        state, out = jax.lax.cond(ran, run, lambda: skip)
        sampled, tokens = out.row("sampled") != 0, out.row("tokens")
        go = ran & (i + 1 < steps) & jnp.all(~active | (sampled & ~may_stop(left - (i + 1), tokens, stops, jnp)))
        return i + 1, state, reports.at[i].set(out.report), out.logits, go

    reports = jnp.full((steps, static.report_rows, plan.slots.shape[0]), -1, jnp.int32)
    logits = jax.eval_shape(lambda: _compute(static, params, state, plan, state.alloc, active, plan.want,
                                             plan.want)[1].logits)
    carry = (jnp.int32(0), state, reports, jnp.zeros(logits.shape, logits.dtype), jnp.bool_(True))
    _, state, reports, logits, _ = jax.lax.while_loop(lambda c: c[4], body, carry)
    return state, StepOutput(report=reports, logits=logits)
