"""KV memory: typed views, writes confined to a layer's slice, Mamba states, and ``attention``."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import dense_attention

from hkv_jax.attention import attention, make_metadata
from hkv_jax.cache import (
    CacheLayout,
    KVCache,
    init_cache,
    layer_kv,
    read_mamba_state,
    set_layer_kv,
    slot_mapping,
    write_mamba_state,
)
from hkv_jax.planner import KVCacheConfig, KVCacheGroup, plan
from hkv_jax.spec import FullAttentionSpec, KVSharingSpec, MambaSpec, SlidingWindowSpec
from kernels_pallas import reference
from kernels_pallas.reference import AttentionParams

BS = 4
# Two groups of two layers; "s0"/"s1" (bf16, 1 kv head) fill half of the f32 page of "f0"/"f1".
LAYERS = [
    FullAttentionSpec(name="f0", num_kv_heads=2, head_size=8, dtype="float32"),
    SlidingWindowSpec(name="s0", num_kv_heads=1, head_size=8, dtype="bfloat16", sliding_window=6),
    FullAttentionSpec(name="f1", num_kv_heads=2, head_size=8, dtype="float32"),
    SlidingWindowSpec(name="s1", num_kv_heads=1, head_size=8, dtype="bfloat16", sliding_window=6),
    KVSharingSpec(name="x", target="f1"),
]


def padded_config() -> KVCacheConfig:
    """One bf16 layer using 3/4 of a hand-made page (the planner itself never pads attention pages)."""
    spec = FullAttentionSpec(name="p", num_kv_heads=3, head_size=8, dtype="bfloat16")
    group = KVCacheGroup(group_id=0, spec=spec, layer_names=("p",), block_size=BS)
    return KVCacheConfig(policy="manual", num_blocks=8, page_size_bytes=4 * BS * 2 * 8 * 2,
                         group_size=1, groups=(group,))


def random_cache(layers, num_blocks=8, seed=0, policy="vllm") -> KVCache:
    config = (padded_config() if layers == "padded"
              else plan(layers, block_size=BS, policy=policy, num_blocks=num_blocks))
    cache = init_cache(config)
    rng = np.random.default_rng(seed)
    bufs = tuple(jnp.asarray(rng.integers(0, 2**32, size=b.shape, dtype=np.uint64).astype(b.dtype))
                 for b in cache.buffers)
    return KVCache(bufs, cache.layout)


def raw(cache: KVCache) -> list[np.ndarray]:
    """Each buffer's bytes, ``u8[num_blocks, page_size_bytes]``."""
    return [np.array(b).view(np.uint8).reshape(b.shape[0], -1) for b in cache.buffers]


