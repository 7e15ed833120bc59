"""A Mamba-2 mixer in Flax NNX whose per-request state lives in the shared KV pages.

Per token: a causal depthwise conv over ``xBC`` (its last ``d_conv - 1``
inputs are the conv state), then the selective state-space update with one
scalar decay per head, ``h <- exp(dt * A) h + dt * x B^T``, ``y = h C + D x``,
gated by ``silu(z)`` and normalised. State tensors, as the spec's shapes
(``hf_config.mamba_state``): ``conv f32[d_conv - 1, conv_dim]`` and
``ssm f32[heads, head_dim, d_state]``.

Two forward passes that share no code path for the recurrence:

- ``dense(x)``: one whole sequence from the zero state, with the conv as a
  padded convolution and the SSM in its quadratic ("attention-like", SSD)
  form; the oracle.
- ``paged(x, cache, metadata)``: a ragged batch token by token
  (``recurrent.ragged_scan``), each sequence starting from the state its
  table points to and writing its new state back.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
from flax import nnx

from hkv_jax.attention import AttentionMetadata, real_tokens
from hkv_jax.cache import KVCache
from hkv_jax.models.layers import Linear
from hkv_jax.recurrent import load_states, ragged_scan, record, store_states


@dataclass(frozen=True)
class Mamba2Config:
    """Sizes of one Mamba-2 mixer (HF ``mamba_*`` fields)."""

    hidden_size: int
    num_heads: int
    head_dim: int
    d_state: int
    n_groups: int = 1
    d_conv: int = 4

    @property
    def inner(self) -> int:
        """``heads * head_dim``."""
        return self.num_heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        """Channels through the conv: x, B and C."""
        return self.inner + 2 * self.n_groups * self.d_state


class Mamba2(nnx.Module):
    """One Mamba-2 mixer; its state lives in the cache under ``name``."""

    def __init__(self, cfg: Mamba2Config, name: str, rngs: nnx.Rngs):
        if cfg.num_heads % cfg.n_groups:
            raise ValueError(f"mamba_n_heads ({cfg.num_heads}) must be a multiple of mamba_n_groups ({cfg.n_groups})")
        self.cfg, self.name = cfg, name
        self.in_proj = Linear(cfg.hidden_size, cfg.inner + cfg.conv_dim + cfg.num_heads, use_bias=False,
                              rngs=rngs)
        self.conv_w = nnx.Param(jax.random.normal(rngs.params(), (cfg.d_conv, cfg.conv_dim)) / cfg.d_conv)
        self.conv_b = nnx.Param(jnp.zeros(cfg.conv_dim))
        self.dt_bias = nnx.Param(jax.random.uniform(rngs.params(), (cfg.num_heads,), minval=-3.0, maxval=-1.0))
        self.a_log = nnx.Param(jnp.log(jax.random.uniform(rngs.params(), (cfg.num_heads,), minval=1.0,
                                                          maxval=8.0)))
        self.d = nnx.Param(jnp.ones(cfg.num_heads))
        self.norm = nnx.RMSNorm(cfg.inner, rngs=rngs)
        self.out_proj = Linear(cfg.inner, cfg.hidden_size, use_bias=False, rngs=rngs)

    def _split_in(self, x):
        cfg = self.cfg
        zxbcdt = self.in_proj(x)
        return (zxbcdt[..., :cfg.inner], zxbcdt[..., cfg.inner:cfg.inner + cfg.conv_dim],
                zxbcdt[..., cfg.inner + cfg.conv_dim:])

    def _split_conv(self, xbc):
        """``xbc[..., conv_dim]`` -> x ``[..., heads, head_dim]``, B and C ``[..., heads, d_state]``."""
        cfg = self.cfg
        lead = xbc.shape[:-1]
        x = xbc[..., :cfg.inner].reshape(*lead, cfg.num_heads, cfg.head_dim)
        rep = cfg.num_heads // cfg.n_groups
        bc = xbc[..., cfg.inner:].reshape(*lead, 2, cfg.n_groups, cfg.d_state)
        b, c = (jnp.repeat(bc[..., i, :, :], rep, axis=-2) for i in (0, 1))
        return x, b, c

    def _dt(self, dt_raw):
        return jax.nn.softplus(dt_raw + self.dt_bias[...])

    def _out(self, y, z):
        return self.out_proj(self.norm(y.reshape(*z.shape) * jax.nn.silu(z)))

    def _dense_inputs(self, xbc, dt_raw):
        """Whole-sequence conv (zero-padded on the left) and decays: x, B, C, dt and ``cumsum(dt * A)`` per token."""
        d_conv, length = self.cfg.d_conv, xbc.shape[0]
        padded = jnp.pad(xbc, ((d_conv - 1, 0), (0, 0)))
        conv = sum(padded[k:k + length] * self.conv_w[k] for k in range(d_conv)) + self.conv_b[...]
        xs, b, c = self._split_conv(jax.nn.silu(conv))
        dt = self._dt(dt_raw)                                                  # [L, H]
        return xs, b, c, dt, jnp.cumsum(dt * -jnp.exp(self.a_log[...]), axis=0)

    def dense(self, x: jax.Array) -> jax.Array:
        """``x: [L, hidden]`` of one whole sequence from the zero state -> ``[L, hidden]``."""
        length = x.shape[0]
        z, xbc, dt_raw = self._split_in(x)
        xs, b, c, dt, cum = self._dense_inputs(xbc, dt_raw)
        t, s = jnp.arange(length)[:, None], jnp.arange(length)[None, :]
        seg = jnp.where((s <= t)[..., None], cum[:, None, :] - cum[None, :, :], -jnp.inf)
        weights = jnp.exp(seg) * jnp.einsum("thn,shn->tsh", c, b) * dt[None]   # [L(t), L(s), H]
        y = jnp.einsum("tsh,shp->thp", weights, xs) + self.d[...][:, None] * xs
        return self._out(y, z)

    def dense_state(self, x: jax.Array, length: jax.Array | int | None = None) -> tuple[jax.Array, jax.Array]:
        """The state ``(conv, ssm)`` after the first ``length`` (default: all) tokens of ``x: [L, hidden]``.

        In closed form from the whole-sequence conv and decays (no recurrence); jittable with a traced
        ``length``, so one padded sequence serves every length.
        """
        d_conv = self.cfg.d_conv
        n = x.shape[0] if length is None else length
        _, xbc, dt_raw = self._split_in(x)
        xs, b, _, dt, cum = self._dense_inputs(xbc, dt_raw)
        padded = jnp.pad(xbc, ((d_conv - 1, 0), (0, 0)))
        conv_state = jax.lax.dynamic_slice_in_dim(padded, n, d_conv - 1)      # inputs n-d_conv+1 .. n-1
        last = cum[jnp.maximum(n - 1, 0)]
        before = (jnp.arange(x.shape[0]) < n)[:, None]
        weights = jnp.where(before, jnp.exp(jnp.where(before, last[None] - cum, 0.0)) * dt, 0.0)  # [L, H]
        return conv_state, jnp.einsum("sh,shp,shn->hpn", weights, xs, b)

    def _cell(self, state, inputs):
        """One token: ``state = (conv, ssm)``, ``inputs = (xbc, dt_raw)`` -> (state, y ``[heads, head_dim]``)."""
        conv_state, ssm = state
        xbc, dt_raw = inputs
        window = jnp.concatenate([conv_state, xbc[None]], axis=0)              # [d_conv, conv_dim]
        xs, b, c = self._split_conv(jax.nn.silu(jnp.sum(window * self.conv_w[...], axis=0) + self.conv_b[...]))
        dt = self._dt(dt_raw)                                                  # [H]
        decay = jnp.exp(dt * -jnp.exp(self.a_log[...]))
        ssm = decay[:, None, None] * ssm + (dt[:, None] * xs)[:, :, None] * b[:, None, :]
        y = jnp.einsum("hpn,hn->hp", ssm, c) + self.d[...][:, None] * xs
        return (window[1:], ssm), y

    def paged(self, x: jax.Array, cache: KVCache, metadata: AttentionMetadata) -> tuple[jax.Array, KVCache]:
        """``x: [T, hidden]`` of a ragged batch -> ``([T, hidden], cache)`` with every state advanced (rows past
        ``metadata.num_tokens`` are padding: ``real_tokens``)."""
        z, xbc, dt_raw = self._split_in(x)
        states = load_states(self.name, cache, metadata)

        def scan(xbc, dt_raw):  # over the real tokens (``real_tokens``), its output first
            states_, y, recorded = ragged_scan(self._cell, states, (xbc, dt_raw), metadata)
            return y, states_, recorded
        y, states, recorded = real_tokens(scan, metadata, xbc, dt_raw)
        record(self, self.name, recorded)
        return self._out(y, z), store_states(self.name, states, cache, metadata)
