"""Functional snapshots of a whole engine: copy, restore, fork, and orbax save/load.

The device state is a value (an ``EngineState`` pytree), so a snapshot is a copy of it (copied because
the step donates the live state) plus a deep copy of the scheduler's bookkeeping. A fork shares its
parent's full blocks through the allocator's ``fork`` (reference counts), nothing copied.
"""

from __future__ import annotations

import copy
import json
from dataclasses import replace
from pathlib import Path

import jax
import jax.numpy as jnp

from hkv_jax.engine.request import Request
from hkv_jax.engine.runner import ModelRunner
from hkv_jax.engine.sampling_params import KNOB
from hkv_jax.engine.scheduler import Scheduler
from hkv_jax.engine.step import EngineState


def snapshot(runner: ModelRunner, scheduler: Scheduler) -> tuple[EngineState, dict]:
    """A copy of the device state and of the scheduler's state."""
    return jax.tree.map(jnp.copy, runner.state), copy.deepcopy(scheduler.state_dict())


def restore(runner: ModelRunner, scheduler: Scheduler, snap: tuple[EngineState, dict]) -> None:
    """Go back to ``snap`` (it stays valid: restoring copies it again)."""
    state, host = snap
    runner.state = jax.tree.map(jnp.copy, state)
    scheduler.load_state_dict(copy.deepcopy(host))


def fork(runner: ModelRunner, scheduler: Scheduler, rid: int, seed: int | None) -> int:
    """A new running request continuing running request ``rid``, sharing its full blocks, sampling with
    ``seed`` (``None``: the engine's key); returns its id. ``ValueError`` for a model with Mamba layers
    or a request not running, ``RuntimeError`` without a free request slot."""
    seed = KNOB["seed"].check(seed)
    parent = scheduler.book_pending()[rid]
    layout = runner.layout
    if any(layout.is_mamba(g) for g in range(layout.num_groups)):
        raise ValueError("fork needs an attention-only model: a Mamba state cannot be shared part-way")
    if rid not in scheduler.running:
        raise ValueError(f"request {rid} is not running")
    slot = scheduler.free_slot()
    if slot < 0:
        raise RuntimeError("no free request slot to fork into")
    runner.fork(parent.slot, slot)
    return scheduler.add_fork(rid, slot, replace(parent.params, seed=seed),
                              parent.computed // layout.scheduler_block_size * layout.scheduler_block_size)


def save(runner: ModelRunner, scheduler: Scheduler, path: str | Path) -> None:
    """Write the device state (orbax) and the scheduler's state (JSON) under ``path``."""
    import orbax.checkpoint as ocp

    path = Path(path).absolute()
    with ocp.StandardCheckpointer() as ckpt:
        ckpt.save(path / "state", runner.state)
    host = scheduler.state_dict()
    host = {**host, "requests": {k: r.to_dict() for k, r in host["requests"].items()}}
    (path / "host.json").write_text(json.dumps(host))


def load(runner: ModelRunner, scheduler: Scheduler, path: str | Path) -> None:
    """Read what ``save`` wrote (into an engine built with the same model and sizes)."""
    import orbax.checkpoint as ocp

    path = Path(path).absolute()
    host = runner.state.host
    if host is None or host.memory_kind is None:
        target = jax.tree.map(jnp.zeros_like, runner.state)
    else:  # orbax reads host pages into device memory (and ``zeros_like`` makes none in host memory): moved after
        target = jax.tree.map(jnp.zeros_like, replace(runner.state, host=replace(host, buffers=())))
        target = replace(target, host=replace(target.host, buffers=tuple(jnp.zeros(b.shape, b.dtype)
                                                                         for b in host.buffers)))
    with ocp.StandardCheckpointer() as ckpt:
        state = ckpt.restore(path / "state", target)
    if host is not None and host.memory_kind is not None:
        state = replace(state, host=replace(state.host, buffers=tuple(
            jax.device_put(b, h.sharding) for b, h in zip(state.host.buffers, host.buffers))))
    runner.state = state
    host = json.loads((path / "host.json").read_text())
    host["requests"] = {int(k): Request.from_dict(r) for k, r in host["requests"].items()}
    scheduler.load_state_dict(host)
