"""Serving, in vLLM v1's layering: ``Engine`` (``engine.py``) in front of a ``Scheduler`` (host only), a
``ModelRunner`` (the jitted step programs, ``step.py``) and an ``OutputProcessor``."""

from hkv_jax.engine.config import EngineConfig
from hkv_jax.engine.engine import Engine
from hkv_jax.engine.request import FinishReason, Request, RequestStatus, check_stop
from hkv_jax.engine.sampler import sample
from hkv_jax.engine.sampling_params import SamplingParams
from hkv_jax.engine.scheduler import Scheduler, SchedulerOutput
from hkv_jax.engine.speculative import DraftModelSpec, NgramSpec
from hkv_jax.engine.stats import KVUsage, Stats
from hkv_jax.engine.step import EngineState, StepOutput, StepPlan, StepReport, step

__all__ = ["DraftModelSpec", "Engine", "EngineConfig", "EngineState", "FinishReason", "KVUsage", "NgramSpec",
           "Request", "RequestStatus", "SamplingParams", "Scheduler", "SchedulerOutput", "Stats", "StepOutput",
           "StepPlan", "StepReport", "check_stop", "sample", "step"]
