#!/usr/bin/env python3
"""Compare two replay result files (expected vs actual), event by event.

Usage:
    compare_replay.py EXPECTED.json ACTUAL.json [--lenient] [--fields F ...]
                      [--max-diffs N] [--quiet]

Both files use the result format of ``docs/trace-format.md``. Compared:

* the KV cache groups, in order: per group the sorted ``layer_names`` and the
  ``block_size`` (pseudo-field ``groups``);
* for every event, by position: ``op`` and ``id`` must agree (the two files
  must describe the same trace), then the fields ``ok``,
  ``cache_hit_tokens``, ``num_computed_tokens``, ``num_free_blocks``,
  ``new_block_ids`` and ``block_table``.

A field is compared only on events where the expected file has it (a failed
``schedule`` has no ``block_table``, only a request's first ``schedule``
after ``add``/``preempt`` has ``cache_hit_tokens``, ...); if the expected
event has it and the actual one does not, that is a divergence. Extra fields
in the actual file are ignored.

``--lenient`` (for implementations that number blocks differently) compares
only ``ok``, ``cache_hit_tokens``, ``num_computed_tokens``,
``num_free_blocks`` and, derived from ``block_table``, the per-group table
length (``table_len``) and per-group number of non-null entries
(``table_non_null``); groups are not compared.

``--fields`` replaces the field list: any event field name, ``groups``, or
one of the derived names ``table_len``, ``table_non_null``, ``new_len``
(per-group count of ``new_block_ids``). Names may be given space- or
comma-separated.

Prints the first divergences (``--max-diffs``, default 10) and a summary line
``N/M events match``. Exit status: 0 when everything compared matches, 1 when
something differs, 2 when a file cannot be read or is malformed.

Python 3 standard library only.
"""

from __future__ import annotations

import argparse
import json
import sys

DEFAULT_FIELDS = ["groups", "ok", "cache_hit_tokens", "num_computed_tokens",
                  "num_free_blocks", "new_block_ids", "block_table"]
LENIENT_FIELDS = ["ok", "cache_hit_tokens", "num_computed_tokens",
                  "num_free_blocks", "table_len", "table_non_null"]

# Derived per-group fields: name -> (source field, function of one group list)
DERIVED = {
    "table_len": ("block_table", len),
    "table_non_null": ("block_table", lambda g: sum(1 for b in g if b != 0)),
    "new_len": ("new_block_ids", len),
}


class InputError(Exception):
    pass


def load(path: str) -> dict:
    try:
        with open(path) as f:
            data = json.load(f)
    except OSError as e:
        raise InputError(f"cannot read {path}: {e}") from e
    except json.JSONDecodeError as e:
        raise InputError(f"{path} is not valid JSON: {e}") from e
    if not isinstance(data, dict) or not isinstance(data.get("events"), list):
        raise InputError(f"{path}: expected an object with an 'events' list")
    return data


def groups_of(data: dict, path: str) -> list[tuple[list[str], int]] | None:
    cfg = data.get("kv_cache_config")
    if not isinstance(cfg, dict) or not isinstance(cfg.get("groups"), list):
        return None
    out = []
    for i, g in enumerate(cfg["groups"]):
        if not isinstance(g, dict) or "layer_names" not in g or "block_size" not in g:
            raise InputError(f"{path}: group {i} lacks layer_names/block_size")
        out.append((sorted(g["layer_names"]), g["block_size"]))
    return out


def short(x, limit: int = 160) -> str:
    s = json.dumps(x, separators=(",", ":"))
    return s if len(s) <= limit else s[: limit - 3] + "..."


def first_difference(a, b, path: str = "") -> str:
    """Locate the first differing element of two nested lists."""
    if isinstance(a, list) and isinstance(b, list):
        for i, (x, y) in enumerate(zip(a, b)):
            if x != y:
                return first_difference(x, y, f"{path}[{i}]")
        if len(a) != len(b):
            return f"{path} length {len(a)} vs {len(b)}"
        return path
    return f"{path} {short(a, 40)} vs {short(b, 40)}"


def field_value(ev: dict, name: str):
    """(present, value) of a plain or derived field of an event."""
    if name in DERIVED:
        src, fn = DERIVED[name]
        v = ev.get(src)
        if not isinstance(v, list):
            return False, None
        try:
            return True, [fn(g) for g in v]
        except TypeError:
            return True, v  # malformed: compare raw, will differ
    if name in ev:
        return True, ev[name]
    return False, None


