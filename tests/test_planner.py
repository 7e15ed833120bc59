"""The planner against the seed design doc's worked examples and vLLM's groups in the shared traces."""

import pytest
from conftest import TRACES, load_trace, require_traces

from hkv_jax.models import model_layers
from hkv_jax.planner import choose_group_size, plan
from hkv_jax.spec import FullAttentionSpec, KVSharingSpec, MambaSpec, SlidingWindowSpec, layers_from_trace


def full(i, heads=8, head=128):
    return FullAttentionSpec(name=f"full.{i}", num_kv_heads=heads, head_size=head)


def sw(i, window=32, heads=8, head=128):
    return SlidingWindowSpec(name=f"sw.{i}", num_kv_heads=heads, head_size=head, sliding_window=window)


def test_case2_ten_full_twenty_sliding_gives_three_groups_of_ten():
    layers = [full(i) for i in range(10)] + [sw(i) for i in range(20)]
    for policy in ("vllm", "min-waste"):
        cfg = plan(layers, policy=policy, num_blocks=100)
        assert [len(g.layer_names) for g in cfg.groups] == [10, 10, 10]
        assert [g.spec.kind for g in cfg.groups] == ["full", "sliding_window", "sliding_window"]
        assert cfg.padding_layers == 0
        assert cfg.page_size_bytes == 16 * 8 * 128 * 2 * 2
        assert cfg.bytes_per_block == 10 * cfg.page_size_bytes
        # One block id addresses the same slice in every shared tensor: tensor i holds layer i of each group.
        assert cfg.tensors[0].shared_by == ("full.0", "sw.0", "sw.1")


def test_case3_gemma3_27b_vllm_pads_eight_layers():
    layers = model_layers("gemma-3-27b")
    cfg = plan(layers, policy="vllm", num_blocks=100)
    assert len(cfg.groups) == 7
    assert [len(g.layer_names) for g in cfg.groups] == [9, 9, 9, 9, 8, 8, 10]
    assert [int(g.layer_names[0].split(".")[-1]) for g in cfg.groups] == [0, 1, 2, 3, 4, 6, 5]
    assert cfg.padding_layers == 8
    # Strided: sliding group 0 takes every sixth sliding layer.
    sliding = [l.name for l in layers if l.kind == "sliding_window"]
    assert cfg.groups[0].layer_names == tuple(sliding[0::6])


def test_case3_gemma3_27b_min_waste_pads_nothing():
    cfg = plan(model_layers("gemma-3-27b"), policy="min-waste", num_blocks=100)
    assert cfg.padding_layers == 0
    assert cfg.padding_fraction == 0.0
    assert sum(len(g.layer_names) for g in cfg.groups) == 62


def test_gpt_oss_120b_with_one_extra_full_draft_layer():
    base = model_layers("gpt-oss-120b")
    draft = FullAttentionSpec(name="draft.0", num_kv_heads=8, head_size=64)
    layers = list(base) + [draft]
    vllm = plan(layers, policy="vllm", num_blocks=100)
    mw = plan(layers, policy="min-waste", num_blocks=100)
    # 19 full + 18 sliding: 19 < 1.5 x 18, so vLLM 0.33 uses groups of 19 and pads the sliding group by 1.
    assert vllm.padding_layers == 1 and len(vllm.groups) == 2
    assert mw.padding_layers == 0


def test_vllm_group_size_rule():
    assert choose_group_size([52, 10], "vllm") == 10
    assert choose_group_size([19, 18], "vllm") == 19
    assert choose_group_size([29, 20], "vllm") == 29  # 29 < 1.5 x 20 -> largest
    assert choose_group_size([30, 20], "vllm") == 20  # not below 1.5 x -> smallest
    assert choose_group_size([31, 20], "vllm") == 20
    assert choose_group_size([7], "vllm") == 7


def jamba_like(n_layers=16, period=8, offset=4):
    mamba = dict(shapes=[[3, 64], [16, 64, 16]], dtypes=["bfloat16", "bfloat16"])
    return [
        FullAttentionSpec(name=f"l{i}", num_kv_heads=4, head_size=64) if i % period == offset
        else MambaSpec(name=f"l{i}", **mamba)
        for i in range(n_layers)
    ]