def test_layout_follows_the_plan():
    cache = random_cache(LAYERS)
    lay = cache.layout
    assert lay.num_tensors == 2 and lay.page_size_bytes == BS * 2 * 2 * 8 * 4
    assert lay.word_dtype == jnp.uint32 and cache.buffers[0].shape == (8, lay.page_size_bytes // 4)
    assert lay.slot("x") == lay.slot("f1")
    # vLLM's planner equalises page sizes through the block size: 16 bf16 tokens fill an f32 page.
    assert lay.slot("s1").block_size == 16
    assert layer_kv(cache, "s1").shape == (8, 2, 1, 16, 8) and layer_kv(cache, "s1").dtype == jnp.bfloat16
    with pytest.raises(KeyError, match="nope"):
        lay.slot("nope")


def test_init_cache_is_zero():
    config = plan(LAYERS, block_size=BS, policy="vllm", num_blocks=5)
    assert all(not np.asarray(b).any() for b in init_cache(config).buffers)


@pytest.mark.parametrize("layers, layer", [(LAYERS, "f0"), (LAYERS, "s1"), ("padded", "p")])
def test_views_round_trip_bit_exactly(layers, layer):
    cache = random_cache(layers)
    back = set_layer_kv(cache, layer, layer_kv(cache, layer))
    for a, b in zip(raw(cache), raw(back)):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("layers, layer", [(LAYERS, "f0"), (LAYERS, "s0"), (LAYERS, "s1"), ("padded", "p")])
def test_a_layer_write_lands_only_in_its_slice(layers, layer):
    cache = random_cache(layers, seed=1)
    lay = cache.layout
    slot = lay.slot(layer)
    spec, bs = slot.spec, slot.block_size
    rng = np.random.default_rng(2)
    slots = np.array([bs + 1, -1, 3 * bs + 1, 7 * bs + 2])  # pages 1, 3 and 7; one padding token
    k, v = (rng.normal(size=(4, spec.num_kv_heads, 8)).astype(np.float32) for _ in range(2))
    kv = reference.kv_write(layer_kv(cache, layer), jnp.asarray(k), jnp.asarray(v), jnp.asarray(slots))
    after = raw(set_layer_kv(cache, layer, kv))

    # Expected, in numpy: the layer's bytes are the first bytes of each page of its tensor.
    expected = raw(cache)
    used = slot.used_bytes
    view = expected[slot.tensor][:, :used].copy().view(jnp.dtype(spec.dtype)).reshape(
        8, 2, spec.num_kv_heads, bs, 8)
    for t, s in enumerate(slots):
        if s >= 0:
            view[s // bs, 0, :, s % bs] = k[t].astype(spec.dtype)
            view[s // bs, 1, :, s % bs] = v[t].astype(spec.dtype)
    expected[slot.tensor][:, :used] = view.reshape(8, used // view.itemsize).view(np.uint8)
    for i, (a, e) in enumerate(zip(after, expected)):
        np.testing.assert_array_equal(a, e, err_msg=f"tensor {i}")
    changed_pages = np.flatnonzero((after[slot.tensor] != raw(cache)[slot.tensor]).any(axis=1))
    assert set(changed_pages) <= {1, 3, 7}


def test_mamba_states_span_pages_and_round_trip():
    layers = [FullAttentionSpec(name="f", num_kv_heads=1, head_size=8, dtype="float32"),
              MambaSpec(name="m", shapes=[[10, 10], [3]], dtypes=["float32", "bfloat16"])]
    cache = random_cache(layers, num_blocks=10, policy="min-waste")
    slot = cache.layout.slot("m")
    assert slot.blocks_per_state == 2  # 406 state bytes over 256-byte pages
    ids = jnp.array([[1, 4], [6, 2], [0, 0], [8, 9]])
    rng = np.random.default_rng(3)
    states = (jnp.asarray(rng.normal(size=(4, 10, 10)), jnp.float32),
              jnp.asarray(rng.normal(size=(4, 3)), jnp.bfloat16))
    valid = jnp.array([True, True, True, False])
    new = write_mamba_state(cache, "m", ids, states, valid)
    got = read_mamba_state(new, "m", ids[:2])
    for g, s in zip(got, states):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(s[:2]))
    before, after = raw(cache), raw(new)
    changed = np.flatnonzero((before[slot.tensor] != after[slot.tensor]).any(axis=1))
    assert set(changed) <= {1, 4, 6, 2}  # not the null block, not the invalid row
    # The tail of the last page past the state keeps its bytes.
    tail = slot.used_bytes - cache.layout.page_size_bytes
    np.testing.assert_array_equal(after[slot.tensor][4, tail:], before[slot.tensor][4, tail:])
    with pytest.raises(ValueError, match=r"\[requests, 2\]"):
        read_mamba_state(cache, "m", ids[:, :1])


def test_slot_mapping_skips_the_null_block_and_invalid_tokens():
    table = jnp.array([0, 3, 5])
    pos = jnp.array([1, 4, 7, 9, 12])
    valid = jnp.array([True, True, True, False, True])
    np.testing.assert_array_equal(np.asarray(slot_mapping(table, pos, 4, valid)),
                                  [-1, 12, 15, -1, -1])


def test_buffers_hold_the_kv_dtype_so_a_layer_write_copies_no_buffer():
    """With one KV dtype over all attention layers the buffers are of that dtype, so a layer's page view
    is a reshape: the compiled write-and-attend has no bitcast_convert, which XLA:CPU runs as a copy of
    the whole buffer (a third of a Gemma 3 270M decode step went to six of them)."""
    layers = [FullAttentionSpec(name="f", num_kv_heads=2, head_size=8, dtype="bfloat16"),
              SlidingWindowSpec(name="s", num_kv_heads=2, head_size=8, dtype="bfloat16", sliding_window=6)]
    cache = init_cache(plan(layers, block_size=BS, num_blocks=8))
    assert all(b.dtype == jnp.bfloat16 for b in cache.buffers)
    tables = [jnp.array([[1, 2]]), jnp.array([[3, 4]])]
    meta = make_metadata(cache, tables, jnp.array([0, 5]), jnp.array([5]), num_tokens=5)
    kv = jnp.ones((5, 2, 8), jnp.bfloat16)
    step = jax.jit(lambda c, m: attention("f", jnp.ones((5, 4, 8), jnp.bfloat16), kv, kv, c, m, impl="blocked"),
                   donate_argnums=0)
    assert "bitcast-convert" not in step.lower(cache, meta).compile().as_text()
    out, cache = step(cache, meta)
    np.testing.assert_allclose(np.asarray(out, np.float32), 1.0)  # every value is 1: so is their average
    np.testing.assert_array_equal(np.asarray(layer_kv(cache, "f")[1:3], np.float32).sum(), 2 * 2 * 5 * 8)


def test_fp8_pages_are_bytes_on_cpu_so_a_layer_write_copies_no_buffer():
    """fp8 pages are gathered and scattered as bytes on XLA:CPU (no fp8 gather or scatter there): the buffers
    hold uint8 words, whose fp8 page view XLA folds into those byte views, so the compiled write-and-attend
    converts no buffer (over fp8 words, each layer's view was a copy of its pages in every layer of every
    step). Written values read back rounded to e4m3, and a layout built off the CPU keeps fp8 words."""
    layers = [FullAttentionSpec(name="f", num_kv_heads=2, head_size=8, dtype="float8_e4m3fn"),
              SlidingWindowSpec(name="s", num_kv_heads=2, head_size=8, dtype="float8_e4m3fn", sliding_window=6)]
    config = plan(layers, block_size=BS, num_blocks=8)
    assert CacheLayout.from_config(config).word_dtype == jnp.float8_e4m3fn
    cache = init_cache(config)
    assert cache.layout.fp8_bytes and all(b.dtype == jnp.uint8 for b in cache.buffers)
    tables = [jnp.array([[1, 2]]), jnp.array([[3, 4]])]
    meta = make_metadata(cache, tables, jnp.array([0, 5]), jnp.array([5]), num_tokens=5)
    kv = jnp.full((5, 2, 8), 1.3, jnp.float32)  # e4m3 holds 1.25 and 1.375: 1.3 rounds to 1.25
    for impl in ("reference", "blocked"):
        step = jax.jit(lambda c, m: attention("f", jnp.ones((5, 4, 8), jnp.float32), kv, kv, c, m, impl=impl),
                       donate_argnums=0)
        hlo = step.lower(cache, meta).compile().as_text()
        converts = [line for line in hlo.splitlines() if "bitcast-convert(" in line and "[8," in line]
        assert not converts, (impl, converts)
        out, cache = step(cache, meta)
        np.testing.assert_allclose(np.asarray(out), 1.25)
    assert layer_kv(cache, "f").dtype == jnp.float8_e4m3fn
    np.testing.assert_array_equal(np.asarray(layer_kv(cache, "f")[1:3], np.float32).sum(), 1.25 * 2 * 2 * 5 * 8)


def test_attention_writes_and_attends_like_dense_attention():
    """Prefill two sequences, then decode one token each; a KV-sharing layer reads the same pages."""
    cache = random_cache(LAYERS, num_blocks=12, seed=4)
    cache = KVCache(tuple(jnp.zeros_like(b) for b in cache.buffers), cache.layout)
    rng = np.random.default_rng(5)
    lens = [7, 6]
    full_kv = {l: [rng.normal(size=(2, n + 1, 2, 8)).astype(np.float32) for n in lens] for l in ("f1",)}
    tables = [jnp.array([[1, 2, 0, 0], [3, 4, 0, 0]]), jnp.array([[5, 6, 0, 0], [7, 8, 0, 0]])]
    q = rng.normal(size=(sum(lens), 4, 8)).astype(np.float32)
    qsl, seq_lens = jnp.array([0, 7, 13]), jnp.array(lens)
    meta = make_metadata(cache, tables, qsl, seq_lens, num_tokens=14)  # one padding token
    kk = np.concatenate([full_kv["f1"][0][0, :7], full_kv["f1"][1][0, :6], np.zeros((1, 2, 8))])
    vv = np.concatenate([full_kv["f1"][0][1, :7], full_kv["f1"][1][1, :6], np.zeros((1, 2, 8))])
    qq = np.concatenate([q, np.zeros((1, 4, 8))]).astype(np.float32)
    step = jax.jit(lambda q, k, v, c, m: attention("f1", q, k, v, c, m, soft_cap=4.0))
    out, cache = step(qq, kk.astype(np.float32), vv.astype(np.float32), cache, meta)
    params = AttentionParams(soft_cap=4.0)
    for s, (lo, n) in enumerate(((0, 7), (7, 6))):
        want = dense_attention(q[lo:lo + n], full_kv["f1"][s][0, :n], full_kv["f1"][s][1, :n], params, None)
        np.testing.assert_allclose(np.asarray(out[lo:lo + n]), want, atol=2e-5)
    assert not np.asarray(out[13]).any()

    # Decode: one token per sequence; the KV-sharing layer "x" reads f1's pages without writing.
    seq_lens = jnp.array([8, 7])
    meta = make_metadata(cache, tables, jnp.array([0, 1, 2]), seq_lens, num_tokens=2)
    k_new = np.stack([full_kv["f1"][s][0, n] for s, n in enumerate(lens)])
    v_new = np.stack([full_kv["f1"][s][1, n] for s, n in enumerate(lens)])
    q_new = rng.normal(size=(2, 4, 8)).astype(np.float32)
    out, cache = attention("f1", q_new, k_new, v_new, cache, meta)
    shared, same = attention("x", q_new, None, None, cache, meta)
    assert same is cache
    np.testing.assert_array_equal(np.asarray(shared), np.asarray(out))
    for s, n in enumerate(lens):
        want = dense_attention(q_new[s:s + 1], full_kv["f1"][s][0], full_kv["f1"][s][1], AttentionParams(), None)
        np.testing.assert_allclose(np.asarray(out[s:s + 1]), want, atol=2e-5)
    with pytest.raises(ValueError, match="both k and v"):
        attention("f1", q_new, k_new, None, cache, meta)