def compare(exp: dict, act: dict, fields: list[str], exp_path: str, act_path: str,
            max_diffs: int, out) -> bool:
    shown = 0
    ok_all = True

    def report(msg: str) -> None:
        nonlocal shown
        if shown < max_diffs:
            print(msg, file=out)
        shown += 1

    if "groups" in fields:
        ge = groups_of(exp, exp_path)
        ga = groups_of(act, act_path)
        if ge is None:
            raise InputError(f"{exp_path}: no kv_cache_config.groups")
        if ga is None:
            ok_all = False
            report("groups: actual file has no kv_cache_config.groups")
        elif ge != ga:
            ok_all = False
            if len(ge) != len(ga):
                report(f"groups: expected {len(ge)} groups, got {len(ga)}")
            for i, (x, y) in enumerate(zip(ge, ga)):
                if x[1] != y[1]:
                    report(f"group {i}: block_size expected {x[1]}, got {y[1]}")
                if x[0] != y[0]:
                    only_e = sorted(set(x[0]) - set(y[0]))
                    only_a = sorted(set(y[0]) - set(x[0]))
                    report(f"group {i}: layer_names differ (expected only: "
                           f"{short(only_e, 120)}; actual only: {short(only_a, 120)})")
    ev_fields = [f for f in fields if f != "groups"]
    ee, ea = exp["events"], act["events"]
    matched = 0
    for i, e in enumerate(ee):
        where = f"event {i} (step {e.get('step')}, {e.get('op')} {e.get('id', '')})".rstrip()
        if i >= len(ea):
            report(f"{where}: missing from the actual file")
            continue
        a = ea[i]
        if not isinstance(a, dict):
            report(f"{where}: actual event is not an object")
            continue
        bad = []
        for key in ("op", "id"):
            if e.get(key) != a.get(key):
                bad.append(f"{key}: expected {short(e.get(key))}, got {short(a.get(key))}")
        if not bad:
            for f in ev_fields:
                has_e, ve = field_value(e, f)
                if not has_e:
                    continue
                has_a, va = field_value(a, f)
                if not has_a:
                    bad.append(f"{f}: expected {short(ve)}, missing in actual")
                elif ve != va:
                    if isinstance(ve, list) and isinstance(va, list):
                        bad.append(f"{f}: first difference at {first_difference(ve, va)}; "
                                   f"expected {short(ve)}, got {short(va)}")
                    else:
                        bad.append(f"{f}: expected {short(ve)}, got {short(va)}")
        if bad:
            for b in bad:
                report(f"{where}: {b}")
        else:
            matched += 1
    extra = len(ea) - len(ee)
    if extra > 0:
        report(f"actual file has {extra} more events than expected")
    if shown > max_diffs > 0:
        print(f"... {shown - max_diffs} more divergences not shown", file=out)
    total = len(ee)
    all_match = ok_all and matched == total and extra <= 0
    groups_note = ""
    if "groups" in fields:
        groups_note = ", groups match" if ok_all else ", groups DIFFER"
    print(f"{matched}/{total} events match{groups_note} "
          f"(fields: {', '.join(fields)})", file=out)
    return all_match


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        description="Compare two replay result JSON files (expected vs actual).")
    ap.add_argument("expected")
    ap.add_argument("actual")
    ap.add_argument("--lenient", action="store_true",
                    help="only ok, cache_hit_tokens, num_computed_tokens, "
                         "num_free_blocks and per-group table length / non-null "
                         "count")
    ap.add_argument("--fields", nargs="+",
                    help="fields to compare instead of the default set "
                         "(space or comma separated)")
    ap.add_argument("--max-diffs", type=int, default=10,
                    help="how many divergences to print (default 10)")
    ap.add_argument("--quiet", "-q", action="store_true",
                    help="print only the summary line")
    args = ap.parse_args(argv)

    if args.fields:
        fields = [f for item in args.fields for f in item.split(",") if f]
    elif args.lenient:
        fields = list(LENIENT_FIELDS)
    else:
        fields = list(DEFAULT_FIELDS)
    try:
        exp = load(args.expected)
        act = load(args.actual)
        same = compare(exp, act, fields, args.expected, args.actual,
                       0 if args.quiet else max(0, args.max_diffs), sys.stdout)
    except InputError as e:
        print(f"compare_replay: {e}", file=sys.stderr)
        return 2
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
