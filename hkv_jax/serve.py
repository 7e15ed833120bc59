"""``hkv serve``: OpenAI-style completion endpoints over one engine, on the standard library's HTTP
server (nothing more to install).

- ``POST /v1/completions``: ``prompt`` (text, or a list of token ids), ``max_tokens`` (default 16),
  ``temperature`` (default 1, as OpenAI's), ``top_p``, ``top_k``, ``min_p``, ``seed``, ``stop`` (a string
  or a list of them), ``presence_penalty``, ``frequency_penalty``, ``repetition_penalty``, ``logprobs``
  (how many likeliest tokens to list per generated token, at most the engine's ``max_top_logprobs``) and
  ``stream`` (server-sent events, ``data: [DONE]`` last). The answer has ``choices[0]`` (``text``,
  ``finish_reason``, ``logprobs``) and ``usage``. A client that goes away mid-stream is aborted.
- ``POST /v1/chat/completions``: the same with ``messages`` (in Gemma's turn format, ``gemma_chat``)
  instead of ``prompt``, ``max_completion_tokens`` or ``max_tokens`` (default: up to the engine's
  ``max_model_len``), and ``logprobs: true`` with ``top_logprobs``; the answer's ``choices[0].message``
  (a stream's ``delta``) holds the text.
- ``GET /v1/models``, ``GET /health``.

One thread owns the engine. Between steps it takes the requests the HTTP threads queued (and the aborts
of clients that went away); it steps while there is work and hands each request's new text to the
thread serving it. Bad input gets status 400 and OpenAI's error object, and nothing is queued.
"""

from __future__ import annotations

import json
import queue
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from hkv_jax.engine import Engine
from hkv_jax.models.tokenizer import gemma_chat

# Request fields given to ``Engine.add_request`` as they are (absent: the engine's value).
_SAMPLING = ("top_p", "top_k", "min_p", "seed", "presence_penalty", "frequency_penalty", "repetition_penalty")
# OpenAI fields with one value only here.
_FIXED = {"n": 1, "best_of": 1, "echo": False, "suffix": None}


class BadRequest(ValueError):
    """A request the server refuses (status 400)."""


@dataclass
class _Served:
    """What the engine thread keeps of one request it serves."""

    replies: queue.Queue  # its updates, for the HTTP thread; the last one has "finish_reason" or "error"
    top: int | None       # likeliest tokens listed per token; None: no log-probabilities
    shown: int = 0        # characters of its text sent
    sent: int = 0         # tokens whose log-probabilities were sent


