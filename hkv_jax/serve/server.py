"""``hkv serve``: OpenAI-style completion endpoints over one engine, on the standard library's HTTP
server (nothing more to install).

- ``POST /v1/completions``: ``prompt`` (text, a list of token ids, or a list of either: a batch),
  ``max_tokens`` (default 16), ``temperature`` (default 1, as OpenAI's), ``top_p``, ``top_k``,
  ``min_p``, ``seed``, ``stop`` (a string or a list of them), ``presence_penalty``,
  ``frequency_penalty``, ``repetition_penalty``, ``logprobs`` (how many likeliest tokens to list per
  generated token, at most the engine's ``max_top_logprobs``), ``logit_bias`` (token id -> value in
  [-100, 100], at most the engine's ``max_logit_bias`` entries), ``min_tokens`` (vLLM's: no stop before
  that many tokens; each EOS id takes a bias entry), ``n`` (choices per prompt, each its own engine
  request; with a ``seed``, choice ``i`` samples with ``seed + i``, as vLLM's; a batch gets ``n``
  choices per prompt, prompt by prompt) and ``stream`` (server-sent events, ``data: [DONE]`` last;
  ``stream_options: {"include_usage": true}`` adds a last event with the usage). ``echo: true`` puts
  each prompt before its choices' text and, with ``logprobs``, its tokens' log-probabilities (the first
  token's is null) before theirs (``Engine.prompt_logprobs``); with ``max_tokens: 0`` that is the whole
  answer. That is how evaluation harnesses score a continuation (lm-eval's ``local-completions``).
  The answer has ``choices`` (``index``, ``text``, ``finish_reason``, ``logprobs``) and ``usage``. A
  client that goes away before its answer is complete is aborted.
- ``POST /v1/chat/completions``: the same with ``messages`` (rendered with the model's own chat template,
  ``protocol.ChatTemplate``; Gemma's turn format for models without one) instead of ``prompt``,
  ``max_completion_tokens`` or ``max_tokens`` (default: up to the engine's ``max_model_len``), and
  ``logprobs: true`` with ``top_logprobs``; each answer choice's ``message`` (a stream's ``delta``) holds
  the text.
- ``POST /tokenize`` (``prompt``, or chat ``messages``; ``add_special_tokens``, default true: the BOS) and
  ``POST /detokenize`` (``tokens``), as vLLM's: the server's own tokenizer, for clients without it.
- ``GET /v1/models``, ``GET /health``, and ``GET /metrics``: Prometheus' text format (``hkv_`` gauges of
  the requests running and waiting and of the KV pool's free blocks, counters of tokens, prefix-cache
  hits, preemptions, steps and finished requests by finish reason).

With an API key (``CompletionServer(..., api_key=)``, ``hkv serve --api-key`` or ``HKV_API_KEY``) every
``/v1/`` path wants ``Authorization: Bearer <key>`` (status 401 otherwise, as OpenAI's); ``/health`` and
``/metrics`` stay open, as vLLM's. There is no TLS: put a proxy in front to serve beyond the host.

This module is the HTTP layer; ``engine_client.py`` holds the thread that owns the engine (it takes the
requests the HTTP threads queue between steps and hands each request's new text to the thread serving it),
``metrics.py`` the Prometheus text and ``protocol.py`` the parsing of bodies into ``SamplingParams`` and
OpenAI's answer objects. ``echo``'s prompt log-probabilities are computed in the client's own thread (they
read only the parameters), so a long prompt does not hold up the steps. Bad input gets status 400 and
OpenAI's error object, and nothing is queued. A field given as ``null`` counts as absent, as in OpenAI's API.
"""

from __future__ import annotations

import hmac
import json
import queue
import select
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from hkv_jax.engine import Engine
from hkv_jax.serve.engine_client import EngineClient, log_entry
from hkv_jax.serve.protocol import Answer, BadRequest, ChatTemplate, CompletionRequest, Limits, parse, usage

# How long a request that does not stream waits for an update before it checks that its client still waits.
_CHECK_SECONDS = 0.5


