"""Soak runs: the allocator under a long random workload, or ``hkv serve`` under misbehaving clients.

``--allocator --requests N``: N requests through the jitted batched allocator ops (``admit_batch``,
``prefill_batch``, ``schedule_batch``, ``decode_step``, ``append_batch``, ``release_batch``) on a hybrid
model (full + sliding window + chunked local + Mamba groups), ``--slots`` at a time in a pool small enough
that requests wait for blocks and running ones are preempted (when a step finds no room, and a few at
random). Prompts share one of a few prefixes (prefix hits); prefills run in random chunks; requests stop at
a random length, and a few are aborted while waiting or running. Every
``--check-every`` operations (admissions, scheduled lanes, appends, frees, preemptions: one each) it checks
the pool's invariants on the device state:

- free blocks plus held blocks equal the pool (the null block left out);
- each block's ref count equals the table entries holding it;
- each prefix-cache entry holds as many blocks as claim it, and a cached block that a running request's
  table holds under its prefix stands under that request's own block hash;

and, with ``--check-model``, that the plain-Python model (``PyAllocator``), driven with the same events,
has the same free blocks and computed counts. It prints operations/s (after the first tenth of the
requests, by when every program has compiled) and the process' memory.

``--serve --requests N --clients C``: starts ``hkv serve`` (``--model``, tiny-gptoss by default) on a
loopback port (or, with ``--port P``, uses the one already listening on 127.0.0.1:P) and drives it from C
client threads, each a bounded loop over its share of the requests:
completions and chat completions over shared prompt prefixes, random sampling parameters, streamed and
whole answers, ``n > 1``, echo with log-probabilities, 10% of clients going away mid-stream and 5%
malformed requests. At the end it checks that ``/metrics`` shows every block free and nothing running or
waiting, that every answer not aborted was whole, that no answer was a 5xx and that the server is alive,
and compares the server's RSS between the first and the last quarter of the run (a server it started).
Prompts are cut to fit the server's ``max_model_len`` (``/v1/models``), counting a character as at least
one token.

Run: ``python benchmarks/soak.py --allocator --requests 1000000 [--slots 32] [--check-model] [--json]`` or
``python benchmarks/soak.py --serve --requests 20000 --clients 32 [--model tiny-gptoss | --port P] [--json]``.
"""

from __future__ import annotations

import argparse
import functools
import http.client
import json
import random
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))

BS = 16


