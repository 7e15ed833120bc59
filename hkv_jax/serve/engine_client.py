"""``EngineClient``: the thread that owns a serving engine (vLLM's ``AsyncLLM`` role), apart from HTTP.

HTTP threads hand it parsed requests, aborts and metrics reads through one queue. Between steps it takes
them all; it steps while there is work and sends each request's new text (and log-probabilities) to the
queue of the thread that serves it. Only the engine's public API is used, and only from its own thread.
"""

from __future__ import annotations

import queue
import threading
from collections import Counter
from dataclasses import dataclass

from hkv_jax.engine import Engine
from hkv_jax.serve.metrics import prometheus_text
from hkv_jax.serve.protocol import CompletionRequest


@dataclass
class _Served:
    """An engine request a client waits for."""

    replies: queue.Queue  # where its updates go
    top: int | None       # its log-probabilities: None (none), 0 (the token's own) or the likeliest count
    index: int            # its choice's index in the answer
    shown: int = 0        # characters of its text sent
    sent: int = 0         # tokens whose log-probabilities were sent


def log_entry(codec, token: int, logprob: float | None, likeliest: list | None) -> tuple:
    """One token's log-probability entry: ``(text, log-probability, [(text, log-probability)] of the
    likeliest tokens)`` (None: none listed)."""
    decode = codec.decode
    return decode([token]), logprob, None if likeliest is None else [(decode([u]), w) for u, w in likeliest]


class EngineClient:
    """Owns ``engine`` in a thread of its own once ``start``ed; ``codec`` decodes log-probability entries."""

    def __init__(self, engine: Engine, codec):
        self.engine, self.codec = engine, codec
        self._inbox: queue.Queue = queue.Queue()
        self._served: dict[int, _Served] = {}
        # For /metrics: tokens of the prompts taken and of the text sent, finished choices per finish reason.
        self._counts = {"prompt": 0, "generation": 0, "finished": Counter()}
        self._answers = 0  # answers begun: each one's id
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Start the engine thread."""
        self._thread = threading.Thread(target=self._run, name="hkv-engine", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop the engine thread (requests still running get no more tokens)."""
        self._stopping.set()
        if self._thread is not None:
            self._thread.join()

    # --- what other threads call ------------------------------------------------------------

    def add(self, request: CompletionRequest, echoed: list | None) -> queue.Queue:
        """Queue ``request`` (``echoed``: each prompt's echo, or None); returns the queue its updates arrive
        on (``CompletionServer.submit`` says what they hold)."""
        replies: queue.Queue = queue.Queue()
        self._inbox.put(("add", request, replies, echoed))
        return replies

    def abort(self, rids: list[int]) -> None:
        """End the requests ``rids`` (their client went away)."""
        self._inbox.put(("abort", rids))

    def metrics(self) -> str:
        """The engine's gauges and counters in Prometheus' text format, read between two steps."""
        answer: queue.Queue = queue.Queue()
        self._inbox.put(("metrics", answer))
        return answer.get()

    # --- the engine thread -----------------------------------------------------------------

    def _run(self) -> None:
        engine = self.engine
        while not self._stopping.is_set():
            try:  # wait for requests only while there is nothing to step
                item = self._inbox.get(timeout=1e-9 if engine.has_work else 0.05)
                while True:
                    self._take(item)
                    item = self._inbox.get_nowait()
            except queue.Empty:
                pass
            if not engine.has_work:
                continue
            try:
                events = engine.step()
            except Exception as e:  # noqa: BLE001 - every client hears of it, the thread goes on
                for rid, served in list(self._served.items()):
                    served.replies.put({"error": f"engine error: {e}"})
                    engine.abort(rid)
                    engine.forget(rid)
                self._served.clear()
                continue
            for rid in dict.fromkeys(rid for rid, _ in events):
                if rid in self._served:
                    self._update(rid)

    def _take(self, item) -> None:
        """Apply one queued item: a new request (``n`` choices per prompt, prompt by prompt), an abort, or a
        metrics read."""
        if item[0] == "metrics":
            item[1].put(prometheus_text(self.engine.stats, self.engine.kv_usage(), self._counts,
                                        self.engine.host_usage()))
            return
        if item[0] == "abort":
            running = [rid for rid in item[1] if self._served.pop(rid, None) is not None]
            self._drop(running)
            self._counts["finished"]["abort"] += len(running)
            return
        _, request, replies, echoed = item  # echoed: each prompt's echo, or None
        rids = []
        try:
            for prompt in request.prompts:
                for i in range(request.n if request.params else 0):  # echo with max_tokens 0: the prompts only
                    rids.append(self.engine.add_request(prompt, request.choice_params(i)))
        except Exception as e:  # noqa: BLE001 - a request the engine refuses (bad values): its client hears why
            self._drop(rids)
            replies.put({"error": str(e)})
            return
        for i, rid in enumerate(rids):
            self._served[rid] = _Served(replies, request.top, i)
        n, tokens = request.n, sum(map(len, request.prompts))
        self._counts["prompt"] += n * tokens
        if not request.params:
            self._counts["finished"]["length"] += n * len(request.prompts)
        self._answers += 1
        replies.put({"id": self._answers, "ids": rids, "choices": n * len(request.prompts), "prompt_tokens": tokens,
                     "echo": None if echoed is None else [e for e in echoed for _ in range(n)]})

    def _drop(self, rids: list[int]) -> None:
        """Abort and forget engine requests no client waits for."""
        for rid in rids:
            self.engine.abort(rid)
            self.engine.forget(rid)

    def _update(self, rid: int) -> None:
        """Send request ``rid``'s new text (and log-probabilities) to its HTTP thread."""
        served, r = self._served[rid], self.engine.requests[rid]
        text = self.engine.text(rid, stable=True)
        update = {"index": served.index, "text": text[served.shown:]}
        served.shown = max(served.shown, len(text))
        if served.top is not None:
            update["logprobs"] = self._logprobs(served, r)
        if r.done:
            update |= {"finish_reason": r.finish_reason, "completion_tokens": len(r.generated)}
            self._counts["finished"][r.finish_reason] += 1
            self._counts["generation"] += len(r.generated)
            del self._served[rid]
            self.engine.forget(rid)
        served.replies.put(update)

    def _logprobs(self, served: _Served, r) -> list:
        """The entries (``log_entry``) of ``r``'s tokens not sent yet."""
        new = range(served.sent, len(r.generated))
        served.sent = len(r.generated)
        return [log_entry(self.codec, r.generated[i], r.logprobs[i], r.top_logprobs[i] if served.top else [])
                for i in new]
