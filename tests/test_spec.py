import pytest

from hkv_jax.spec import (
    ChunkedLocalSpec,
    FullAttentionSpec,
    KVSharingSpec,
    MambaSpec,
    SlidingWindowSpec,
    layer_from_dict,
    layers_from_trace,
)


def test_bytes_per_token_and_page():
    s = FullAttentionSpec(name="l0", num_kv_heads=8, head_size=128, dtype="bfloat16")
    assert s.bytes_per_token == 2 * 8 * 128 * 2
    assert s.page_size_bytes(16) == 16 * 4096
    m = MambaSpec(name="m", shapes=[[3, 64], [4, 16, 16]], dtypes=["bfloat16", "float32"])
    assert m.state_bytes == 3 * 64 * 2 + 4 * 16 * 16 * 4
    assert m.page_size_bytes(16) == m.page_size_bytes(1024) == m.state_bytes


def test_name_does_not_take_part_in_equality():
    a = SlidingWindowSpec(name="a", num_kv_heads=4, head_size=64, sliding_window=128)
    b = SlidingWindowSpec(name="b", num_kv_heads=4, head_size=64, sliding_window=128)
    c = SlidingWindowSpec(name="c", num_kv_heads=4, head_size=64, sliding_window=64)
    assert a == b and hash(a) == hash(b) and a != c
    assert a != FullAttentionSpec(name="a", num_kv_heads=4, head_size=64)


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: SlidingWindowSpec(name="layer7", num_kv_heads=4, head_size=64, sliding_window=0), "sliding_window"),
        (lambda: FullAttentionSpec(name="layer7", num_kv_heads=-2, head_size=64), "num_kv_heads"),
        (lambda: FullAttentionSpec(name="layer7", num_kv_heads=2, head_size=64, dtype="float128"), "unknown dtype"),
        (lambda: ChunkedLocalSpec(name="layer7", num_kv_heads=2, head_size=64, attention_chunk_size=0), "chunk"),
        (lambda: MambaSpec(name="layer7", shapes=[[3, 4]], dtypes=["bfloat16", "bfloat16"]), "dtypes"),
        (lambda: MambaSpec(name="layer7", shapes=[[3, 0]], dtypes=["bfloat16"]), "dimension"),
        (lambda: KVSharingSpec(name="layer7", target="layer7"), "own"),
    ],
)
def test_bad_fields_raise_value_error_naming_the_layer(make, message):
    with pytest.raises(ValueError, match=message) as info:
        make()
    assert "layer7" in str(info.value)


def test_layer_from_dict_errors_name_the_layer():
    with pytest.raises(ValueError, match="'x'.*unknown layer type"):
        layer_from_dict({"name": "x", "type": "rnn"})
    with pytest.raises(ValueError, match="'y'.*missing field 'sliding_window'"):
        layer_from_dict({"name": "y", "type": "sliding_window", "num_kv_heads": 1, "head_size": 8})


def test_layers_from_trace_pattern_and_round_trip():
    trace = {"layer_pattern": {"num_layers": 3, "pattern": [
        {"type": "full", "num_kv_heads": 2, "head_size": 8, "dtype": "float16"},
        {"type": "sliding_window", "sliding_window": 32, "num_kv_heads": 2, "head_size": 8, "dtype": "float16"}]}}
    layers = layers_from_trace(trace)
    assert [l.name for l in layers] == [f"model.layers.{i}.attn" for i in range(3)]
    assert [l.kind for l in layers] == ["full", "sliding_window", "full"]
    assert all(layer_from_dict(l.to_dict()) == l for l in layers)