def rss_mb(pid: int | str = "self") -> float:
    """Resident memory of process ``pid`` in MiB (Linux ``/proc``)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for process {pid}")


# --- allocator ----------------------------------------------------------------------------------


def soak_layers():
    from hkv_jax.spec import ChunkedLocalSpec, FullAttentionSpec, MambaSpec, SlidingWindowSpec

    return [FullAttentionSpec(name="f", num_kv_heads=2, head_size=16),
            SlidingWindowSpec(name="s", num_kv_heads=2, head_size=16, sliding_window=48),
            ChunkedLocalSpec(name="c", num_kv_heads=2, head_size=16, attention_chunk_size=64),
            MambaSpec(name="m", shapes=[[3, 64]], dtypes=["float32"])]


def check_pool(layout, alloc, live: dict[int, object]) -> None:
    """The pool invariants of the module docstring on ``alloc`` (``live``: slot -> request, the slots in use);
    ``AssertionError`` naming the first that fails."""
    import jax

    fq, pc, tables, lens, cached, hashes = jax.device_get((
        alloc.block_pool.free_queue, alloc.block_pool.prefix_cache, alloc.tables, alloc.table_len,
        alloc.num_cached, alloc.hashes))
    n, G, M = layout.num_blocks, layout.num_groups, layout.max_blocks
    ref = np.asarray(fq.ref_count)
    held = int((ref[1:] > 0).sum())
    assert int(fq.num_free) + held == n - 1, f"free {int(fq.num_free)} + held {held} != pool {n - 1}"
    slots = np.fromiter(live, np.int64, len(live))
    idx = np.arange(M)
    entries = tables[slots]                                                  # [L, G, M]
    holders = np.bincount(entries[(idx < lens[slots][..., None]) & (entries > 0)], minlength=n)
    bad = np.flatnonzero(holders[1:] != ref[1:])
    assert not len(bad), f"block {bad[0] + 1}: ref count {ref[bad[0] + 1]}, held by {holders[bad[0] + 1]} entries"
    claims = np.bincount(pc.block_slot[pc.block_slot >= 0], minlength=pc.block.size)
    counted = (pc.block.reshape(-1) > 0).astype(np.int64) + pc.dups.reshape(-1)
    bad = np.flatnonzero(claims != counted)
    assert not len(bad), f"prefix-cache entry {bad[0]}: {counted[bad[0]]} blocks, claimed by {claims[bad[0]]}"
    heads = pc.block.reshape(-1)
    assert (pc.block_slot[heads[heads > 0]] == np.flatnonzero(heads > 0)).all(), "an entry's block is not under it"
    for g in range(G):  # each cached block a request holds in its cached prefix stands under its own hash
        row = entries[:, g]                                                  # [L, M]
        mine = (idx < cached[slots, g][:, None]) & (row > 0)
        mine &= pc.block_slot[row] >= 0
        keys = pc.keys[pc.block_slot[row] // G]                              # [L, M, 4]
        own = hashes[slots][:, np.asarray(layout.key_index(g, M))]           # [L, M, 4]
        bad = np.argwhere(mine & ~(keys == own).all(-1))
        assert not len(bad), f"slot {slots[bad[0][0]]} group {g}: block {row[tuple(bad[0])]} under another hash"


class SoakRequest:
    """One request of the allocator soak, on the host: its tokens, where it stands, when it stops."""

    def __init__(self, rid: str, prompt: list[int], target: int):
        self.rid, self.tokens, self.prompt_len, self.target = rid, prompt, len(prompt), target
        self.computed, self.running, self.preempt = 0, False, False  # preempt: at the next release


def allocator_soak(requests: int, slots: int, check_every: int, check_model: bool, seed: int) -> dict:
    """The allocator soak of the module docstring; its figures. Progress goes to stderr every 30 s."""
    import jax
    import jax.numpy as jnp

    from hkv_jax.allocator import ops
    from hkv_jax.allocator.pymodel import PyAllocator
    from hkv_jax.allocator.state import Layout, init_state
    from hkv_jax.planner import plan

    max_len = 384
    layers = soak_layers()
    # 15% of what every slot at max_model_len would hold: requests wait and are preempted.
    config = plan(layers, block_size=BS, policy="vllm", num_blocks=2)
    per_request = sum(-(-max_len // g.block_size) for g in config.groups)
    config = plan(layers, block_size=BS, policy="vllm", num_blocks=int(0.15 * slots * per_request))
    layout = Layout.from_config(config, max_model_len=max_len, max_requests=slots)
    jit = functools.partial(jax.jit, static_argnums=0, donate_argnums=1)
    release, admit = jit(ops.release_batch), jit(ops.admit_batch)
    prefill = jit(functools.partial(ops.prefill_batch, fallback=True))
    decode = jit(functools.partial(ops.decode_step, fallback=True))
    schedule, append, new_step = jit(ops.schedule_batch), jit(ops.append_batch), jit(ops.new_step)
    model = PyAllocator(config, max_model_len=max_len) if check_model else None

    rng = random.Random(seed)
    prefixes = [[rng.randrange(1, 32000) for _ in range(rng.choice((16, 48, 96)))] for _ in range(6)]
    alloc = init_state(layout)
    live: dict[int, SoakRequest] = {}
    admitted = finished = aborted = preempted = ops_done = checks = hit_tokens = 0
    next_check, start, last_print = check_every, time.perf_counter(), time.perf_counter()
    rss_start, steady = rss_mb(), None
    free_m, pre_m = np.zeros(slots, bool), np.zeros(slots, bool)
    while admitted < requests or live:
        # Releases: finished and aborted requests are freed, preempted ones go back to waiting.
        free_m[:], pre_m[:] = False, False
        for slot, r in list(live.items()):
            if len(r.tokens) >= r.target or rng.random() < 0.002:
                free_m[slot] = True
                finished += len(r.tokens) >= r.target
                aborted += len(r.tokens) < r.target
                del live[slot]
                if model:
                    model.free(r.rid)
            elif r.running and (r.preempt or rng.random() < 0.003):  # out of blocks, or at random
                pre_m[slot] = True
                r.running, r.computed, r.preempt = False, 0, False
                preempted += 1
                if model:
                    model.preempt(r.rid)
        # Admissions into free slots, each prompt a shared prefix and its own tail.
        adm_slots, prompts, lens = np.full(slots, -1, np.int32), [], np.zeros(slots, np.int32)
        for slot in range(slots):
            if slot in live or admitted >= requests or rng.random() < 0.3:
                continue
            prompt = rng.choice(prefixes) + [rng.randrange(1, 32000) for _ in range(rng.randrange(1, 160))]
            r = SoakRequest(f"r{admitted}", prompt, min(max_len - 1, len(prompt) + rng.randrange(1, 17)))
            live[slot] = r
            adm_slots[len(prompts)], lens[len(prompts)] = slot, len(prompt)
            prompts.append(prompt)
            admitted += 1
            if model:
                model.add(r.rid, prompt)
        alloc = release(layout, alloc, jnp.asarray(free_m), jnp.asarray(pre_m))
        if prompts:
            total = int(lens.sum())
            flat = np.zeros(1 << (total - 1).bit_length(), np.int32)  # padded to a power of 2: few compiles
            flat[:total] = np.concatenate(prompts)
            alloc = admit(layout, alloc, jnp.asarray(adm_slots), jnp.asarray(flat), jnp.asarray(lens),
                          jnp.zeros(slots, jnp.uint32))
        ops_done += int(free_m.sum() + pre_m.sum()) + len(prompts)
        # One step: decoding lanes, running lanes with a chunk, then waiting lanes (the engine's order).
        lane_slots, want = np.zeros(slots, np.int32), np.zeros(slots, np.int32)
        kind = np.full(slots, -1)
        order = sorted(live, key=lambda s: (0 if live[s].running and len(live[s].tokens) - live[s].computed == 1
                                            else 1 if live[s].running else 2, s))
        for lane, slot in enumerate(order):
            r = live[slot]
            left = len(r.tokens) - r.computed
            lane_slots[lane], kind[lane] = slot, (0 if r.running and left == 1 else 1 if r.running else 2)
            want[lane] = 1 if kind[lane] == 0 else min(left, rng.choice((16, 32, 64, 160)))
        ls, wt = jnp.asarray(lane_slots), jnp.asarray(want)
        alloc = new_step(layout, alloc)
        if model:
            model.new_step()
        alloc, ok0, _ = decode(layout, alloc, ls, mask=jnp.asarray(kind == 0))
        alloc, ok1, _, _ = schedule(layout, alloc, ls, wt, jnp.asarray(kind == 1))
        alloc, ok2, _, hit, _ = prefill(layout, alloc, ls, wt, mask=jnp.asarray(kind == 2))
        hit_tokens += int(jnp.sum(jnp.where(ok2 & (kind == 2), hit, 0)))
        ok = np.asarray(jnp.where(kind == 0, ok0, jnp.where(kind == 1, ok1, ok2)))
        computed = np.asarray(alloc.num_computed)
        # Each lane whose known tokens are all computed samples one (a random token).
        sample = np.zeros(slots, bool)
        tokens = np.zeros(slots, np.int32)
        for lane, slot in enumerate(order):
            r = live[slot]
            if ok[lane]:
                r.running, r.computed = True, int(computed[slot])
                if r.computed == len(r.tokens):
                    sample[lane], tokens[lane] = True, rng.randrange(1, 32000)
            elif kind[lane] != 2:  # a running request that found no room: preempt one next round
                victim = max((s for s in live if live[s].running), key=lambda s: int(live[s].rid[1:]))
                live[victim].preempt = True
        if model:  # the same events, lane by lane in the same order
            for lane, slot in enumerate(order):
                r = live[slot]
                res = model.schedule(r.rid, int(want[lane]), int(tokens[lane]) if sample[lane] else None)
                assert res["ok"] == bool(ok[lane]), f"{r.rid}: the model says ok={res['ok']}"
        alloc = append(layout, alloc, ls, jnp.asarray(tokens), jnp.asarray(sample))
        for lane, slot in enumerate(order):
            if sample[lane]:
                live[slot].tokens.append(int(tokens[lane]))
        ops_done += len(order) + int(sample.sum())
        if ops_done >= next_check:
            check_pool(layout, alloc, live)
            if model:
                assert np.asarray(alloc.block_pool.free_queue.num_free) == model.num_free_blocks
                for slot, r in live.items():
                    assert int(np.asarray(alloc.num_computed)[slot]) == model.requests[r.rid].num_computed
            checks += 1
            next_check += check_every
        if steady is None and admitted >= requests // 10:  # the programs have compiled by now
            steady = time.perf_counter(), ops_done
        if time.perf_counter() - last_print > 30:
            last_print = time.perf_counter()
            print(f"  {admitted:,} requests admitted, {ops_done:,} operations, "
                  f"{ops_done / (last_print - start):,.0f} ops/s, {rss_mb():.0f} MiB", file=sys.stderr, flush=True)
    check_pool(layout, alloc, live)
    assert int(np.asarray(alloc.block_pool.free_queue.num_free)) == layout.num_blocks - 1, "blocks leaked"
    seconds = time.perf_counter() - start
    steady_seconds = time.perf_counter() - steady[0]
    return {"requests": admitted, "finished": finished, "aborted": aborted, "preemptions": preempted,
            "cache_hit_tokens": hit_tokens, "operations": ops_done, "checks": checks + 1,
            "seconds": round(seconds, 1), "ops_per_second": round((ops_done - steady[1]) / steady_seconds),
            "rss_mb_start": round(rss_start), "rss_mb_end": round(rss_mb()), "num_blocks": layout.num_blocks,
            "slots": slots, "model_checked": check_model}


# --- serve ----------------------------------------------------------------------------------------

CHAT_OVERHEAD = 64  # tokens a chat turn's format adds around the message (Gemma's: about 50 bytes)
WORDS = "the of and to in is was for on that with as by at from his her it an are were which this".split()


class Client:
    """One soak client: a bounded loop over its share of the requests against ``host:port``."""

    def __init__(self, port: int, count: int, seed: int, prefixes: list[str], latencies: list, tally: dict,
                 examples: list, lock: threading.Lock, max_len: int = 256):
        self.port, self.count, self.rng, self.prefixes = port, count, random.Random(seed), prefixes
        self.max_len = max_len  # the server's max_model_len: prompt + answer must fit
        self.latencies, self.tally, self.examples, self.lock = latencies, tally, examples, lock

    def _count(self, key: str) -> None:
        with self.lock:
            self.tally[key] = self.tally.get(key, 0) + 1

    def body(self) -> tuple[str, dict | bytes]:
        """A random request: (path, JSON object), or raw bytes for a malformed one."""
        rng = self.rng
        if rng.random() < 0.05:
            return "/v1/completions", rng.choice([b"{not json", b'{"prompt": 3}', b'{"prompt": "a", "max_tokens": -2}',
                                                  b'{"prompt": "a", "temperature": "hot"}', b"[]",
                                                  b'{"messages": "hi"}', b'{"prompt": "a", "n": 0}'])
        text = rng.choice(self.prefixes) + " " + " ".join(rng.choice(WORDS) for _ in range(rng.randrange(1, 8)))
        params = {"max_tokens": rng.randrange(1, min(24, self.max_len // 4)), "temperature": rng.choice((0, 0.7, 1.0)),
                  "stream": rng.random() < 0.5}
        for name, values in (("top_p", (0.5, 0.9)), ("top_k", (5, 40)), ("seed", (1, 7, 123)),
                             ("presence_penalty", (0.5,)), ("repetition_penalty", (1.1,)), ("min_p", (0.05,))):
            if rng.random() < 0.3:
                params[name] = rng.choice(values)
        if rng.random() < 0.2:
            params["n"] = rng.choice((2, 3))
        room = self.max_len - params["max_tokens"]  # characters, each at least one token
        if rng.random() < 0.3:
            text = text[:max(1, room - CHAT_OVERHEAD)]
            return "/v1/chat/completions", {"messages": [{"role": "user", "content": text}], **params}
        if rng.random() < 0.15:
            params.update(echo=True, logprobs=2, stream=False)
        return "/v1/completions", {"prompt": text[:room], **params}

    def run(self) -> None:
        for _ in range(self.count):
            path, body = self.body()
            raw = body if isinstance(body, bytes) else json.dumps(body).encode()
            stream = isinstance(body, dict) and body.get("stream")
            if stream and self.rng.random() < 0.10:
                self._leave(path, raw)
                continue
            start = time.perf_counter()
            conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=600)
            try:
                conn.request("POST", path, raw, {"Content-Type": "application/json"})
                resp = conn.getresponse()
                if resp.status >= 500:
                    self._count("errors_5xx")
                    continue
                if resp.status != 200:
                    answer = resp.read()
                    self._count("rejected" if isinstance(body, bytes) else "unexpected_4xx")
                    if not isinstance(body, bytes):
                        with self.lock:
                            self.examples.append(f"{json.dumps(body)[:200]} -> {answer.decode()[:200]}")
                    continue
                whole = self._read(resp, stream, body)
                self._count("whole" if whole else "incomplete")
                with self.lock:
                    self.latencies.append(time.perf_counter() - start)
            except (OSError, http.client.HTTPException, ValueError) as e:
                self._count(f"client_error {type(e).__name__}")
            finally:
                conn.close()

    def _leave(self, path: str, raw: bytes) -> None:
        """Send a streamed request, read until its first event, then go away (a reset connection)."""
        head = (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(raw)}\r\n\r\n").encode()
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=600) as sock:
                sock.sendall(head + raw)
                got = b""
                while b"data:" not in got:
                    chunk = sock.recv(4096)
                    if not chunk:
                        break
                    got += chunk
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            self._count("disconnected" if got.startswith(b"HTTP/1.1 200") else "disconnect_refused")
        except OSError as e:
            self._count(f"client_error {type(e).__name__}")

    @staticmethod
    def _read(resp, stream: bool, body: dict) -> bool:
        """Whether the answer is whole: a ``[DONE]`` after every choice finished (stream), or every choice
        with a finish reason (whole answer)."""
        n = body.get("n", 1)
        if not stream:
            choices = json.loads(resp.read()).get("choices", [])
            return len(choices) == n and all(c.get("finish_reason") for c in choices)
        finished, done = set(), False
        for line in resp:
            line = line.strip()
            if not line.startswith(b"data: "):
                continue
            if line == b"data: [DONE]":
                done = True
                break
            for c in json.loads(line[6:]).get("choices", []):
                if c.get("finish_reason"):
                    finished.add(c["index"])
        return done and len(finished) == n


def metrics(port: int) -> dict[str, float]:
    """``/metrics`` as name -> value (labelled series summed under their name)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    conn.request("GET", "/metrics")
    out: dict[str, float] = {}
    for line in conn.getresponse().read().decode().splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            name = name.split("{")[0]
            out[name] = out.get(name, 0.0) + float(value)
    conn.close()
    return out


