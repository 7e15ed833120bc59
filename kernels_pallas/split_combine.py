"""The last pass of a decode split over the context (flash-decoding): each query token's output from its runs.

The Mosaic GPU kernel splits an item's keys into runs, and writes per run and query row the normalised
output (in q's dtype) and the log of its softmax denominator (f32). ``combine`` weighs each token's runs by
those denominators, and by the head's sink (a run whose output is zero), in one Pallas kernel (Triton on a
GPU, interpret mode on CPU): one program per token and query head, padding tokens' rows written as zeros.
The same merges in XLA ran as two kernels in every layer for most run counts (its fusion heuristics cut
the denominators' tree from the weighted sum; ``benchmarks/gpu_hlo.py``).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from kernels_pallas.ragged import WorkItems


def _merge(x, y):
    """Two runs' ``(log-denominator, normalised output)`` as one: the online softmax's step, associative."""
    (m1, a1), (m2, a2) = x, y
    m = jnp.maximum(m1, m2)
    w1, w2 = jnp.exp(m1 - m), jnp.exp(m2 - m)  # the larger weighs 1; two unseen runs weigh 1 each
    return m + jnp.log(w1 + w2), (w1 * a1 + w2 * a2) / (w1 + w2)


def _merge_runs(runs: list) -> tuple:
    """``runs`` (``(log-denominator, output)`` pairs) merged pairwise, a tree of ``len(runs) - 1`` merges."""
    while len(runs) > 1:
        runs = [_merge(*runs[i:i + 2]) if i + 1 < len(runs) else runs[i] for i in range(0, len(runs), 2)]
    return runs[0]


def _kernel(item_ref, row_ref, lse_ref, o_ref, *refs, group: int, has_sinks: bool):
    sinks_ref, out_ref = refs if has_sinks else (None, *refs)
    t, head = pl.program_id(0), pl.program_id(1)
    item, h = item_ref[t], head // group
    row = row_ref[t] * group + head % group  # an item's rows: its tokens x the kv head's group of heads
    n, _, splits, _, d = o_ref.shape

    @pl.when(item < n)
    def _():
        runs = [(lse_ref[item, h, s, row], o_ref[item, h, s, row].astype(jnp.float32)) for s in range(splits)]
        if has_sinks:
            runs.append((sinks_ref[head], jnp.zeros((d,), jnp.float32)))
        out_ref[...] = _merge_runs(runs)[1].astype(out_ref.dtype)

    @pl.when(item >= n)
    def _():
        out_ref[...] = jnp.zeros((d,), out_ref.dtype)


@functools.partial(jax.jit, static_argnames=("group", "interpret"))
def combine(o: jax.Array, lse: jax.Array, sinks: jax.Array | None, items: WorkItems, *, group: int,
            interpret: bool = False) -> jax.Array:
    """Each token's output ``[T, Hq, D]`` (zeros for padding tokens; ``T``: ``items.token_item``'s length) from
    the runs' outputs ``o: [I, Hkv, splits, ROWS, D]`` and log-denominators ``lse: f32[I, Hkv, splits, ROWS]``
    (``ROWS``: ``ROWS / group`` tokens x ``group`` heads), with the sinks ``f32[Hq]`` where the layer has them."""
    _, hkv, _, _, d = o.shape
    tokens = items.token_item.shape[0]
    args = (items.token_item, items.token_row, lse, o, *(() if sinks is None else (sinks.astype(jnp.float32),)))
    return pl.pallas_call(
        functools.partial(_kernel, group=group, has_sinks=sinks is not None),
        grid=(tokens, hkv * group),
        in_specs=[pl.BlockSpec(x.shape, lambda t, j, n=x.ndim: (0,) * n) for x in args],
        out_specs=pl.BlockSpec((None, None, d), lambda t, j: (t, j, 0)),
        out_shape=jax.ShapeDtypeStruct((tokens, hkv * group, d), o.dtype),
        interpret=interpret,
        name="hkv_split_combine",
    )(*args)
