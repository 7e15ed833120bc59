"""Serving, in vLLM v1's layering: ``Engine`` (``engine.py``) in front of a ``Scheduler`` (host only), a
``ModelRunner`` (the jitted step programs, ``step.py``) and an ``OutputProcessor``.

The names below load on first use, so that the host-only modules (``scheduler``, ``request``,
``sampling_params``, ``changes``) import without jax.
"""

from __future__ import annotations

import importlib

_HOMES = {
    "EngineConfig": "config", "Engine": "engine", "FinishReason": "request", "Request": "request",
    "RequestStatus": "request", "check_stop": "request", "sample": "sampler", "SamplingParams": "sampling_params",
    "Scheduler": "scheduler", "SchedulerOutput": "changes", "DraftModelSpec": "speculative",
    "NgramSpec": "speculative", "KVUsage": "stats", "HostUsage": "stats", "Stats": "stats", "EngineState": "step",
    "StepOutput": "step_messages", "StepPlan": "step_messages", "StepReport": "step_messages",
}
__all__ = sorted(_HOMES)


def __getattr__(name: str):
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_HOMES[name]}"), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