class CompletionServer:
    """``engine`` served over HTTP; ``codec`` encodes text prompts and decodes answers (``encode``,
    ``decode``, ``eos_ids``: a ``TextCodec`` or ``ByteCodec``); ``api_key``: the bearer token ``/v1/``
    paths want (None: none). ``start`` returns the address bound."""

    def __init__(self, engine: Engine, codec, model_name: str, api_key: str | None = None):
        if api_key is not None and (not isinstance(api_key, str) or not api_key.strip()):
            raise ValueError("api_key must be a non-empty string (or None: no key)")
        self.engine, self.codec, self.model_name, self.api_key = engine, codec, model_name, api_key
        if engine.detokenize is None:
            engine.detokenize = codec.decode
        self.chat_template = ChatTemplate(codec)
        c = engine.config
        self.limits = Limits(c.max_requests, c.max_model_len, c.max_top_logprobs)
        self.client = EngineClient(engine, codec)
        self._http: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    def start(self, host: str = "127.0.0.1", port: int = 8000, warm: bool = False) -> tuple[str, int]:
        """Serve in background threads; returns ``(host, port)`` (``port=0``: any free port). ``warm``: once
        the port is bound, compile the step programs (``warm_up``) before taking requests."""
        self._http = _HTTPServer((host, port), _handler(self))
        if warm:
            warm_up(self.engine)
            self.engine.reset_stats()  # the metrics count what clients asked for, not the warm-up
        self.client.start()
        self._thread = threading.Thread(target=self._http.serve_forever, name="hkv-http", daemon=True)
        self._thread.start()
        return self._http.server_address[:2]

    def stop(self) -> None:
        """Stop serving (requests still running get no more tokens)."""
        self.client.stop()
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
        if self._thread is not None:
            self._thread.join()

    # --- HTTP threads ----------------------------------------------------------------------

    def submit(self, body, chat: bool = False) -> tuple[queue.Queue, CompletionRequest]:
        """Queue the completion request ``body`` (parsed JSON; ``chat``: a chat completion). Returns the
        queue its updates arrive on and the parsed request. The first update is ``{"error": message}`` or
        ``{"id": the answer's number, "ids": [engine request id per choice] (none for echo alone),
        "choices": count, "prompt_tokens": count, "echo": None or (text, log-probability entries) per
        choice}``; then come each choice's pieces of text with its ``index``. ``ValueError``
        (``BadRequest``) for malformed fields."""
        request = parse(body, chat, self.codec, self.chat_template, self.limits)
        # Scored here, in the client's thread: a long prompt's forward does not hold up the engine's steps.
        echoed = ([self._echo(p, text, request.top) for p, text in zip(request.prompts, request.texts)]
                  if request.echo else None)
        return self.client.add(request, echoed), request

    def _echo(self, prompt: list[int], text: str | None, top: int | None) -> tuple[str, list]:
        """What ``echo`` puts before each choice's answer: the prompt's ``text`` (None: its tokens' text)
        and, when the request asks for log-probabilities, its tokens' entries (``log_entry``; the first
        token has no log-probability and no likeliest tokens). ``ValueError`` for a prompt the engine
        refuses. It reads only the engine's parameters, so any thread may call it."""
        if top is None:
            self.engine.check_prompt(prompt)  # echo alone adds no engine request, which would check it
            entries = []
        else:  # prompt_logprobs checks the prompt
            scored = self.engine.prompt_logprobs(prompt, top)
            entries = [log_entry(self.codec, prompt[0], None, None)]
            entries += [log_entry(self.codec, t, v, likeliest) for t, (v, likeliest) in zip(prompt[1:], scored[1:])]
        return self.codec.decode(prompt) if text is None else text, entries

    def tokenize(self, body) -> dict:
        """``POST /tokenize``: the token ids of ``prompt`` (text), or of chat ``messages`` in the chat format;
        ``add_special_tokens`` (default true) puts the BOS first. ``BadRequest`` for a malformed body."""
        if not isinstance(body, dict) or ("prompt" in body) == ("messages" in body):
            raise BadRequest("tokenize wants an object with a prompt or messages")
        special = body.get("add_special_tokens", True)
        if type(special) is not bool or not isinstance(body.get("prompt", ""), str):
            raise BadRequest("prompt must be a string, add_special_tokens true or false")
        if "messages" in body:
            tokens = self.chat_template.encode(body["messages"], bos=special)
        else:
            tokens = self.codec.encode(body["prompt"], bos=special)
        return {"tokens": tokens, "count": len(tokens), "max_model_len": self.limits.max_model_len}

    def detokenize(self, body) -> dict:
        """``POST /detokenize``: the text of ``tokens`` (ids in the vocabulary). ``BadRequest`` otherwise."""
        tokens = body.get("tokens") if isinstance(body, dict) else None
        vocab = self.engine.vocab_size
        if not isinstance(tokens, list) or not all(type(t) is int and 0 <= t < vocab for t in tokens):
            raise BadRequest(f"detokenize wants tokens: a list of ids in [0, {vocab})")
        return {"prompt": self.codec.decode(tokens)}

    def abort(self, rids: list[int]) -> None:
        """End the requests ``rids`` (their client went away)."""
        self.client.abort(rids)

    def metrics(self) -> str:
        """The engine's gauges and counters in Prometheus' text format, read between two steps."""
        return self.client.metrics()


