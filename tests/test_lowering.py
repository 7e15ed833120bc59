"""The accelerator kernels lower on this CPU-only machine, given an abstract device: for CUDA (Hopper)
and for TPU, at every shape the planner produces for the presets (both policies), and inside the whole
engine's decode programs, whose KV pool stays in place (donated, never copied).

Lowering for CUDA runs Pallas' Triton and Mosaic GPU pipelines up to the kernels' MLIR, layout inference
and shared-memory accounting included (where the Mosaic kernel failed at 16/32-token pages); it does not
run ptxas. Lowering for TPU emits the Mosaic TPU module; Mosaic's own compile runs only on a TPU host.
``supports`` must be honest: every shape it takes lowers.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AbstractDevice, AbstractMesh, use_abstract_mesh

import kernels_pallas
from hkv_jax.engine import Engine
from hkv_jax.engine.runner import DECODE_STEPS, STEP
from hkv_jax.engine.step_messages import StepPlan
from hkv_jax.models.hf_config import layers_from_hf_config, text_config
from hkv_jax.models.presets import preset_names, resolve_model
from hkv_jax.models.tiny import TinyConfig, TinyLM
from hkv_jax.planner import plan
from hkv_jax.program_audit import PoolAudit, audit_pool
from hkv_jax.spec import AttentionSpec
from kernels_pallas import kv_write_portable, paged_attention_mgpu, paged_attention_portable, paged_attention_tpu
from kernels_pallas.key_finish import KeyFinish, rope_frequencies
from kernels_pallas.reference import AttentionParams

# One worker runs this module's tests in a row and keeps their compiled programs (docs/testing.md).
pytestmark = pytest.mark.xdist_group("test_lowering")

H200 = AbstractMesh((1,), ("x",), abstract_device=AbstractDevice(device_kind="NVIDIA H200", num_cores=132,
                                                                 platform="gpu"))
TPU = AbstractMesh((1,), ("x",), abstract_device=AbstractDevice(device_kind="TPU v5p", num_cores=None,
                                                               platform="tpu"))
sd = jax.ShapeDtypeStruct
# Tables of 300 columns (4,800 tokens at 16 per block): longer than one TMA copy moves (256 entries).
T, S, MAX_BLOCKS, N = 64, 8, 300, 1001  # tokens, sequences, table width, pool (odd: nothing is a power of 2)


def lower_for(mesh: AbstractMesh, fn, *args) -> str:
    """StableHLO of ``fn`` lowered for the abstract mesh's platform."""
    platform = "cuda" if mesh.abstract_device.platform == "gpu" else "tpu"
    with use_abstract_mesh(mesh):
        return jax.jit(fn).trace(*args).lower(lowering_platforms=(platform,)).as_text()


def planned_shapes() -> dict[tuple[int, int, int, int], list[str]]:
    """(query heads, kv heads, head size, block size) of every attention group of every preset under both
    policies, with who plans it."""
    shapes: dict[tuple[int, int, int, int], list[str]] = {}
    for name in preset_names():
        if name.startswith("tiny-"):  # head size 32: the interpret-mode tests' sizes
            continue
        cfg = resolve_model(name)[1]
        hq = text_config(cfg)["num_attention_heads"]
        for policy in ("vllm", "min-waste"):
            config = plan(layers_from_hf_config(cfg, dtype="bfloat16"), block_size=16, policy=policy, num_blocks=N)
            for g in config.groups:
                if isinstance(g.spec, AttentionSpec):
                    key = (hq, g.spec.num_kv_heads, g.spec.head_size, g.block_size)
                    shapes.setdefault(key, []).append(f"{name}/{policy}")
    return shapes


SHAPES = planned_shapes()


