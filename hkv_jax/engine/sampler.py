"""Sampling inside the step program: temperature, top-p, top-k and min-p cuts, per-request seeds, vLLM's
penalties, logit biases and ``min_tokens``. Every function takes one row per request, each with its own
values (``[B]`` arrays, or one value for all)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np


def _per_row(x, dtype, rows: int) -> jax.Array:
    """``x`` (one value, or one per row) as ``[rows, 1]`` of ``dtype``."""
    return jnp.broadcast_to(jnp.asarray(x, dtype), (rows,))[:, None]


# The likeliest tokens the sampler ranks with ``lax.top_k``; a row whose cuts keep more of its vocabulary
# sorts the whole row (on a CPU, top-k of 1,024 out of 262,144 costs about a 25th of the sort).
CANDIDATES = 1024


# The sampler's randomness is counter-based hashing: a row's key, a seeded row's key and each token's noise
# are a few rounds of murmur3's 32-bit finaliser over (key, counter) words. XLA fuses them into one kernel,
# where ``jax.random``'s threefry compiled into some 40 kernels per call site on XLA:CPU (and a step program
# holds several): a measurable share of every step program's compile time. Not cryptographic.
_ROUNDS = (0x85EBCA6B, 0xC2B2AE35)
_WEYL = 0x9E3779B9  # the golden ratio in 32 bits: spreads consecutive counters over the word


def _fmix(h, xp=jnp):
    """murmur3's finaliser of a ``uint32`` array (``xp``: ``jnp``, or ``np`` on the host): a bijection in which
    each input bit flips about half the output bits."""
    h = h ^ (h >> 16)
    h = h * xp.uint32(_ROUNDS[0])
    h = h ^ (h >> 13)
    h = h * xp.uint32(_ROUNDS[1])
    return h ^ (h >> 16)


def _hash(key: jax.Array, counter: jax.Array) -> jax.Array:
    """``uint32`` hash of ``counter`` under ``key`` (broadcast): for one key a bijection of the counter, and
    keys relate to one another through the nonlinear finaliser, not by a shift or xor of the counter."""
    key, counter = jnp.asarray(key, jnp.uint32), jnp.asarray(counter).astype(jnp.uint32)
    return _fmix(_fmix(_fmix(counter * jnp.uint32(_WEYL) + jnp.uint32(0x7F4A7C15)) ^ key) + key)


def engine_key(seed: int) -> np.ndarray:
    """The engine's sampling key for ``seed``: ``u32[2]``, a stream word from the seed and a step counter that
    ``split_key`` advances, so two seeds' streams never run into one another."""
    word = _fmix(np.array([(seed ^ (seed >> 32)) & 0xFFFFFFFF], np.uint32), np)  # an array wraps silently
    return np.array([word[0], 0], np.uint32)