class CompletionServer:
    """``engine`` served over HTTP; ``codec`` encodes text prompts and decodes answers (``encode``,
    ``decode``, ``eos_ids``: a ``TextCodec`` or ``ByteCodec``). ``start`` returns the address bound."""

    def __init__(self, engine: Engine, codec, model_name: str):
        self.engine, self.codec, self.model_name = engine, codec, model_name
        if engine.detokenize is None:
            engine.detokenize = codec.decode
        self._inbox: queue.Queue = queue.Queue()
        self._served: dict[int, _Served] = {}
        self._stopping = threading.Event()
        self._http: ThreadingHTTPServer | None = None
        self._threads: list[threading.Thread] = []

    def start(self, host: str = "127.0.0.1", port: int = 8000, warm: bool = False) -> tuple[str, int]:
        """Serve in background threads; returns ``(host, port)`` (``port=0``: any free port). ``warm``: once
        the port is bound, compile the step programs (``warm_up``) before taking requests."""
        self._http = ThreadingHTTPServer((host, port), _handler(self))
        self._http.daemon_threads = True
        if warm:
            warm_up(self.engine)
        self._threads = [threading.Thread(target=self._run_engine, name="hkv-engine", daemon=True),
                         threading.Thread(target=self._http.serve_forever, name="hkv-http", daemon=True)]
        for t in self._threads:
            t.start()
        return self._http.server_address[:2]

    def stop(self) -> None:
        """Stop serving (requests still running get no more tokens)."""
        self._stopping.set()
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
        for t in self._threads:
            t.join()

    # --- HTTP threads ----------------------------------------------------------------------

    def submit(self, body, chat: bool = False) -> tuple[queue.Queue, int | None]:
        """Queue the completion request ``body`` (parsed JSON; ``chat``: a chat completion). Returns the
        queue its updates arrive on (first ``{"id": rid, "prompt_tokens": n}`` or ``{"error": message}``)
        and how many likeliest tokens it lists (None: no log-probabilities). ``ValueError`` (``BadRequest``)
        for malformed fields."""
        if not isinstance(body, dict):
            raise BadRequest("the body must be a JSON object")
        for name, value in _FIXED.items():
            if body.get(name, value) != value:
                raise BadRequest(f"{name} must be {json.dumps(value)} here")
        prompt = body.get("prompt")
        if chat:
            ids = self.codec.encode(gemma_chat(body.get("messages")))
        elif isinstance(prompt, str) and prompt:
            ids = self.codec.encode(prompt)
        elif isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
            ids = prompt
        else:
            raise BadRequest("prompt must be a non-empty string or a list of token ids")
        if chat:  # by default, up to the longest request, as vLLM's chat completions
            max_tokens = body.get("max_completion_tokens", body.get("max_tokens",
                                                                    max(self.engine.layout.max_model_len - len(ids), 1)))
        else:
            max_tokens = body.get("max_tokens", 16)
        if type(max_tokens) is not int or max_tokens < 1:
            raise BadRequest(f"max_tokens must be a positive integer, got {max_tokens!r}")
        stop = body.get("stop") or ()
        stop = (stop,) if isinstance(stop, str) else stop
        if not isinstance(stop, list | tuple) or not all(isinstance(s, str) for s in stop):
            raise BadRequest("stop must be a string or a list of strings")
        if chat:  # logprobs: true, and top_logprobs likeliest tokens (0 by default)
            if type(body.get("logprobs", False)) is not bool:
                raise BadRequest("logprobs must be true or false")
            top, name = body.get("top_logprobs", 0) if body.get("logprobs") else None, "top_logprobs"
        else:
            top, name = body.get("logprobs"), "logprobs"
        if top is not None and (type(top) is not int or not 0 <= top <= self.engine.max_top_logprobs):
            raise BadRequest(f"{name} must be an integer in [0, {self.engine.max_top_logprobs}], got {top!r}")
        request = {"prompt": ids, "max_new_tokens": max_tokens, "stop": tuple(self.codec.eos_ids),
                   "stop_strings": tuple(stop), "temperature": body.get("temperature", 1.0),
                   "logprobs": top is not None, "top_logprobs": top or 0,
                   **{name: body[name] for name in _SAMPLING if name in body}}
        replies: queue.Queue = queue.Queue()
        self._inbox.put(("add", request, _Served(replies, top)))
        return replies, top

    def abort(self, rid: int) -> None:
        """End request ``rid`` (its client went away)."""
        self._inbox.put(("abort", rid))

    # --- the engine thread -----------------------------------------------------------------

    def _run_engine(self) -> None:
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
        """Apply one queued item: a new request or an abort."""
        if item[0] == "abort":
            if self._served.pop(item[1], None) is not None:
                self.engine.abort(item[1])
                self.engine.forget(item[1])
            return
        _, request, served = item
        try:
            rid = self.engine.add_request(request.pop("prompt"), request.pop("max_new_tokens"), **request)
        except Exception as e:  # noqa: BLE001 - a request the engine refuses (bad values): its client hears why
            served.replies.put({"error": str(e)})
            return
        self._served[rid] = served
        served.replies.put({"id": rid, "prompt_tokens": self.engine.requests[rid].prompt_len})

    def _update(self, rid: int) -> None:
        """Send request ``rid``'s new text (and log-probabilities) to its HTTP thread."""
        served, r = self._served[rid], self.engine.requests[rid]
        text = self.engine.text(rid, stable=True)
        update = {"text": text[served.shown:]}
        served.shown = max(served.shown, len(text))
        if served.top is not None:
            update["logprobs"] = self._logprobs(served, r)
        if r.done:
            update |= {"finish_reason": r.finish_reason, "completion_tokens": len(r.generated)}
            del self._served[rid]
            self.engine.forget(rid)
        served.replies.put(update)

    def _logprobs(self, served: _Served, r) -> list:
        """``(text, log-probability, [(text, log-probability)] of the likeliest)`` per token of ``r`` not
        sent yet."""
        decode = self.codec.decode
        new = range(served.sent, len(r.generated))
        served.sent = len(r.generated)
        return [(decode([r.generated[i]]), r.logprobs[i],
                 [(decode([t]), v) for t, v in r.top_logprobs[i]] if served.top else []) for i in new]


