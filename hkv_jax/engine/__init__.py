"""Serving: a host-side scheduling policy (``engine.py``) around one jitted step (``step.py``)."""

from hkv_jax.engine.engine import Engine, Request, Stats
from hkv_jax.engine.step import EngineState, StepOutput, StepPlan, sample, step

__all__ = ["Engine", "EngineState", "Request", "Stats", "StepOutput", "StepPlan", "sample", "step"]