def split_key(key: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(next key, this step's key)`` of a ``u32[2]`` key: the next one counts one step on, this step's is
    a hash of the stream word and the count."""
    stream, count = key[0], key[1]
    sub = _hash(stream, count)
    return jnp.stack([stream, count + jnp.uint32(1)]), jnp.stack([sub, _hash(sub, count ^ jnp.uint32(_WEYL))])


def _row_keys(a: jax.Array, b: jax.Array, counter: jax.Array) -> jax.Array:
    """``u32[B, 2]`` row keys from key words ``a, b`` and a per-row ``counter`` (``[B]``)."""
    first = _hash(a, counter)
    return jnp.stack([first, _hash(b, first)], axis=-1)


def _gumbel(keys: jax.Array, ids: jax.Array) -> jax.Array:
    """Gumbel noise ``f32[B, N]`` for token ids ``ids: i32[B, N]`` under row keys ``keys: u32[B, 2]``: a token's
    noise depends on its row's key and its id only, so a draw does not depend on how many candidates it ranks."""
    bits = _hash(keys[:, 1:], _hash(keys[:, :1], ids))
    u = ((bits >> 8).astype(jnp.float32) + 0.5) * np.float32(2.0**-24)  # in (0, 1), both ends excluded
    return -jnp.log(-jnp.log(u))


def sample(logits: jax.Array, key: jax.Array, temperature=0.0, top_p=1.0, top_k=0, min_p=0.0, seed=-1,
           position=0, candidates: int = CANDIDATES) -> jax.Array:
    """One token per row of ``logits: [B, V]``, each row with its own sampling (``[B]`` or one value for
    all). Greedy where ``temperature`` is 0 (an argmax; no sort when every row is greedy). Else, as vLLM
    does: the logits divided by the temperature; tokens below ``min_p`` times the likeliest token's
    probability and past the ``top_k`` likeliest (0: no limit) cut; then the smallest prefix of the rest
    whose renormalised probability reaches ``top_p`` kept; one kept token drawn (Gumbel-max, each token's
    noise from the row's key and the token's id). A row with ``seed >= 0`` draws with the key of its seed
    and ``position`` (the index of the token it samples), so its draw does not depend on the other rows or
    on ``key`` (``u32[2]``: ``engine_key``'s, or any two words), whose draws differ per row. Only the
    ``candidates`` likeliest tokens are ranked when every hot row keeps no more; otherwise the whole
    vocabulary is sorted (the same draw either way)."""
    B, V = logits.shape
    column = functools.partial(_per_row, rows=B)
    temperature = column(temperature, jnp.float32)
    hot = temperature[:, 0] > 0
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    # The draw's values go into its conditional as the columns of one array (float32 ones as their bits):
    # each operand of a conditional is a buffer of its own, and on a GPU every one that is a slice of
    # another array (the step's plan) costs a kernel.
    bits = functools.partial(jax.lax.bitcast_convert_type, new_dtype=jnp.int32)
    values = jnp.concatenate([temperature, column(top_p, jnp.float32), column(min_p, jnp.float32)], axis=1)
    values = jnp.concatenate([bits(values)] + [column(x, jnp.int32) for x in (top_k, seed, position)], axis=1)

    def draw():
        floats = jax.lax.bitcast_convert_type(values[:, :3], jnp.float32)
        temperature, top_p, min_p = floats[:, 0:1], floats[:, 1:2], floats[:, 2:3]
        k, seeds, positions = values[:, 3:4], values[:, 4], values[:, 5]
        scaled = logits / jnp.maximum(temperature, 1e-6)
        own = _row_keys(seeds, jnp.uint32(_WEYL), positions)  # a seed's key: its seed and position only
        keys = jnp.where((seeds >= 0)[:, None], own, _row_keys(key[0], key[1], jnp.arange(B)))
        probs = jax.nn.softmax(scaled, axis=-1)
        # min-p and top-k keep a prefix of the tokens by likelihood (the first always): its length and mass.
        floor = min_p * jnp.max(probs, axis=-1, keepdims=True)
        above = probs >= floor
        n_above = jnp.sum(above, axis=-1, keepdims=True)
        n_keep = jnp.maximum(jnp.where(k > 0, jnp.minimum(k, n_above), n_above), 1)

        def ranked(n: int):
            """The draw from the ``n`` likeliest tokens, and whether every hot row's kept tokens lie among them."""
            top, order = jax.lax.top_k(scaled, n)  # likeliest first; equal ones by id
            p = jnp.exp(top - jax.nn.logsumexp(scaled, axis=-1, keepdims=True))
            rank = jnp.arange(n)
            kept = rank < n_keep
            # The prefix's mass: within the n ranked, or (min-p alone cuts it) every token above the floor.
            mass = jnp.where(n_keep <= n, jnp.sum(jnp.where(kept, p, 0.0), axis=-1, keepdims=True),
                             jnp.sum(jnp.where(above, probs, 0.0), axis=-1, keepdims=True))
            known = (n_keep <= n) | (n_keep == n_above)
            renorm = p / mass
            kept &= jnp.cumsum(renorm, axis=-1) - renorm <= top_p
            fits = known[:, 0] & ((n_keep[:, 0] <= n) | ~kept[:, -1])
            choice = jnp.argmax(jnp.where(kept, top + _gumbel(keys, order), -jnp.inf), axis=-1)
            return jnp.take_along_axis(order, choice[:, None], axis=-1)[:, 0].astype(jnp.int32), fits

        n = min(candidates, V)
        drawn, fits = ranked(n)
        if n < V:  # some hot row keeps more than the candidates: sort them all
            drawn = jax.lax.cond(jnp.all(fits | ~hot), lambda: drawn, lambda: ranked(V)[0])
        return jnp.where(hot, drawn, greedy)

    return jax.lax.cond(jnp.any(hot), draw, lambda: greedy)


def bias_logits(logits: jax.Array, ids: jax.Array, values: jax.Array, generated: jax.Array,
                min_tokens: jax.Array) -> jax.Array:
    """``logits: [B, V]`` with row ``b``'s bias entries added (``ids, values: [B, M]``; id -1: none). An
    entry of value -inf masks a stop token while the row has generated fewer than ``min_tokens[b]``
    tokens (``generated[b]`` so far), as vLLM's ``min_tokens``; after that it applies no more."""
    active = (ids >= 0) & ((values > -jnp.inf) | (generated < min_tokens)[:, None])
    rows = jnp.broadcast_to(jnp.arange(logits.shape[0])[:, None], ids.shape)
    return logits.at[rows, jnp.maximum(ids, 0)].add(jnp.where(active, values, 0.0).astype(logits.dtype))


def penalize(logits: jax.Array, tokens: jax.Array, length: jax.Array, prompt_len: jax.Array,
             repetition_penalty, presence_penalty, frequency_penalty) -> jax.Array:
    """vLLM's penalties on ``logits: [B, V]``, row ``b`` having seen ``tokens[b, :length[b]]`` (``i32[B, L]``),
    the first ``prompt_len[b]`` of them its prompt. A token seen anywhere has its logit divided by
    ``repetition_penalty`` where positive, else multiplied (1: none); each generated token then loses
    ``frequency_penalty`` per occurrence and ``presence_penalty`` once. Values ``[B]`` or one for all."""
    B, V = logits.shape
    pos = jnp.arange(tokens.shape[1])[None, :]
    seen = pos < length[:, None]
    rows = jnp.broadcast_to(jnp.arange(B)[:, None], tokens.shape)
    counts = jnp.zeros((B, V), jnp.int32).at[rows, tokens].add((seen & (pos >= prompt_len[:, None])).astype(jnp.int32))
    anywhere = jnp.zeros((B, V), bool).at[rows, tokens].max(seen)
    column = functools.partial(_per_row, dtype=jnp.float32, rows=B)
    r = column(repetition_penalty)
    logits = jnp.where(anywhere, jnp.where(logits > 0, logits / r, logits * r), logits)
    return logits - column(frequency_penalty) * counts - column(presence_penalty) * (counts > 0)


# --- prepare: releases and admissions -------------------------------------------------------------