def test_case4_mamba_vllm_raises_block_and_pads_mamba_page():
    layers = jamba_like()
    state = layers[0].state_bytes  # 3*64*2 + 16*64*16*2 = 33152 bytes
    per_tok = layers[4].bytes_per_token  # 1024 bytes
    cfg = plan(layers, policy="vllm", num_blocks=64)
    attn = [g for g in cfg.groups if g.spec.kind == "full"][0]
    # Smallest multiple of 16 tokens whose page holds a state: 48 tokens (48 KiB >= 33152 B).
    assert attn.block_size == 48 and cfg.page_size_bytes == 48 * per_tok >= state
    assert all(g.block_size == 48 for g in cfg.groups)
    mamba = [g for g in cfg.groups if g.spec.kind == "mamba"][0]
    assert mamba.blocks_per_state == 1
    assert cfg.group_padding_fraction(mamba) == pytest.approx(1 - state / cfg.page_size_bytes)


def test_case4_mamba_min_waste_keeps_small_blocks_and_spans_states():
    cfg = plan(model_layers("jamba-mini-1.5"), policy="min-waste", num_blocks=64)
    assert all(g.block_size <= 64 for g in cfg.groups)
    mamba = [g for g in cfg.groups if g.spec.kind == "mamba"][0]
    assert mamba.blocks_per_state * cfg.page_size_bytes >= mamba.spec.state_bytes
    assert (mamba.blocks_per_state - 1) * cfg.page_size_bytes < mamba.spec.state_bytes
    for preset in ("qwen3-next-80b-a3b", "granite-4.0-h-small"):
        vllm = plan(model_layers(preset), policy="vllm", num_blocks=64)
        assert vllm.block_size > 256  # what vLLM does: hundreds of tokens per block
        assert plan(model_layers(preset), policy="min-waste", num_blocks=64).block_size == 16


def test_case5_kv_sharing_layers_get_no_memory_and_join_their_targets_group():
    layers = [sw(0), full(0), sw(1), full(1),
              KVSharingSpec(name="s0", target="sw.1"), KVSharingSpec(name="s1", target="full.0")]
    cfg = plan(layers, policy="vllm", num_blocks=10)
    without = plan(layers[:4], policy="vllm", num_blocks=10)
    assert cfg.bytes_per_block == without.bytes_per_block
    assert cfg.group_of_layer("s0") is cfg.group_of_layer("sw.1")
    assert cfg.group_of_layer("s1") is cfg.group_of_layer("full.0")
    assert all("s0" not in t.shared_by and "s1" not in t.shared_by for t in cfg.tensors)


def test_naive_treats_every_attention_layer_as_full():
    cfg = plan(model_layers("gemma-3-27b"), policy="naive", memory_bytes=80 * 2**30)
    assert len(cfg.groups) == 1 and cfg.groups[0].spec.kind == "full"
    hybrid = plan(model_layers("gemma-3-27b"), policy="min-waste", memory_bytes=80 * 2**30)
    assert hybrid.max_concurrent_requests(32768) > 4 * cfg.max_concurrent_requests(32768)


def test_memory_budget_and_bad_input():
    layers = [full(0), sw(0)]
    cfg = plan(layers, memory_bytes=10 * 65536 + 5)  # two groups of one layer: 64 KiB a block
    assert cfg.num_blocks == 10 and cfg.total_bytes <= 10 * 65536 + 5
    with pytest.raises(ValueError, match="at least 2"):
        plan(layers, memory_bytes=100)
    with pytest.raises(ValueError, match="exactly one"):
        plan(layers, memory_bytes=10**9, num_blocks=10)
    with pytest.raises(ValueError, match="policy"):
        plan(layers, policy="best", num_blocks=10)
    with pytest.raises(ValueError, match="target"):
        plan([full(0), KVSharingSpec(name="s", target="nope")], num_blocks=10)
    with pytest.raises(ValueError, match="duplicate"):
        plan([full(0), full(0)], num_blocks=10)


def test_vllm_policy_reproduces_every_trace_grouping():
    require_traces()
    for path in TRACES:
        trace, expected = load_trace(path)
        cfg = plan(layers_from_trace(trace), block_size=trace["block_size"], policy="vllm",
                   num_blocks=trace["num_blocks"])
        want = expected["kv_cache_config"]["groups"]
        assert len(cfg.groups) == len(want), path.name
        for g, w in zip(cfg.groups, want):
            assert sorted(g.all_layer_names) == sorted(w["layer_names"]), path.name
            assert g.block_size == w["block_size"], path.name
        assert cfg.bytes_per_block == expected["kv_cache_config"]["bytes_per_block"], path.name


