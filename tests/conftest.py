"""Shared test helpers: where the team's shared folder (traces, tools) lives."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

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
