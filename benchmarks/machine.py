"""One line naming the machine a benchmark ran on: CPU model, cores, JAX backend and version.

Development machines differ (an AMD EPYC one day, an Intel Xeon with AVX-512 the next), and
figures only compare on the same CPU, so every benchmark prints this line with its figures."""

from __future__ import annotations

import json
import os
import platform
from pathlib import Path

import jax


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``), or the architecture where that file is absent."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def describe() -> str:
    """``"Intel(R) Xeon(R) Processor, 2 cores, cpu, jax 0.12.0.1"``."""
    return f"{cpu_model()}, {os.cpu_count()} cores, {jax.devices()[0].platform}, jax {jax.__version__}"


def print_rows(rows: list[dict], as_json: bool) -> None:
    """A benchmark's ending: its rows and this machine as one JSON object (``as_json``), else the machine
    line after the rows the benchmark printed as it went."""
    if as_json:
        print(json.dumps({"machine": describe(), "rows": rows}, indent=1))
    else:
        print(describe())