class _HTTPServer(ThreadingHTTPServer):
    """One thread per connection; the kernel holds up to 1,024 connections not accepted yet (socketserver's
    default of 5 resets clients when a few dozen connect at once)."""

    daemon_threads = True
    request_queue_size = 1024


def _handler(server: CompletionServer) -> type[BaseHTTPRequestHandler]:
    """The request handler class of ``server``'s HTTP server."""

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format, *args):  # noqa: A002 - quiet: one line per request is noise here
            pass

        def _json(self, status: int, obj) -> None:
            self._send(status, json.dumps(obj).encode(), "application/json")

        def _send(self, status: int, body: bytes, content_type: str) -> None:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def _error(self, status: int, message: str) -> None:
            kind = "invalid_request_error" if status < 500 else "server_error"
            self._json(status, {"error": {"message": message, "type": kind, "code": status}})

        def _refused(self) -> bool:
            """Answer 401 to a ``/v1/`` request without the server's API key (compared in constant time)."""
            key = server.api_key
            if key is None or not self.path.startswith("/v1/"):
                return False
            given = self.headers.get("Authorization", "")
            if hmac.compare_digest(given.encode(), f"Bearer {key}".encode()):
                return False
            self.close_connection = True  # its body is left unread
            self._json(401, {"error": {"message": "a valid API key is needed (Authorization: Bearer <key>)",
                                       "type": "invalid_request_error", "code": "invalid_api_key"}})
            return True

        def do_GET(self):  # noqa: N802 - http.server's name
            if self._refused():
                return
            if self.path == "/health":
                self._json(200, {"status": "ok"})
            elif self.path == "/metrics":
                self._send(200, server.metrics().encode(), "text/plain; version=0.0.4")
            elif self.path == "/v1/models":
                self._json(200, {"object": "list", "data": [{
                    "id": server.model_name, "object": "model", "owned_by": "hkv-jax",
                    "max_model_len": server.limits.max_model_len}]})
            else:
                self._error(404, f"no such path: {self.path}")

        def do_POST(self):  # noqa: N802
            if self._refused():
                return
            chat = {"/v1/completions": False, "/v1/chat/completions": True}.get(self.path)
            tool = {"/tokenize": server.tokenize, "/detokenize": server.detokenize}.get(self.path)
            if chat is None and tool is None:
                self._error(404, f"no such path: {self.path}")
                return
            try:
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"null")
                if tool is not None:
                    self._json(200, tool(body))
                    return
                replies, request = server.submit(body, chat)
            except ValueError as e:  # malformed JSON or fields
                self._error(400, str(e))
                return
            first = replies.get()
            if "error" in first:
                self._error(400, first["error"])
                return
            answer = Answer(chat, first["id"], server.model_name, request.top, first["choices"])
            if request.stream:
                self._stream(first, answer, replies, request.include_usage)
            else:
                self._whole(first, answer, replies)

        def _whole(self, first: dict, answer: Answer, replies: queue.Queue) -> None:
            n, echo = first["choices"], first["echo"] or [("", [])] * first["choices"]
            texts, entries = [[text] for text, _ in echo], [list(e) for _, e in echo]
            finish = [None] * n if first["ids"] else ["length"] * n  # no ids: echo alone
            generated = 0
            while None in finish:
                try:
                    u = replies.get(timeout=_CHECK_SECONDS)
                except queue.Empty:
                    u = None
                # At every update (a select and a peek: microseconds against a step), so that a request whose
                # client left ends within a step or a multi-step call, however fast the steps run.
                if self._gone():  # it stopped waiting: its choices end now
                    server.abort(first["ids"])
                    self.close_connection = True
                    return
                if u is None:
                    continue
                if "error" in u:
                    self._error(500, u["error"])
                    return
                i = u["index"]
                texts[i].append(u["text"])
                entries[i] += u.get("logprobs", [])
                if "finish_reason" in u:
                    finish[i] = u["finish_reason"]
                    generated += u["completion_tokens"]
            choices = [("".join(t), e, f) for t, e, f in zip(texts, entries, finish)]
            self._json(200, answer.whole(choices, usage(first["prompt_tokens"], generated)))

        def _stream(self, first: dict, answer: Answer, replies: queue.Queue, include_usage: bool) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Cache-Control", "no-cache")
            self.send_header("Connection", "close")
            self.end_headers()
            self.close_connection = True
            left, generated = len(first["ids"]), 0
            try:
                if answer.chat:
                    for i in range(left):
                        self._event(answer.chunk(i, "", None, None, first=True))
                for i, (text, entries) in enumerate(first["echo"] or ()):  # the prompt comes first
                    self._event(answer.chunk(i, text, entries, None if left else "length"))
                while left:
                    u = replies.get()
                    if "error" in u:
                        self._event({"error": {"message": u["error"], "type": "server_error"}})
                        break
                    done = "finish_reason" in u
                    if u["text"] or u.get("logprobs") or done:
                        self._event(answer.chunk(u["index"], u["text"], u.get("logprobs"), u.get("finish_reason")))
                    if done:
                        left -= 1
                        generated += u["completion_tokens"]
                if include_usage and not left:
                    self._event(answer.usage_chunk(usage(first["prompt_tokens"], generated)))
                self.wfile.write(b"data: [DONE]\n\n")
                self.wfile.flush()
            except (BrokenPipeError, ConnectionResetError):
                server.abort(first["ids"])

        def _gone(self) -> bool:
            """Whether the client closed its connection (readable, with nothing to read)."""
            if not select.select([self.connection], [], [], 0)[0]:
                return False
            try:
                return self.connection.recv(1, socket.MSG_PEEK) == b""
            except OSError:
                return True

        def _event(self, obj) -> None:
            self.wfile.write(b"data: " + json.dumps(obj).encode() + b"\n\n")
            self.wfile.flush()

    return Handler


def warm_up(engine: Engine) -> None:
    """Compile the programs a server needs before the first client waits for them: one request long enough
    for the largest token bucket, then decode steps (the smallest bucket, its lean step, and, when the
    engine's ``max_call_seconds`` fits several decode steps, its program of several), the admissions of
    every prompt-buffer size (``Engine.compile_admissions``) and the scoring of every prompt size that
    ``echo`` may send (``Engine.compile_scoring``)."""
    c = engine.config
    new = min(8, c.max_model_len - 1)  # the last steps run several a call if they are fast enough
    prompt = [0] * min(c.token_budget, c.max_model_len - new)
    rid = engine.add_request(prompt, new)
    engine.run()
    engine.forget(rid)
    engine.compile_admissions()
    engine.compile_scoring()
