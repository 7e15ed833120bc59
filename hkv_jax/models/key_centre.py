"""Key centring for fp8 KV pages: a fixed vector per attention layer subtracted from the keys before they
are rounded to e4m3.

Why it is exact: a query's scores over its keys ``q . (k_j - c)`` differ from ``q . k_j`` by ``q . c``, the
same for every key, and a softmax does not change when all its logits move by one constant. So attention
over centred keys equals attention over the keys themselves, for any ``c``, in every kernel, with no
change to them. Two exceptions: a soft cap (``tanh`` is not shift-invariant) and attention sinks (a sink's
logit does not move with the keys); layers of models with either keep ``c = 0``.

Why it helps: e4m3 keeps 3 mantissa bits, so a value's rounding error grows with its size. Gemma-like models
have key channels with a large, steady mean (after ``k_norm``): in Gemma 3 270M some sit near 30, while
under 5% of all key entries pass 16. Their rounding error dominates the score error; on Gemma 3 270M
centring cuts fp8's perplexity cost by a third. A scale cannot do that: it moves e4m3's range, not its
relative precision.

The centre is the keys' mean before RoPE over a calibration text (its first token left out), rotated to
every position of ``[0, max_len)`` and averaged (``position_average``): channels that rotate fast average
to 0, the slow ones keep their mean. It is calibrated once, from a fixed text (``CALIBRATION_TEXT``, so
two runs and two engines agree), by ``calibrate_key_centres``; ``factory.engine_for`` does it for an fp8
cache. A model never calibrated centres nothing (``c = 0``: plain rounding). The perplexity figures are in
``benchmarks/README.md`` (``kv_fp8_quality.py``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from hkv_jax.models.layers import Heads, rope, take_heads
from kernels_pallas.key_finish import KeyFinish
from kernels_pallas.reference import is_fp8

# Positions at which ``position_average`` rotates a mean (spread evenly over ``[0, max_len)``).
AVERAGE_POSITIONS = 4096

# A fixed mixed text (prose, a dialogue, code, numbers, a list) that calibrates every model alike.
CALIBRATION_TEXT = """\
The harbour town woke slowly. Fishing boats came in before dawn, their decks wet and silver with the
night's catch, and the first carts rattled over the cobbles toward the market square. By seven the bakery
on Quay Street had sold out of rye bread, and the ferry to the islands was already half full of students,
tourists with heavy rucksacks and a priest reading a newspaper folded into quarters.

"Did you bring the charts?" asked Marta, leaning on the rail.
"Both of them," said Tomas. "The old one is more accurate near the reef, but the new one shows the buoys."
"Then we use the old one until the lighthouse and the new one after it."
"That is what my grandfather would have said, word for word."

Photosynthesis converts light energy into chemical energy. In the light-dependent reactions, water is split,
oxygen is released and the energy of absorbed photons is stored in ATP and NADPH. The Calvin cycle then uses
that energy to fix carbon dioxide into three-carbon sugars, which the plant turns into glucose, starch and
cellulose. Roughly 120 billion tonnes of carbon are fixed this way on land each year.

def moving_average(values, width):
    \"\"\"The mean of each window of `width` consecutive values.\"\"\"
    if width <= 0:
        raise ValueError("width must be positive")
    total = sum(values[:width])
    out = [total / width]
    for i in range(width, len(values)):
        total += values[i] - values[i - width]
        out.append(total / width)
    return out

SELECT customer_id, COUNT(*) AS orders, SUM(amount) AS total
FROM orders WHERE created_at >= '2024-01-01'
GROUP BY customer_id HAVING COUNT(*) > 3 ORDER BY total DESC LIMIT 20;

Quarterly results: revenue rose 7.4% to 18.2 million euros, operating costs fell 2.1%, and the margin
improved from 11.8% to 14.0%. The board proposed a dividend of 0.45 euros per share, payable on 15 May.

Checklist before a long hike:
1. Water, at least two litres per person, and a way to purify more.
2. A map and a compass, even if your phone has offline maps.
3. A warm layer and a waterproof jacket; mountain weather changes within an hour.
4. Food with more calories than you think you need.
5. Tell someone your route and when you expect to be back.