class _Answer:
    """OpenAI's answer objects for one request: a completion, or a chat completion (``chat``)."""

    def __init__(self, chat: bool, rid: int, model: str, top: int | None):
        self.chat, self.top, self.offset = chat, top, 0
        self.head = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{rid}", "created": int(time.time()), "model": model}

    def logprobs(self, entries: list | None):
        """The ``logprobs`` object of ``entries`` (``CompletionServer._logprobs``), in this kind's format."""
        if self.top is None or entries is None:
            return None
        if self.chat:
            def item(t, v):
                return {"token": t, "logprob": v, "bytes": list(t.encode())}

            return {"content": [{**item(t, v), "top_logprobs": [item(*x) for x in top]} for t, v, top in entries]}
        offsets = []
        for t, _, _ in entries:
            offsets.append(self.offset)
            self.offset += len(t)
        # Tokens with the same text (bytes of an incomplete character) share a key: the likeliest keeps it.
        return {"tokens": [t for t, _, _ in entries], "token_logprobs": [v for _, v, _ in entries],
                "top_logprobs": [dict(reversed(top)) for _, _, top in entries] if self.top else None,
                "text_offset": offsets}

    def whole(self, text: str, entries: list | None, finish: str, usage: dict) -> dict:
        """The answer to a request that does not stream."""
        body = {"message": {"role": "assistant", "content": text}} if self.chat else {"text": text}
        return {**self.head, "object": "chat.completion" if self.chat else "text_completion",
                "choices": [{"index": 0, **body, "logprobs": self.logprobs(entries), "finish_reason": finish}],
                "usage": usage}

    def chunk(self, text: str, entries: list | None, finish: str | None, first: bool = False) -> dict:
        """One event of a stream (a chat stream's first names the role)."""
        if self.chat:
            body = {"delta": ({"role": "assistant"} if first else {}) | ({"content": text} if text or first else {})}
        else:
            body = {"text": text}
        return {**self.head, "object": "chat.completion.chunk" if self.chat else "text_completion",
                "choices": [{"index": 0, **body, "logprobs": self.logprobs(entries), "finish_reason": finish}]}


def _handler(server: CompletionServer) -> type[BaseHTTPRequestHandler]:
    """The request handler class of ``server``'s HTTP server."""

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format, *args):  # noqa: A002 - quiet: one line per request is noise here
            pass

        def _json(self, status: int, obj) -> None:
            body = json.dumps(obj).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def _error(self, status: int, message: str) -> None:
            kind = "invalid_request_error" if status < 500 else "server_error"
            self._json(status, {"error": {"message": message, "type": kind, "code": status}})

        def do_GET(self):  # noqa: N802 - http.server's name
            if self.path == "/health":
                self._json(200, {"status": "ok"})
            elif self.path == "/v1/models":
                self._json(200, {"object": "list", "data": [{
                    "id": server.model_name, "object": "model", "owned_by": "hkv-jax",
                    "max_model_len": server.engine.layout.max_model_len}]})
            else:
                self._error(404, f"no such path: {self.path}")

        def do_POST(self):  # noqa: N802
            chat = {"/v1/completions": False, "/v1/chat/completions": True}.get(self.path)
            if chat is None:
                self._error(404, f"no such path: {self.path}")
                return
            try:
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"null")
                replies, top = server.submit(body, chat)
            except ValueError as e:  # malformed JSON or fields
                self._error(400, str(e))
                return
            first = replies.get()
            if "error" in first:
                self._error(400, first["error"])
                return
            answer = _Answer(chat, first["id"], server.model_name, top)
            if body.get("stream"):
                self._stream(first["id"], answer, replies)
            else:
                self._whole(first, answer, replies)

        def _whole(self, first: dict, answer: _Answer, replies: queue.Queue) -> None:
            text, entries = [], []
            while True:
                u = replies.get()
                if "error" in u:
                    self._error(500, u["error"])
                    return
                text.append(u["text"])
                entries += u.get("logprobs", [])
                if "finish_reason" in u:
                    break
            n, m = first["prompt_tokens"], u["completion_tokens"]
            usage = {"prompt_tokens": n, "completion_tokens": m, "total_tokens": n + m}
            self._json(200, answer.whole("".join(text), entries, u["finish_reason"], usage))

        def _stream(self, rid: int, answer: _Answer, replies: queue.Queue) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Cache-Control", "no-cache")
            self.send_header("Connection", "close")
            self.end_headers()
            self.close_connection = True
            try:
                if answer.chat:
                    self._event(answer.chunk("", None, None, first=True))
                while True:
                    u = replies.get()
                    if "error" in u:
                        self._event({"error": {"message": u["error"], "type": "server_error"}})
                        break
                    done = "finish_reason" in u
                    if u["text"] or u.get("logprobs") or done:
                        self._event(answer.chunk(u["text"], u.get("logprobs"), u.get("finish_reason")))
                    if done:
                        break
                self.wfile.write(b"data: [DONE]\n\n")
                self.wfile.flush()
            except (BrokenPipeError, ConnectionResetError):
                server.abort(rid)

        def _event(self, obj) -> None:
            self.wfile.write(b"data: " + json.dumps(obj).encode() + b"\n\n")
            self.wfile.flush()

    return Handler


def warm_up(engine: Engine) -> None:
    """Compile the step programs a server needs before the first client waits for them: one request long
    enough for the largest token bucket, then decode steps (the smallest bucket, and its lean step)."""
    prompt = [0] * min(engine.token_budget, engine.layout.max_model_len - 4)
    rid = engine.add_request(prompt, 4)
    engine.run()
    engine.forget(rid)
