"""Serving over a ``jax.sharding`` mesh: axes ``data`` (replicas) and ``model`` (tensor parallel).

- The KV pool: each shared tensor is split by KV head over ``model`` where its
  layers' KV heads divide (``hkv_jax.cache.CacheLayout.from_config``), else
  replicated. ``hkv_jax.attention`` runs the split layers under ``shard_map``.
- The weights, Megatron-style: the query/key/value and MLP gate/up projections
  split by output column, the attention output and MLP down projections by
  input row, so each device computes its own heads and MLP slice and one
  all-reduce per projection pair joins them. A projection whose heads (or MLP
  width) do not divide the axis stays replicated; so do embeddings, norms and
  Mamba mixers.
- The allocator state, plan and sampling key: replicated (small, and every
  device runs the same allocator program on them).

Everything is also replicated over ``data``: the axis gives copies of the
engine, not independent batches.
"""

from __future__ import annotations

import jax
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from hkv_jax.cache import mesh_model_size

# Linear layer names (TinyLM and Gemma 3) -> (which dimension splits: the outputs (Megatron's column split)
# or the inputs (row split), the config field it splits by).
_COLUMN, _ROW = "out", "in"
# Where a weight keeps its output dimension: nnx.Linear.kernel is [in, out]; Int8Linear.weight [out, in].
_OUT_DIM = {"kernel": 1, "weight": 0}
_SPLITS = {
    "q": (_COLUMN, "num_heads"), "q_proj": (_COLUMN, "num_heads"),
    "k": (_COLUMN, "num_kv_heads"), "k_proj": (_COLUMN, "num_kv_heads"),
    "v": (_COLUMN, "num_kv_heads"), "v_proj": (_COLUMN, "num_kv_heads"),
    "o": (_ROW, "num_heads"), "o_proj": (_ROW, "num_heads"),
    "gate": (_COLUMN, "intermediate_size"), "gate_proj": (_COLUMN, "intermediate_size"),
    "up": (_COLUMN, "intermediate_size"), "up_proj": (_COLUMN, "intermediate_size"),
    "down": (_ROW, "intermediate_size"), "down_proj": (_ROW, "intermediate_size"),
}


def make_mesh(data: int = 1, model: int = 1, devices=None) -> Mesh:
    """A ``(data, model)`` mesh over the first ``data * model`` devices (``jax.devices()`` by default), with
    automatic (compiler-propagated) shardings."""
    for name, n in (("data", data), ("model", model)):
        if not isinstance(n, int) or n < 1:
            raise ValueError(f"mesh axis {name} must be a positive integer, got {n!r}")
    devices = list(jax.devices() if devices is None else devices)
    if data * model > len(devices):
        raise ValueError(f"a ({data}, {model}) mesh needs {data * model} devices, {len(devices)} available")
    return jax.make_mesh((data, model), ("data", "model"), axis_types=(AxisType.Auto, AxisType.Auto),
                         devices=devices[:data * model])


def _path_names(path) -> list[str]:
    """The names along a key path, without the trailing ``.value`` of an ``nnx.Variable``."""
    names = [str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path]
    return names[:-1] if names and names[-1] == "value" else names


def param_spec(path, shape: tuple[int, ...], cfg, model_shards: int) -> PartitionSpec:
    """The partition of one weight (``path``: its key path in the model's ``nnx.State``)."""
    names = _path_names(path)
    if model_shards == 1 or len(names) < 2:
        return PartitionSpec()
    if names[-1] in _OUT_DIM and names[-2] in _SPLITS and len(shape) == 2:
        split, field = _SPLITS[names[-2]]
        if getattr(cfg, field, 0) % model_shards == 0:
            out = _OUT_DIM[names[-1]]
            dim = out if split == _COLUMN else 1 - out
            return PartitionSpec("model", None) if dim == 0 else PartitionSpec(None, "model")
    if names[-1] == "scale" and names[-2] in _SPLITS and len(shape) == 1:  # an Int8Linear's per-column scales
        split, field = _SPLITS[names[-2]]
        if split == _COLUMN and getattr(cfg, field, 0) % model_shards == 0:
            return PartitionSpec("model")
    if names[-1] == "sinks" and getattr(cfg, "num_heads", 0) % model_shards == 0:
        return PartitionSpec("model")
    return PartitionSpec()


def param_shardings(params, cfg, mesh: Mesh):
    """``NamedSharding`` of every leaf of ``params`` (an ``nnx.State``), same tree structure."""
    size = mesh_model_size(mesh)
    return jax.tree_util.tree_map_with_path(
        lambda path, x: NamedSharding(mesh, param_spec(path, x.shape, cfg, size)), params)


def replicated(mesh: Mesh) -> NamedSharding:
    """The sharding of everything small: a full copy on every device."""
    return NamedSharding(mesh, PartitionSpec())
