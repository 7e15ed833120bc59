"""Shared test helpers: where the team's shared folder (traces, tools) lives."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from hkv_jax.spec import ChunkedLocalSpec, FullAttentionSpec, MambaSpec, SlidingWindowSpec

# The team's shared folder sits beside the checkout (CI lays it there too); HKV_SHARED overrides.
SHARED = Path(os.environ.get("HKV_SHARED") or Path(__file__).resolve().parents[2] / "shared")
TRACES = sorted(p for p in (SHARED / "traces").glob("*.json") if not p.name.endswith(".expected.json"))


def load_trace(path: Path) -> tuple[dict, dict]:
    """(trace, expected result) of a shared trace."""
    return json.loads(path.read_text()), json.loads(path.with_suffix(".expected.json").read_text())


def require_traces() -> None:
    """Fail loudly (not skip) when the shared traces are missing: CI always has them."""
    if not TRACES:
        pytest.fail(f"no shared traces found under {SHARED / 'traces'}")


# Small hybrid models (block size 4 in the tests) for the allocator's property and equivalence tests.
HYBRID_MODELS = {
    "sw+full": [FullAttentionSpec(name="f", num_kv_heads=1, head_size=8),
                SlidingWindowSpec(name="s", num_kv_heads=1, head_size=8, sliding_window=6)],
    "three": [FullAttentionSpec(name="f", num_kv_heads=1, head_size=8),
              SlidingWindowSpec(name="s", num_kv_heads=1, head_size=8, sliding_window=6),
              ChunkedLocalSpec(name="c", num_kv_heads=1, head_size=8, attention_chunk_size=8)],
    "mamba": [FullAttentionSpec(name="f", num_kv_heads=1, head_size=8),
              MambaSpec(name="m", shapes=[[2, 4]], dtypes=["float32"])],
}