@pytest.mark.parametrize("preset, sliding, full", [("gemma-4-31b", 16, 32), ("gemma-4-26b-a4b", 16, 32),
                                                   ("gemma-4-e4b", 32, 16)])
def test_vllm_scales_the_block_size_of_the_smaller_page_on_gemma4(preset, sliding, full):
    """vLLM unifies the page size by giving the smaller-page groups proportionally larger blocks: Gemma 4 31B's
    full layers (4 KV heads x 512 against 16 x 256) get 32 tokens, E4B's sliding layers (2 x 256 against
    2 x 512) get 32. Prefix hashes come every gcd tokens, hits in multiples of the lcm."""
    cfg = plan(model_layers(preset), block_size=16, policy="vllm", num_blocks=1000)
    sizes = {g.spec.kind: {x.block_size for x in cfg.groups if x.spec.kind == g.spec.kind} for g in cfg.groups}
    assert sizes == {"sliding_window": {sliding}, "full": {full}}
    assert (cfg.hash_block_size, cfg.scheduler_block_size) == (16, 32)
    assert all(g.spec.page_size_bytes(g.block_size) == cfg.page_size_bytes for g in cfg.groups)
    d = cfg.to_dict()
    assert (d["hash_block_size"], d["scheduler_block_size"]) == (16, 32)
    assert sorted({g["block_size"] for g in d["groups"]}) == [16, 32]



@pytest.mark.parametrize("preset, policy", [("gemma-3-27b", "vllm"), ("jamba-mini-1.5", "vllm"),
                                            ("gemma-4-31b", "vllm"), ("jamba-mini-1.5", "min-waste"),
                                            ("gemma-4-e4b", "min-waste"), ("tiny-gemma4", "min-waste")])
def test_the_plot_draws_every_group_and_hatches_all_padding(preset, policy):
    """``hkv plan --plot`` draws one block of every group, every layer of a slot its layers share; the
    hatched (padding) area, empty slots and padded pages alike, is the plan's padding fraction."""
    from hkv_jax.plot import slot_fill

    cfg = plan(model_layers(preset), block_size=16, policy=policy, num_blocks=1000)
    fill = slot_fill(cfg)
    assert len(fill) == len(cfg.groups) and all(len(col) == cfg.group_size for col in fill)
    assert [sum(map(len, col)) for col in fill] == [len(g.layer_names) for g in cfg.groups]
    hatched = sum(cfg.group_size - sum(map(sum, col)) for col in fill) / (len(fill) * cfg.group_size)
    assert hatched == pytest.approx(cfg.padding_fraction)


@pytest.mark.parametrize("preset, groups", [("gemma-4-31b", 11), ("gemma-4-e4b", 7)])
def test_min_waste_packs_gemma4s_small_pages_instead_of_doubling_their_blocks(preset, groups):
    """min-waste keeps 16 tokens per block for every group (hits on every 16-token boundary, vLLM's: 32), packs
    two of the half-size pages in one slot, pads nothing, and holds at least vLLM's capacity in the same bytes."""
    layers = model_layers(preset)
    ours = plan(layers, block_size=16, policy="min-waste", memory_bytes=80 << 30)
    vllm = plan(layers, block_size=16, policy="vllm", memory_bytes=80 << 30)
    assert {g.block_size for g in ours.groups} == {16} and ours.scheduler_block_size == 16
    assert vllm.scheduler_block_size == 32
    assert {g.layers_per_slot for g in ours.groups} == {1, 2} and len(ours.groups) == groups
    assert ours.padding_fraction == 0 and ours.padding_layers == 0
    assert ours.capacity_tokens >= vllm.capacity_tokens
    assert ours.max_concurrent_requests(8192) >= vllm.max_concurrent_requests(8192)
    # Every layer has its page slot part: the tensors list each layer once.
    names = [n for t in ours.tensors for n in t.shared_by]
    assert sorted(names) == sorted(n for g in ours.groups for n in g.layer_names)


def test_min_waste_keeps_proportional_blocks_where_packing_would_pad():
    """Gemma 4 26B-A4B has 5 full-attention layers: two to a slot leaves one half empty, so min-waste plans as
    vLLM does (no padding either way)."""
    layers = model_layers("gemma-4-26b-a4b")
    ours = plan(layers, block_size=16, policy="min-waste", num_blocks=100)
    assert {g.layers_per_slot for g in ours.groups} == {1} and {g.block_size for g in ours.groups} == {16, 32}
    assert ours.padding_fraction == 0