def test_the_presets_plan_the_shapes_that_broke_the_kernels():
    blocks = {bs for _, _, _, bs in SHAPES}
    assert {16, 80, 528, 544} <= blocks  # Mamba hybrids under the vllm policy: pages of 80/528/544 tokens
    assert any(hq // hkv == 5 for hq, hkv, _, _ in SHAPES)  # Llama 4 Scout: GQA group 5


@pytest.mark.parametrize("shape", sorted(SHAPES), ids=lambda s: "hq{}-hkv{}-d{}-bs{}".format(*s))
def test_every_planned_shape_lowers_with_the_kernel_auto_picks_on_hopper(shape):
    hq, hkv, d, bs = shape
    q, pages = sd((T, hq, d), jnp.bfloat16), sd((N, 2, hkv, bs, d), jnp.bfloat16)
    rest = (sd((S, MAX_BLOCKS), jnp.int32), sd((S + 1,), jnp.int32), sd((S,), jnp.int32))
    sinks = sd((hq,), jnp.float32)
    with use_abstract_mesh(H200):  # what auto resolves to when lowering for an H200
        chosen = kernels_pallas.choose("auto", pages.shape, pages.dtype, hq, MAX_BLOCKS)
    # Every planned shape takes the Hopper kernel but Llama 4's group of 5 (64 query rows per warpgroup) and
    # Gemma 4's full layers (head size 512: their tiles outgrow its shared memory), which take the portable one.
    hopper = 64 % (hq // hkv) == 0 and d <= 256
    assert chosen == ("mosaic_gpu" if hopper else "triton"), SHAPES[shape]
    if d == 512:
        assert "shared memory" in paged_attention_mgpu.supports(pages.dtype, pages.shape, pages.dtype, hq, MAX_BLOCKS)
    params = AttentionParams(sliding_window=128, soft_cap=30.0)
    for impl in ("mosaic_gpu", "triton"):
        if (paged_attention_mgpu.supports(pages.dtype, pages.shape, pages.dtype, hq, MAX_BLOCKS)
                if impl == "mosaic_gpu" else paged_attention_portable.supports(pages.shape, hq)):
            def attend(q, p, bt, qsl, lens, sk):
                return kernels_pallas.paged_attention(q, p, bt, qsl, lens, params, sk, impl=impl)
            text = lower_for(H200, attend, q, pages, *rest, sinks)
            assert "mosaic_gpu" in text or "triton" in text
    if hopper:  # the prefill form too: two warpgroups a program (they fit for every Hopper shape in bf16)
        def wide(q, p, bt, qsl, lens, sk):
            return paged_attention_mgpu.paged_attention(q, p, bt, qsl, lens, params, sk, warpgroups=2)
        assert "mosaic_gpu" in lower_for(H200, wide, q, pages, *rest, sinks)
    assert kv_write_portable.supports(pages.shape)
    k = sd((T, hkv, d), jnp.bfloat16)
    text = lower_for(H200, lambda p, k, s: kernels_pallas.kv_write(p, k, k, s, impl="triton"), pages, k,
                          sd((T,), jnp.int32))
    assert "triton" in text

    def finished(p, k, s, positions, weight):  # raw keys normed and rotated in the write (Gemma's K)
        finish = KeyFinish(positions, weight, rope_frequencies(d, 10_000.0), norm_offset=1.0)
        return kernels_pallas.kv_write(p, k, k, s, k_finish=finish, impl="triton")
    assert "triton" in lower_for(H200, finished, pages, k, sd((T,), jnp.int32), sd((T,), jnp.int32),
                                 sd((d,), jnp.float32))


@pytest.mark.parametrize("with_sinks", [False, True])
def test_a_split_decode_lowers_with_its_combine_as_a_triton_kernel(with_sinks):
    """One decode token over a 4k-token table splits over the context on an H200; the runs' combine (with the
    sinks, and the model's padding row: ``out_rows``) lowers as one Pallas Triton kernel."""
    q, pages = sd((1, 8, 128), jnp.bfloat16), sd((300, 2, 2, 16, 128), jnp.bfloat16)
    assert paged_attention_mgpu.launch(1, 1, 8, pages.shape, pages.dtype, 256)[1] > 1

    def decode(q, p, bt, qsl, lens, *sinks):
        return kernels_pallas.paged_attention(q, p, bt, qsl, lens, AttentionParams(), *sinks, impl="mosaic_gpu",
                                              out_rows=2)
    text = lower_for(H200, decode, q, pages, sd((1, 256), jnp.int32), sd((2,), jnp.int32), sd((1,), jnp.int32),
                     *([sd((8,), jnp.float32)] if with_sinks else []))
    assert "hkv_split_combine" in text


@pytest.mark.parametrize("shape", sorted(SHAPES), ids=lambda s: "hq{}-hkv{}-d{}-bs{}".format(*s))
def test_every_planned_shape_lowers_for_tpu_where_the_tpu_kernel_takes_it(shape):
    hq, hkv, d, bs = shape
    q, pages = sd((T, hq, d), jnp.bfloat16), sd((N, 2, hkv, bs, d), jnp.bfloat16)
    rest = (sd((S, MAX_BLOCKS), jnp.int32), sd((S + 1,), jnp.int32), sd((S,), jnp.int32))
    why = paged_attention_tpu.supports(pages.shape, pages.dtype, hq).reason
    with use_abstract_mesh(TPU):
        chosen = kernels_pallas.choose("auto", pages.shape, pages.dtype, hq, MAX_BLOCKS)
    assert chosen == ("blocked" if why else "tpu"), (why, SHAPES[shape])
    assert (why is None) == (d % 128 == 0)  # every planned block size is a multiple of 16
    params = AttentionParams(chunk_size=8192, soft_cap=30.0)
    def attend(q, p, bt, qsl, lens, sk):
        return kernels_pallas.paged_attention(q, p, bt, qsl, lens, params, sk)
    text = lower_for(TPU, attend, q, pages, *rest, sd((hq,), jnp.float32))
    assert ("tpu_custom_call" in text) == (why is None)


def test_a_lone_decode_splits_its_context_over_the_h200s_sms_and_lowers():
    """One sequence's decode has Hkv programs without a split: ``auto`` splits its keys so that the programs
    fill the 132 SMs (capped by the 64-key tiles an item can reach and MAX_SPLITS); a batch of 64 fills
    them alone."""
    with use_abstract_mesh(H200):
        assert paged_attention_mgpu.sm_count() == 132
        assert paged_attention_mgpu.default_splits(1, 8, 32768) == 16
        assert paged_attention_mgpu.default_splits(1, 1, 32768) == paged_attention_mgpu.MAX_SPLITS
        assert paged_attention_mgpu.default_splits(1, 8, 128) == 2   # two 64-key tiles
        assert paged_attention_mgpu.default_splits(64, 8, 32768) == 1
        # Gemma 3 at 32k: a 512-key window's item reaches at most 9 tiles, so it splits 9 ways, not 32
        # (MAX_SPLITS, its full-attention layers'); a chunk bounds it the same way.
        gemma = (N, 2, 1, 16, 256)

        def splits(params, blocks=2048, tokens=1):
            return paged_attention_mgpu.launch(tokens, 1, 4, gemma, jnp.bfloat16, blocks, params=params)[1]
        assert splits(AttentionParams()) == paged_attention_mgpu.MAX_SPLITS
        assert splits(AttentionParams(sliding_window=512)) == 9
        assert splits(AttentionParams(sliding_window=512), tokens=16) == 10   # 16 query rows an item
        assert splits(AttentionParams(chunk_size=256)) == 5
        assert splits(AttentionParams(sliding_window=4096), blocks=16) == 4      # the table's 256 keys
    params = AttentionParams(sliding_window=128, soft_cap=30.0)
    q, pages = sd((1, 8, 128), jnp.bfloat16), sd((N, 2, 8, 16, 128), jnp.bfloat16)
    rest = (sd((1, MAX_BLOCKS), jnp.int32), sd((2,), jnp.int32), sd((1,), jnp.int32), sd((8,), jnp.float32))
    text = lower_for(H200, lambda *a: kernels_pallas.paged_attention(*a[:5], params, a[5]), q, pages, *rest)
    assert "mosaic_gpu" in text


def test_prefill_batches_take_two_warpgroups_a_program_and_decode_batches_one(monkeypatch):
    """``default_warpgroups``: 2 where the sequences average enough query tokens to fill 128-row items
    (``128 / G`` tokens), two fit in shared memory and their programs (context split) keep 90% of the SMs
    busy, else 1; the wrapper refuses what does not fit."""
    mgpu, bf16, fp8 = paged_attention_mgpu, jnp.bfloat16, jnp.float8_e4m3fn
    llama = (N, 2, 8, 16, 128)  # 32 query heads: G = 4, 32 tokens an item

    def pick(tokens, seqs, shape=llama, dtype=bf16, hq=32, blocks=2048):
        return mgpu.default_warpgroups(tokens, seqs, hq, shape, dtype, blocks, sms=132)
    assert pick(8 * 256, 8) == 2        # prefill chunks of 256 tokens at 32k: 72 items x 8 heads
    assert pick(64, 64) == 1            # a decode batch
    assert pick(256, 1) == 1            # one chunk: 9 items x 8 heads fill 72 of 132 SMs; 17 x 8 fill them
    assert pick(16 * 32, 16) == 2       # 16 sequences of 32 tokens: one 128-row item each, 256 programs
    assert pick(16 * 31, 16) == 1       # 31 tokens each: short of a 128-row item
    gemma = (N, 2, 1, 16, 256)          # Gemma 3 270M: 4 query heads, one KV head of 256
    assert pick(512, 1, gemma, hq=4, blocks=300) == 2        # 17 items, each split 7 ways
    assert pick(512, 1, gemma, fp8, hq=4, blocks=300) == 1   # fp8: each warpgroup's bf16 copies outgrow it
    assert mgpu.smem_bytes(256, 300, 1, 2) > mgpu.SMEM_BYTES >= mgpu.smem_bytes(256, 300, 1, 1)
    # HKV_MOSAIC_WARPGROUPS=1 (read at import) keeps one everywhere; another value is refused.
    monkeypatch.setenv("HKV_MOSAIC_WARPGROUPS", "1")
    monkeypatch.setattr(mgpu, "MAX_WARPGROUPS", mgpu._max_warpgroups())
    assert pick(8 * 256, 8) == 1
    monkeypatch.setenv("HKV_MOSAIC_WARPGROUPS", "4")
    with pytest.raises(ValueError, match="HKV_MOSAIC_WARPGROUPS must be 1 or 2"):
        mgpu._max_warpgroups()
    monkeypatch.undo()
    q, pages = jnp.zeros((64, 4, 256), jnp.bfloat16), jnp.zeros((9, 2, 1, 16, 256), jnp.float8_e4m3fn)
    with pytest.raises(ValueError, match="two warpgroups"):
        mgpu.paged_attention(q, pages, jnp.zeros((2, 300), jnp.int32), jnp.array([0, 32, 64]),
                             jnp.array([32, 32]), AttentionParams(), warpgroups=2)
    with pytest.raises(ValueError, match="warpgroups must be 1 or 2"):
        mgpu.paged_attention(q, pages, jnp.zeros((2, 8), jnp.int32), jnp.array([0, 32, 64]),
                             jnp.array([32, 32]), AttentionParams(), warpgroups=3)


@pytest.mark.parametrize("warpgroups,dtype", [(1, jnp.bfloat16), (2, jnp.bfloat16), (1, jnp.float8_e4m3fn)])
def test_the_widest_table_supports_takes_lowers_within_shared_memory(warpgroups, dtype):
    """``smem_bytes`` bounds Mosaic GPU's own count (alignment included), whose lowering refuses a kernel past
    an H100/H200's 227 KiB: at head size 256, the widest table that fits by our count lowers."""
    mgpu = paged_attention_mgpu
    itemsize = jnp.dtype(dtype).itemsize
    width = max(w for w in range(64, 16385, 64) if mgpu.smem_bytes(256, w, itemsize, warpgroups) <= mgpu.SMEM_BYTES)
    assert mgpu.smem_bytes(256, width + 64, itemsize, warpgroups) > mgpu.SMEM_BYTES
    args = (sd((64, 4, 256), jnp.bfloat16), sd((N, 2, 1, 16, 256), dtype), sd((2, width), jnp.int32),
            sd((3,), jnp.int32), sd((2,), jnp.int32))
    text = lower_for(H200, lambda *a: mgpu.paged_attention(*a, AttentionParams(), splits=1, warpgroups=warpgroups),
                     *args)
    assert "mosaic_gpu" in text


@pytest.mark.parametrize("hq,hkv,d", [(4, 1, 256), (32, 8, 128)])  # Gemma 3 270M; a Llama-3.1-8B-like model
def test_fp8_pages_lower_with_the_hopper_kernel(hq, hkv, d):
    """On an H200 ``auto`` gives fp8 pages (bf16 queries) to the Mosaic GPU kernel, which lowers with its
    fp8-to-bf16 tiles: a prefill batch (whole runs) and a lone decode (its context split)."""
    pages = sd((N, 2, hkv, 16, d), jnp.float8_e4m3fn)
    with use_abstract_mesh(H200):
        assert kernels_pallas.choose("auto", pages.shape, pages.dtype, hq, MAX_BLOCKS) == "mosaic_gpu"
    params = AttentionParams(sliding_window=128, soft_cap=30.0)
    for tokens, seqs in ((T, S), (1, 1)):
        args = (sd((tokens, hq, d), jnp.bfloat16), pages, sd((seqs, MAX_BLOCKS), jnp.int32), sd((seqs + 1,), jnp.int32),
                sd((seqs,), jnp.int32))
        text = lower_for(H200, lambda *a: kernels_pallas.paged_attention(*a, params), *args)
        assert "mosaic_gpu" in text


def test_supported_names_what_the_kernels_cannot_take():
    assert "head_size 96" in paged_attention_portable.supports((N, 2, 4, 16, 96), 8)
    assert "head_size 96" in kv_write_portable.supports((N, 2, 4, 16, 96))
    assert "shared memory" in paged_attention_mgpu.supports(jnp.bfloat16, (N, 2, 1, 16, 512), jnp.bfloat16, 4)
    assert "block_size 24" in paged_attention_mgpu.supports(jnp.bfloat16, (N, 2, 1, 24, 128), jnp.bfloat16, 4)
    # auto falls through to the kernel that takes the shape: head size 96 -> blocked (pure jnp).
    with use_abstract_mesh(H200):
        assert kernels_pallas.choose("auto", (N, 2, 4, 16, 96), jnp.bfloat16, 8) == "blocked"
        assert kernels_pallas.choose("auto", (N, 2, 1, 24, 128), jnp.bfloat16, 4) == "triton"
    assert "head_size 64" in paged_attention_tpu.supports((N, 2, 4, 16, 64), jnp.bfloat16, 8)
    assert "block_size 8" in paged_attention_tpu.supports((N, 2, 4, 8, 128), jnp.bfloat16, 8)
    assert paged_attention_tpu.supports((N, 2, 4, 8, 128), jnp.float32, 8)
    with pytest.raises(ValueError, match="head_size 96"):
        paged_attention_portable.paged_attention(
            jnp.zeros((2, 8, 96)), jnp.zeros((3, 2, 4, 16, 96)), jnp.zeros((1, 2), jnp.int32),
            jnp.array([0, 2]), jnp.array([2]), AttentionParams())


def test_auto_picks_the_kernel_for_the_abstract_device():
    with use_abstract_mesh(H200):
        assert kernels_pallas.default_impl() == "mosaic_gpu"
    a100 = AbstractMesh((1,), ("x",), abstract_device=AbstractDevice(device_kind="NVIDIA A100-SXM4-80GB",
                                                                     num_cores=108, platform="gpu"))
    with use_abstract_mesh(a100):
        assert kernels_pallas.default_impl() == "triton"
    with use_abstract_mesh(TPU):
        assert kernels_pallas.default_impl() == "tpu"


@pytest.mark.parametrize("mesh,kernels", [(H200, ("mosaic_gpu", "triton")), (TPU, ("tpu_custom_call",))],
                         ids=("cuda", "tpu"))
def test_the_engine_programs_lower_with_the_accelerator_kernels_and_keep_the_pool_in_place(mesh, kernels):
    """tiny-gemma3 (sliding window + full) with a bf16 cache and head size 128, so that the Hopper and the
    TPU kernels take it (f32 queries are cast to bf16 for the Hopper kernel), through ``impl="auto"``: on
    an H200 Mosaic GPU attention and the Triton KV write in the step program, on a TPU the Mosaic TPU
    attention. Both decode programs the runner jits (one step, several steps in a ``while_loop``) donate
    the KV pool and alias it to an output, and no op outside the kernels and the in-place writes copies,
    converts or re-lays-out a pool-sized tensor (``audit_pool``; ``benchmarks/gpu_projection.py`` runs the
    same audit at real sizes). Lowering a program costs about ten seconds here."""
    cfg = dict(resolve_model("tiny-gemma3")[1], head_dim=128)
    model = TinyLM(TinyConfig.from_hf(cfg, kv_dtype="bfloat16"), nnx.Rngs(0))
    eng = Engine(model, num_blocks=37, block_size=16, max_requests=4, max_model_len=64, token_budget=16,
                 token_buckets=(16,), impl="auto")
    plan_ = StepPlan.pack(np.full(4, -1), np.zeros(4))
    def abstract(tree):
        return jax.tree.map(lambda x: sd(jnp.shape(x), jnp.result_type(x)), tree)
    args = abstract(eng.params), abstract(eng.state), abstract(plan_)
    pool = eng.state.cache.buffers
    platform = "cuda" if mesh.abstract_device.platform == "gpu" else "tpu"
    with use_abstract_mesh(mesh):
        programs = {"step": STEP.trace(eng.statics[0], *args),
                    "decode_steps": DECODE_STEPS.trace(eng.statics[0], 4, *args, sd((4,), jnp.int32),
                                                       sd((2,), jnp.int32))}
        texts = {name: t.lower(lowering_platforms=(platform,)).as_text() for name, t in programs.items()}
    assert all(k in texts["step"] for k in kernels), kernels
    for name, text in texts.items():
        found = audit_pool(text, 37, pool[0].nbytes, len(pool))
        assert found.aliased_pool and found.pool_copies == 0, (name, found)


def test_the_pool_audit_sees_a_lost_donation_and_a_pool_copy():
    """``audit_pool`` on programs that waste the pool: not donated (the program would copy it), converted to
    another dtype and transposed; and on one that only writes a row in place."""
    pool = sd((37, 2, 16), jnp.bfloat16)

    def text(fn, donate):
        return jax.jit(fn, donate_argnums=(0,) if donate else ()).trace(pool).lower().as_text()

    def write(p):
        return p.at[3].set(1.0)

    bytes_ = 37 * 2 * 16 * 2
    assert audit_pool(text(write, True), 37, bytes_, 1) == PoolAudit(True, 0, [])
    assert not audit_pool(text(write, False), 37, bytes_, 1).aliased_pool
    wasteful = audit_pool(text(lambda p: (p.astype(jnp.float32) * 2).astype(p.dtype), True), 37, bytes_, 1)
    assert wasteful.aliased_pool and wasteful.pool_copies == 4  # two converts, the product and its broadcast 2
    assert wasteful.pool_ops == ["stablehlo.broadcast_in_dim", "stablehlo.convert", "stablehlo.multiply"]
    assert audit_pool(text(lambda p: p.transpose(0, 2, 1).reshape(37, 2, 16), True), 37, bytes_, 1).pool_ops == [
        "stablehlo.transpose"]
