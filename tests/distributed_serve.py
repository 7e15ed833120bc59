"""One of two processes serving a tiny model over a mesh that spans both (``jax.distributed``).

Run by ``tests/test_sharding.py``: ``distributed_serve.py PROCESS_ID PORT MODEL DATAxMODEL OUT.json``, two
processes on this machine with a localhost coordinator and gloo CPU collectives, each with the devices
``XLA_FLAGS`` gives it. Process 0 writes what ``sharded_serve.serve`` returns to ``OUT.json`` (gloo
prints to stdout).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import jax

# Imported before jax.distributed.initialize, as a user would: importing the package must not start a backend.
sys.path.insert(0, str(Path(__file__).parent))
from sharded_serve import serve  # noqa: E402

from hkv_jax.sharding import make_mesh  # noqa: E402


def main(argv: list[str]) -> int:
    process_id, port, name, shape, out = int(argv[0]), int(argv[1]), argv[2], argv[3], Path(argv[4])
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=f"localhost:{port}", num_processes=2, process_id=process_id,
                               initialization_timeout=120)
    data, model = map(int, shape.split("x"))
    result = serve(name, make_mesh(data, model))
    if process_id == 0:
        out.write_text(json.dumps(result))
    jax.distributed.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