In 1854 the physician John Snow traced a cholera outbreak in London to a single water pump on Broad Street.
He mapped the deaths house by house, persuaded the parish to remove the pump handle, and the outbreak
declined. The map is still taught as one of the founding documents of epidemiology, although historians note
that the epidemic was already waning when the handle came off.

Translate into French: "The library opens at nine and closes at six, except on Sundays."
La bibliothèque ouvre à neuf heures et ferme à dix-huit heures, sauf le dimanche.

User: Can you explain what a hash table is in one paragraph?
Assistant: A hash table stores key-value pairs in an array. A hash function turns each key into an index,
so looking up, inserting or deleting a key takes constant time on average. When two keys land on the same
index, the table resolves the collision, for example by chaining entries in a list or by probing the next
free slot, and it grows and rehashes its entries when it becomes too full.
"""


class KeyCentre(nnx.Variable):
    """A layer's key centre ``f32[kv_heads, head_dim]`` (not a trained weight; see the module docstring)."""


def shift_invariant(soft_cap, sinks) -> bool:
    """Whether a layer's attention ignores a constant added to all its scores: no soft cap and no sinks."""
    return soft_cap is None and sinks is None


def position_average(mean: jax.Array, theta: float | None, max_len: int) -> jax.Array:
    """The keys' pre-RoPE ``mean: [kv_heads, head_dim]`` rotated to positions spread over ``[0, max_len)``
    and averaged (``theta`` ``None``: a layer without RoPE, the mean itself); float32."""
    mean = mean.astype(jnp.float32)
    if theta is None:
        return mean
    positions = jnp.linspace(0, max_len - 1, min(max_len, AVERAGE_POSITIONS)).astype(jnp.int32)
    return rope(jnp.broadcast_to(mean, (positions.shape[0], *mean.shape)), positions, theta).mean(0)


def keys_to_write(k: Heads, finish: KeyFinish, num_kv_heads: int, centre: KeyCentre | None,
                  page_dtype) -> tuple[jax.Array, int, KeyFinish | None]:
    """What an attention layer hands ``attention`` as its keys (``k``, ``k_head``, ``k_finish``): its raw key
    heads ``k`` and their ``finish``, which the KV write applies (on a GPU inside its kernel); over fp8 pages
    with a centre, keys finished and centred here (the centre comes after the finish)."""
    if centre is None or not is_fp8(page_dtype):
        return *k, finish
    return centred(finish.apply(take_heads(k, num_kv_heads)), centre, page_dtype), 0, None


def centred(k: jax.Array, centre: KeyCentre | None, page_dtype) -> jax.Array:
    """Keys as an fp8 page stores them: minus the layer's centre over fp8 pages, as they are otherwise."""
    if centre is None or not is_fp8(page_dtype):
        return k
    return (k.astype(jnp.float32) - centre[...]).astype(k.dtype)


def calibration_ids(codec) -> list[int]:
    """``CALIBRATION_TEXT`` as token ids: the codec's, or its UTF-8 bytes for a byte-level tiny model."""
    return codec.encode(CALIBRATION_TEXT) if codec is not None else list(CALIBRATION_TEXT.encode())


def calibrate_key_centres(model: nnx.Module, ids: list[int], max_len: int) -> None:
    """Set every key centre of ``model`` from one uncached pass over ``ids`` (``model.key_centre_inputs``
    yields each centred layer's attention and the input of that attention). ``max_len``: the longest
    sequence it serves. ``ValueError`` for an empty ``ids`` or ``max_len`` below 1."""
    if not ids or max_len < 1:
        raise ValueError(f"calibration needs token ids and max_len >= 1, got {len(ids)} ids, max_len {max_len}")
    for attn, x in model.key_centre_inputs(jnp.asarray(ids, jnp.int32)):
        k = attn.keys(x, jnp.zeros(x.shape[0], jnp.int32))  # position 0: RoPE is the identity
        # The first token (BOS in most models) is an attention sink with outlying keys: one token of a long
        # sequence, left out of the mean.
        k = k[1:] if k.shape[0] > 1 else k
        attn.key_centre[...] = position_average(k.astype(jnp.float32).mean(0), attn.rope_theta, max_len)
