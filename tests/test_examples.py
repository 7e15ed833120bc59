"""Every example runs in its smallest mode, and every ```python block of README.md and docs/*.md runs as
written, so that an API change cannot break what a new user meets first.

- An example is ``examples/NAME.py`` with ``main(argv)`` and a ``--smoke`` flag (its smallest mode). An example
  with ``NEEDS_SERVER = True`` gets ``--url`` of an in-process ``hkv serve`` of a tiny model.
- A page's blocks run in order in one namespace of their own, so a block may continue the one above it on
  the same page, never one of another page. A block that talks to ``http://127.0.0.1:8000`` talks to the
  in-process server instead (the only change made to a block).
- Examples and pages that name ``--xla_force_host_platform_device_count=N`` (a mesh needs the host devices
  before jax starts) run together in one process with that flag in ``XLA_FLAGS``
  (``python tests/test_examples.py PATH...``),
  the others in the worker's own process.

New examples and pages are picked up by the globs below. The examples and the README and engine pages build
engines of the same sizes, and the README's client snippet talks to test_serve.py's server sizes: the module
runs in test_serve.py's xdist group, on one worker, so each program compiles once.
"""

from __future__ import annotations

import importlib.util
import io
import json
import os
import re
import subprocess
import sys
import traceback
from contextlib import redirect_stdout
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = sorted((ROOT / "examples").glob("*.py"))
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
DEVICES = re.compile(r"--xla_force_host_platform_device_count=(\d+)")
DOCUMENTED_URL = "http://127.0.0.1:8000"  # where the docs' client snippets find `hkv serve`
pytestmark = pytest.mark.xdist_group("serve")


def python_blocks(page: Path) -> list[str]:
    """The ```python blocks of a Markdown page, in order."""
    return re.findall(r"^```python\n(.*?)^```$", page.read_text(), flags=re.S | re.M)


def run_blocks(page: Path, url: str | None = None) -> None:
    """Run a page's blocks in order in one namespace (``url``: the server that replaces ``DOCUMENTED_URL``)."""
    namespace = {"__name__": f"doc:{page.name}"}
    for i, block in enumerate(python_blocks(page)):
        if url is not None:
            block = block.replace(DOCUMENTED_URL, url)
        try:
            exec(compile(block, f"{page.name}, python block {i + 1}", "exec"), namespace)
        except Exception as e:
            raise AssertionError(f"{page.relative_to(ROOT)}: python block {i + 1} failed: {e!r}\n{block}") from e


def device_count(path: Path) -> int | None:
    """The host device count an example or page asks XLA for, if any."""
    match = DEVICES.search(path.read_text())
    return int(match.group(1)) if match else None


def needs_server(path: Path) -> bool:
    """An example that talks to a server (``NEEDS_SERVER = True``), or a page whose snippets do."""
    text = path.read_text()
    if path.suffix == ".md":
        return DOCUMENTED_URL in text
    return re.search(r"^NEEDS_SERVER = True", text, re.M) is not None


def run_example(example: Path, url: str | None = None) -> str:
    """Run ``example``'s ``main`` in its smallest mode in this process; what it printed. ``AssertionError`` when
    it exits with an error (argparse's, or its own check)."""
    spec = importlib.util.spec_from_file_location(f"example_{example.stem}", example)
    module = importlib.util.module_from_spec(spec)
    out = io.StringIO()
    with redirect_stdout(out):
        spec.loader.exec_module(module)
        try:
            code = module.main(["--smoke"] + (["--url", url] if url else []))
        except SystemExit as e:
            code = e.code
    assert code in (None, 0), f"{example.name} exited with {code!r}:\n{out.getvalue()[-3000:]}"
    assert out.getvalue().strip(), f"{example.name} printed nothing"
    return out.getvalue()


def run(path: Path, url: str | None = None) -> None:
    """Run an example or a page's blocks."""
    if path.suffix == ".md":
        run_blocks(path, url)
    else:
        run_example(path, url)


IN_PROCESS = [p for p in EXAMPLES + PAGES if (p.suffix == ".py" or python_blocks(p)) and device_count(p) is None]
ON_DEVICES = [p for p in EXAMPLES + PAGES if (p.suffix == ".py" or python_blocks(p)) and device_count(p)]


def test_every_example_and_page_is_collected():
    """The globs see the examples and the pages with code (a renamed folder would silently test nothing)."""
    assert len(EXAMPLES) >= 6
    assert {p.name for p in IN_PROCESS + ON_DEVICES} >= {"README.md", "allocator.md", "engine.md", "sharding.md",
                                                         "embed_loop.py", "sharded_serve.py"}


@pytest.mark.parametrize("path", IN_PROCESS, ids=lambda p: p.name)
def test_runs_as_written(path, request):
    run(path, request.getfixturevalue("server").url if needs_server(path) else None)


@pytest.fixture(scope="module")
def on_devices() -> dict:
    """``ON_DEVICES`` run together in one process per device count: name -> error text ("" when it ran)."""
    results = {}
    for count in sorted({device_count(p) for p in ON_DEVICES}):
        paths = [str(p) for p in ON_DEVICES if device_count(p) == count]
        env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={count}",
                   PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")]))
        proc = subprocess.run([sys.executable, __file__, *paths], capture_output=True, text=True, timeout=900,
                              env=env, cwd=ROOT)
        assert proc.returncode == 0, proc.stderr[-3000:]
        results |= json.loads(proc.stdout.splitlines()[-1])
    return results


@pytest.mark.parametrize("path", ON_DEVICES, ids=lambda p: p.name)
def test_runs_as_written_on_host_devices(path, on_devices):
    assert on_devices[path.name] == "", on_devices[path.name]


@pytest.fixture(scope="module")
def server():
    """An in-process ``hkv serve`` of tiny-gptoss (byte tokens), test_serve.py's sizes."""
    from conftest import start_test_server

    served = start_test_server()
    yield served
    served.stop()


if __name__ == "__main__":  # run the paths given in this process; print {name: error text} as the last line
    errors = {}
    for name in sys.argv[1:]:
        try:
            run(Path(name).resolve())
            errors[Path(name).name] = ""
        except BaseException:  # noqa: BLE001 - reported to the test, whatever it was
            errors[Path(name).name] = traceback.format_exc()[-3000:]
    print(json.dumps(errors))
