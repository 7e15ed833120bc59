"""Collect what ``gpu_session.sh`` wrote into one results file: ``benchmarks/results/<device>-<date>.json``.

Reads the session's output folders (whatever steps finished: a step cut short by its timeout leaves the rows
it printed) and writes ``{"device", "commit", "date", "jax", "rows": [...]}``. Each row has a ``bench``
field:

- ``attention_decode``: ``impl``, ``batch``, ``context``, ``page``, ``time_us``, ``peak_fraction``, ``kv_dtype``
  (and ``splits`` for the Mosaic GPU kernel), from ``attention_decode.jsonl`` and ``attention_decode_fp8.jsonl``;
- ``attention_prefill``: ``impl``, ``batch``, ``context``, ``time_us``, ``tflops`` (and ``splits`` and
  ``warpgroups`` for the Mosaic GPU kernel), from ``attention_prefill.jsonl``;
- ``attention_window``: ``attention_decode``'s fields and ``window``: decode under a sliding window, the
  Mosaic GPU kernel's runs bounded by the window (``mosaic_gpu``) and by the table (``mosaic_gpu_table_splits``),
  from ``window_decode.jsonl`` (the session's part 2);
- ``decode_profile``: ``config``, ``batch``, ``context``, ``step_ms``, ``gpu_busy_ms``, ``kernels_per_step``,
  ``d2h_per_step``, ``d2h_wait_us_median``, ``xla_flags``,
  from ``decode_profile_cold.json``, and the step in XLA's CUDA graphs (wall time) from
  ``decode_profile_graphs.json``;
- ``startup``: ``config``, ``cold_s``, ``warm_s``, ``prefill_steps``, ``cold_compiled``, ``warm_compiled``,
  ``warm_loaded``: the decode profile's setup (model, engine, compiles and the prefill, in ``prefill_steps``
  steps) in a fresh process with an empty compilation cache, and again with that cache filled
  (``decode_profile_warm.json``), with the programs each compiled and those the warm one loaded from the cache
  (``warm_compiled`` 0: the cache served the whole start);
- ``projection``: ``config``, ``batch``, ``context``, ``measured_ms``, ``projected_ms``, ``measured_on`` (the
  device), from ``projection.json`` (the session's part 2);
- ``parity``: ``model``, ``policy``, ``requests``, ``tokens_equal``, ``max_logit_err``, from ``parity.jsonl``;
- ``hlo_kernels``: ``config``, ``batch``, ``context``, ``kernels_per_step``, ``copies_per_step``,
  ``conditionals_per_step``, ``kernels_most``, ``command_buffers``, ``control_outside_graphs``: ``gpu_hlo.py``'s
  count of the decode profile's optimised module (dumped by that run), from ``hlo_kernels.json``, to set
  against the trace's count;
- ``host_copy``: ``model``, ``memory_kind``, ``blocks``, ``page_bytes``, ``down_us``, ``down_gb_per_s``,
  ``up_us``, ``up_gb_per_s``: the host tier's in-step page copies, from ``host_copy.jsonl``.

Run: ``python benchmarks/gpu_results.py OUTDIR [OUTDIR ...] [--commit SHA] [--into benchmarks/results]``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import re
import sys
from pathlib import Path

FIELDS = {
    "attention_decode": ("impl", "batch", "context", "page", "time_us", "peak_fraction", "splits", "kv_dtype"),
    "attention_prefill": ("impl", "batch", "context", "page", "time_us", "tflops", "splits", "warpgroups"),
    "attention_window": ("impl", "batch", "context", "page", "window", "time_us", "peak_fraction", "splits"),
    "decode_profile": ("config", "batch", "context", "decode_steps", "step_ms", "gpu_busy_ms", "kernels_per_step",
                       "d2h_per_step", "d2h_wait_us_median", "xla_flags", "top"),
    "projection": ("config", "program", "batch", "context", "measured_ms", "projected_ms", "measured_gb_per_s",
                   "measured_on"),
    "parity": ("model", "policy", "impl", "requests", "tokens_equal", "max_logit_err", "all_freed", "error"),
    "hlo_kernels": ("config", "batch", "context", "compiled_for", "kernels_per_step", "copies_per_step",
                    "conditionals_per_step", "kernels_most", "command_buffers", "control_outside_graphs"),
    "host_copy": ("model", "memory_kind", "blocks", "page_bytes", "down_us", "down_gb_per_s", "up_us",
                  "up_gb_per_s"),
}


def _json_lines(path: Path) -> list[dict]:
    """The JSON objects of a file of JSON lines (lines that are not one are skipped)."""
    rows = []
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return [r for r in rows if isinstance(r, dict)]


def _pick(bench: str, row: dict) -> dict:
    return {"bench": bench, **{k: row[k] for k in FIELDS[bench] if k in row}}


def collect(out: Path) -> tuple[list[dict], str | None]:
    """The rows of the session folder ``out`` and the device name they report."""
    rows, device = [], None
    for mode in ("decode", "prefill"):
        for r in (r for path in sorted(out.glob(f"attention_{mode}*.jsonl")) for r in _json_lines(path)):
            rows.append(_pick(f"attention_{mode}", r))
            device = device or r.get("device")
    cold, warm = (_json_lines(out / f"decode_profile_{k}.json") for k in ("cold", "warm"))
    for r in cold:
        rows.append(_pick("decode_profile", r))
        device = device or r.get("device")
    rows.extend(_pick("decode_profile", r) for r in _json_lines(out / "decode_profile_graphs.json"))
    if cold:
        w = warm[0] if warm else {}
        rows.append({"bench": "startup", "config": cold[0]["config"], "cold_s": cold[0]["setup_s"],
                     "warm_s": w.get("setup_s"), "prefill_steps": cold[0].get("prefill_steps"),
                     "cold_compiled": cold[0].get("setup_compiled"), "warm_compiled": w.get("setup_compiled"),
                     "warm_loaded": w.get("setup_loaded")})
    for r in _json_lines(out / "projection.json"):
        measured = [x for x in r.get("rows", []) if "measured_ms" in x]
        rows.extend(_pick("projection", x) for x in measured)
        device = device or next((x.get("measured_on") for x in measured), None)
    for r in _json_lines(out / "parity.jsonl"):
        rows.append(_pick("parity", r))
        device = device or r.get("device")
    rows.extend(_pick("attention_window", r) for r in _json_lines(out / "window_decode.jsonl"))
    rows.extend(_pick("hlo_kernels", r) for r in _json_lines(out / "hlo_kernels.json"))
    rows.extend(_pick("host_copy", r) for r in _json_lines(out / "host_copy.jsonl"))
    return rows, device


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", type=Path, nargs="+", help="the folders gpu_session.sh wrote (both parts': one file)")
    p.add_argument("--commit", default="unknown")
    p.add_argument("--jax", default=None, help="the jax version (default: this process's)")
    p.add_argument("--into", type=Path, default=Path(__file__).parent / "results")
    a = p.parse_args(argv)
    rows, device = [], None
    for out in a.out:
        found, on = collect(out)
        rows, device = rows + found, device or on
    if not rows:
        print(f"no rows in {', '.join(map(str, a.out))}", file=sys.stderr)
        return 1
    if a.jax is None:
        import jax
        a.jax = jax.__version__
    date = datetime.date.today().isoformat()
    words = (device or "device").split()  # "NVIDIA H100 80GB HBM3": h100
    slug = next((w for w in words if re.fullmatch(r"[A-Z]\d{3}", w)), words[-1]).lower()
    a.into.mkdir(parents=True, exist_ok=True)
    path = a.into / f"{slug}-{date}.json"
    path.write_text(json.dumps({"device": device, "commit": a.commit, "date": date, "jax": a.jax, "rows": rows},
                               indent=1) + "\n")
    counts = {}
    for r in rows:
        counts[r["bench"]] = counts.get(r["bench"], 0) + 1
    print(f"{path}: " + ", ".join(f"{n} {b}" for b, n in counts.items()), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
