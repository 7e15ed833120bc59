"""The allocator's operations as pure functions ``state -> (state, result)``; jit them with ``layout`` static.

One namespace over vLLM's layering (each layer a module of its own):

- ``requests``: a request's life (``add_request``/``admit_batch``, ``append_token``/``append_batch``,
  ``free``/``preempt``/``release_batch``, ``fork``, ``new_step``, ``reset_prefix_cache``);
- ``coordinator``: one request across every group (``lookup``, ``schedule``, ``schedule_batch``,
  ``accept_drafts``);
- ``managers``: the per-type rules the others apply;
- ``prefill`` and ``decode``: the batched schedules (``prefill_batch``, ``decode_step``, and its idle
  path alone: ``idle_decode``, ``count_if_idle``), each equal to ``schedule_batch`` on its batch (tested).
"""

from hkv_jax.allocator.coordinator import ScheduleResult, accept_drafts, lookup, schedule, schedule_batch
from hkv_jax.allocator.decode import count_if_idle, decode_step, idle_decode
from hkv_jax.allocator.prefill import prefill_batch
from hkv_jax.allocator.requests import (
                                        add_batch,
                                        add_request,
                                        admit_batch,
                                        append_batch,
                                        append_token,
                                        fork,
                                        free,
                                        new_step,
                                        preempt,
                                        release_batch,
                                        reset_prefix_cache,
)

__all__ = [
    "ScheduleResult",
    "accept_drafts",
    "add_batch",
    "add_request",
    "admit_batch",
    "append_batch",
    "append_token",
    "count_if_idle",
    "decode_step",
    "fork",
    "free",
    "idle_decode",
    "lookup",
    "new_step",
    "preempt",
    "prefill_batch",
    "release_batch",
    "reset_prefix_cache",
    "schedule",
    "schedule_batch",
]
