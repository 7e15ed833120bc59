"""The test workers run with XLA's JIT unwind tables unregistered (conftest.py, tests/native/)."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest


def test_workers_and_their_subprocesses_preload_the_no_registration_shim():
    if "PYTEST_XDIST_WORKER" not in os.environ:
        pytest.skip("run without xdist (-n 0): the preload reaches the workers only")
    if not sys.platform.startswith("linux") or not (shutil.which("cc") or shutil.which("gcc")):
        pytest.skip("no C compiler on Linux: conftest.py said so and runs without the shim")
    assert "hkv_no_jit_eh_frames" in Path("/proc/self/maps").read_text()
    # A compile and a C++ exception inside jaxlib still work in a process started from here.
    code = ("import jax, jax.numpy as jnp\n"
            "assert float(jax.jit(lambda x: x * 2)(jnp.ones(())) ) == 2\n"
            "try:\n    jax.jit(lambda x: x)(object())\nexcept TypeError:\n    print('caught')\n"
            "print(open('/proc/self/maps').read().count('hkv_no_jit_eh_frames') > 0)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["caught", "True"]