def test_each_layer_type_states_its_rules_and_the_allocator_finds_its_manager():
    """The rules a layer type carries (spec.py) and its allocator manager (``managers.manager``), against the
    plain-Python model's own statement of the tokens each type skips (``pymodel.skipped_tokens``)."""
    import jax.numpy as jnp

    from hkv_jax.allocator import pymodel
    from hkv_jax.allocator.managers import manager
    from hkv_jax.spec import ChunkedLocalSpec, FullAttentionSpec, KVSharingSpec, MambaSpec, SlidingWindowSpec

    full = FullAttentionSpec(num_kv_heads=2, head_size=8)
    window = SlidingWindowSpec(num_kv_heads=2, head_size=8, sliding_window=10)
    chunk = ChunkedLocalSpec(num_kv_heads=2, head_size=8, attention_chunk_size=12)
    mamba = MambaSpec(shapes=((3, 4),), dtypes=("float32",))
    sharing = KVSharingSpec(name="b", target="a")
    assert [(s.owns_kv, s.paged_kv, s.recurrent, s.keeps_every_token) for s in (full, window, chunk, mamba, sharing)] \
        == [(True, True, False, True), (True, True, False, False), (True, True, False, False),
            (True, False, True, False), (False, False, False, False)]
    assert [(s.window, s.chunk) for s in (full, window, chunk, mamba)] == [(None, None), (10, None), (None, 12),
                                                                          (None, None)]
    # Blocks a request of 100 tokens holds with 4-token blocks (Mamba: its state's 3 pages).
    assert [s.blocks_held(100, 4, 3) for s in (full, window, chunk, mamba)] == [25, 4, 4, 3]
    assert window.as_full() == FullAttentionSpec(num_kv_heads=2, head_size=8) and mamba.as_full() is mamba
    for spec in (full, window, chunk, mamba):
        rules = manager(spec)
        for n in (1, 9, 10, 11, 24, 25, 100):
            assert int(rules.skipped_tokens(spec, jnp.int32(n))) == pymodel.skipped_tokens(spec, n), (spec, n)
        assert rules.windowed == (spec.window is not None or spec.chunk is not None)
    with pytest.raises(ValueError, match="no allocator rules for layer type KVSharingSpec"):
        manager(sharing)


@pytest.mark.parametrize("spec", [SlidingWindowSpec(name="l", num_kv_heads=1, head_size=8, sliding_window=w)
                                  for w in (10, 16, 17)]
                         + [ChunkedLocalSpec(name="l", num_kv_heads=1, head_size=8, attention_chunk_size=a)
                            for a in (12, 16)]
                         + [FullAttentionSpec(name="l", num_kv_heads=1, head_size=8)], ids=repr)
def test_blocks_held_bounds_the_blocks_a_request_holds_during_a_step(spec):
    """``blocks_held(n, bs, chunk=c)`` against the Python allocator: an 80-token prompt (beside a full
    attention layer) prefilled in steps of ``c`` tokens after a first step of every length up to a block (so
    that every alignment occurs) never holds more of the layer's blocks during a step than that step's bound;
    and a sliding window's bound is reached where the window, not the tokens so far, sets it."""
    from hkv_jax.allocator.pymodel import PyAllocator
    from hkv_jax.planner import plan

    n = 80
    for bs in (4, 16):
        full = FullAttentionSpec(name="f", num_kv_heads=1, head_size=8)
        cfg = plan([full, spec] if spec.window or spec.chunk else [spec], block_size=bs, num_blocks=200)
        g = next(i for i, group in enumerate(cfg.groups) if group.layer_names == ("l",))
        for c in (1, 2, 3, 8, 16):
            reached = False
            for first in range(1, bs + 1):
                alloc = PyAllocator(cfg, max_model_len=n)
                alloc.add("r", list(range(1, n + 1)))
                k = first
                while alloc.requests["r"].num_computed < n:
                    res = alloc.schedule("r", k, None)  # a local chunk's earlier blocks count as hit: fewer new
                    assert res["ok"]
                    k, done = res["num_new_tokens"], res["num_computed_tokens"]
                    held = sum(b != 0 for b in alloc.requests["r"].tables[g])
                    bound = spec.blocks_held(done, bs, chunk=k)
                    assert held <= bound, (bs, c, first, done)
                    reached |= k == c and held == bound < -(-done // bs)
                    k = c
            assert reached or spec.window is None, (bs, c)