def serve_soak(requests: int, clients: int, model: str, seed: int, port: int | None = None,
               host_cache: str | None = None) -> dict:
    """The serve soak of the module docstring; its figures. ``port``: soak the server already listening on
    127.0.0.1 there (its RSS is not measured) instead of starting ``hkv serve --model model``. Progress goes
    to stderr every 30 s."""
    server = log = None
    if port is None:
        port = _free_port()
        cmd = [sys.executable, "-m", "hkv_jax.cli", "serve", "--model", model, "--port", str(port),
               "--max-requests", "8"] + (["--host-cache", host_cache] if host_cache else [])
        log = tempfile.TemporaryFile("w+")  # the server's output (a pipe nobody reads would fill and block it)
        server = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, text=True)
    try:
        if server is not None:
            _wait_healthy(server, port, log)
        served = _get(port, "/v1/models")["data"][0]
        rng = random.Random(seed)
        # Prompts of at most 32 words, cut to fit the server's max_model_len with the answer.
        prefixes = [" ".join(rng.choice(WORDS) for _ in range(rng.randrange(8, 24))) for _ in range(5)]
        latencies, tally, examples, lock = [], {}, [], threading.Lock()
        shares = [requests // clients + (i < requests % clients) for i in range(clients)]
        clients_ = [Client(port, k, seed * 1000 + i, prefixes, latencies, tally, examples, lock,
                           served["max_model_len"]) for i, k in enumerate(shares)]
        threads = [threading.Thread(target=c.run, daemon=True) for c in clients_]
        rss, start = [], time.perf_counter()

        def sample():  # the server's RSS (a server this run started) and how many answers were in, every second
            while any(t.is_alive() for t in threads):
                with lock:
                    done = sum(tally.values())
                rss.append((done, rss_mb(server.pid) if server is not None else None))
                if len(rss) % 30 == 0:
                    print(f"  {done:,}/{requests:,} requests"
                          + (f", server {rss[-1][1]:.0f} MiB" if server is not None else ""), file=sys.stderr,
                          flush=True)
                time.sleep(1)

        for t in threads:
            t.start()
        sample()
        seconds = time.perf_counter() - start
        deadline = time.time() + 60  # aborts and the last steps settle
        while True:
            m = metrics(port)
            if (m["hkv_requests_running"] == 0 and m["hkv_requests_waiting"] == 0) or time.time() > deadline:
                break
            time.sleep(0.5)
        alive = server.poll() is None if server is not None else _get(port, "/health") == {"status": "ok"}
        first = last = None
        if server is not None:
            quarter = max(1, len(rss) // 4)
            first = float(np.mean([r for _, r in rss[:quarter]])) if rss else rss_mb(server.pid)
            last = float(np.mean([r for _, r in rss[-quarter:]])) if rss else rss_mb(server.pid)
        lat = np.asarray(latencies) * 1000
        return {"requests": requests, "clients": clients, "model": served["id"],
                "leaked_blocks": int(m["hkv_kv_blocks"] - m["hkv_kv_blocks_free"]),
                **({"host_hit_tokens": int(m["hkv_host_cache_hit_tokens_total"]),
                    "host_used_bytes": int(m["hkv_host_cache_used_bytes"])} if "hkv_host_cache_bytes" in m else {}),
                "running_at_end": int(m["hkv_requests_running"]), "waiting_at_end": int(m["hkv_requests_waiting"]),
                "errors_5xx": tally.get("errors_5xx", 0), "incomplete": tally.get("incomplete", 0),
                "server_alive": alive, "outcomes": dict(sorted(tally.items())),
                "unexpected_4xx_examples": examples[:5],
                "latency_p50_ms": round(float(np.percentile(lat, 50)), 1) if len(lat) else None,
                "latency_p99_ms": round(float(np.percentile(lat, 99)), 1) if len(lat) else None,
                "rss_mb_start": None if first is None else round(first),
                "rss_mb_end": None if last is None else round(last), "seconds": round(seconds, 1)}
    finally:
        if server is not None:
            server.send_signal(signal.SIGINT)
            try:
                server.wait(30)
            except subprocess.TimeoutExpired:
                server.kill()
            log.close()


def _get(port: int, path: str) -> dict:
    """A GET of ``path`` from the server on 127.0.0.1:``port``, as JSON."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        conn.request("GET", path)
        return json.loads(conn.getresponse().read())
    finally:
        conn.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_healthy(server: subprocess.Popen, port: int, log, timeout: float = 600) -> None:
    """Wait for ``/health`` (the server compiles its programs first); ``RuntimeError`` if it exits."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if server.poll() is not None:
            log.seek(0)
            raise RuntimeError(f"hkv serve exited ({server.returncode}): {log.read()[-2000:]}")
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
            conn.request("GET", "/health")
            if conn.getresponse().status == 200:
                return
        except OSError:
            time.sleep(0.5)
    raise RuntimeError(f"hkv serve did not answer /health within {timeout:.0f} s")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument("--allocator", action="store_true", help="soak the jitted allocator ops")
    mode.add_argument("--serve", action="store_true", help="soak hkv serve over HTTP")
    p.add_argument("--requests", type=int, default=10_000)
    p.add_argument("--slots", type=int, default=128, help="--allocator: requests held at once")
    p.add_argument("--check-every", type=int, default=10_000, help="--allocator: operations between checks")
    p.add_argument("--check-model", action="store_true", help="--allocator: drive the plain-Python model too")
    p.add_argument("--clients", type=int, default=8, help="--serve: concurrent clients")
    p.add_argument("--model", default="tiny-gptoss", help="--serve: the model hkv serve runs")
    p.add_argument("--port", type=int, help="--serve: soak the server already on 127.0.0.1:PORT instead")
    p.add_argument("--host-cache", help="--serve: the server's host tier (hkv serve --host-cache), e.g. 64MiB")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    for name in ("requests", "slots", "check_every", "clients"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.allocator:
        out = allocator_soak(args.requests, args.slots, args.check_every, args.check_model, args.seed)
        ok = True
    else:
        out = serve_soak(args.requests, args.clients, args.model, args.seed, args.port, args.host_cache)
        ok = (out["leaked_blocks"] == 0 and out["errors_5xx"] == 0 and out["server_alive"]
              and out["incomplete"] == 0 and out["running_at_end"] == 0 and out["waiting_at_end"] == 0
              and not out["outcomes"].get("unexpected_4xx")
              and (out["rss_mb_end"] is None or out["rss_mb_end"] < 1.1 * out["rss_mb_start"]))
    if args.json:
        print(json.dumps(out))
    else:
        for k, v in out.items():
            print(f"{k:>16}: {v}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
