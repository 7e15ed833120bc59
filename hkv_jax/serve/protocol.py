"""OpenAI's completion protocol: request bodies into prompts and ``SamplingParams``, answers back into
OpenAI's objects, and chat messages into a prompt with the model's own chat template.

Nothing here touches the engine: ``parse`` checks a body against the server's limits (``Limits``) and
returns a ``CompletionRequest``; ``Answer`` builds the response objects.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, replace

from hkv_jax.engine.sampling_params import KNOBS, SamplingParams
from hkv_jax.models.tokenizer import check_messages, gemma_chat

# OpenAI fields with one value only here.
_FIXED = {"suffix": None}
# OpenAI's default temperature (the engine's own is greedy); the other sampling values (``KNOBS``: OpenAI's
# and vLLM's fields of the same names) left out of a body take the engine's.
_TEMPERATURE = 1.0


class BadRequest(ValueError):
    """A request the server refuses (status 400)."""


@dataclass(frozen=True)
class Limits:
    """What the server's engine allows: ``max_requests`` served at once (the most choices ``n``),
    ``max_model_len`` tokens per request, ``max_top_logprobs`` likeliest tokens per token."""

    max_requests: int
    max_model_len: int
    max_top_logprobs: int


@dataclass(frozen=True)
class CompletionRequest:
    """A parsed (chat) completion request: its ``prompts`` (token ids) and each one's ``texts`` (None: given
    as ids), ``n`` choices per prompt, ``params`` (``None``: ``max_tokens`` 0, echo alone; each choice ``i``
    samples with ``seed + i`` when a seed is set, as vLLM's), ``top``: likeliest tokens listed per token
    (``None``: no log-probabilities), ``echo``, ``stream`` and ``include_usage``."""

    chat: bool
    prompts: list[list[int]]
    texts: list[str | None]
    n: int
    params: SamplingParams | None
    top: int | None
    echo: bool
    stream: bool
    include_usage: bool

    def choice_params(self, i: int) -> SamplingParams:
        """The params of choice ``i`` of a prompt."""
        seed = self.params.seed
        if seed is None or i == 0:
            return self.params
        return replace(self.params, seed=(seed + i) % 2**31)


class ChatTemplate:
    """The model's chat template (``codec.chat_template``: the GGUF's ``tokenizer.chat_template`` or
    ``tokenizer_config.json``'s), rendered with jinja2 in a sandbox as transformers does
    (``trim_blocks``, ``lstrip_blocks``, ``raise_exception``, ``bos_token``, ``eos_token``,
    ``add_generation_prompt``); without one, Gemma's turn format (``gemma_chat``)."""

    def __init__(self, codec):
        self.codec = codec
        source = getattr(codec, "chat_template", None)
        self.template = None
        if source:
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            env.globals["raise_exception"] = _raise
            self.template = env.from_string(source)

    def encode(self, messages, bos: bool = True) -> list[int]:
        """The prompt of ``messages`` (OpenAI's), as token ids, the model's turn opened. ``BadRequest`` for
        malformed messages or a template that refuses them."""
        try:
            check_messages(messages)
            if self.template is None:
                return self.codec.encode(gemma_chat(messages), bos=bos)
            tokens = self.codec.tokenizer
            text = self.template.render(messages=messages, add_generation_prompt=True,
                                        bos_token=tokens.id_to_token(self.codec.bos_id) if bos else "",
                                        eos_token=tokens.id_to_token(self.codec.eos_ids[0]))
        except ValueError as e:
            raise BadRequest(str(e)) from None
        return self.codec.encode(text, bos=False)  # the template writes the BOS


def _raise(message: str):
    raise ValueError(f"the chat template refuses these messages: {message}")


def parse(body, chat: bool, codec, template: ChatTemplate, limits: Limits) -> CompletionRequest:
    """A completion (``chat``: chat completion) request body (parsed JSON) checked and translated.
    ``BadRequest`` for a malformed field (a field given as null counts as absent, as in OpenAI's API)."""
    if not isinstance(body, dict):
        raise BadRequest("the body must be a JSON object")
    body = {k: v for k, v in body.items() if v is not None}
    for name, value in _FIXED.items():
        if body.get(name, value) != value:
            raise BadRequest(f"{name} must be {json.dumps(value)} here")
    n, most = body.get("n", 1), limits.max_requests
    if type(n) is not int or not 1 <= n <= most:  # every choice runs at once
        raise BadRequest(f"n must be an integer in [1, {most}] (the requests served at once), got {n!r}")
    if body.get("best_of", n) != n:
        raise BadRequest("best_of must equal n here")
    echo = body.get("echo", False)
    if type(echo) is not bool or (echo and chat):
        raise BadRequest("echo must be true or false, and false for chat completions")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict) or type(options.get("include_usage", False)) is not bool:
        raise BadRequest('stream_options must be an object like {"include_usage": true}')
    if chat:
        prompts, texts = [template.encode(body.get("messages"))], [None]
        longest = max(limits.max_model_len - len(prompts[0]), 1)  # by default up to the longest, as vLLM's
        max_tokens = body.get("max_completion_tokens", body.get("max_tokens", longest))
    else:
        prompts, texts = _prompts(body.get("prompt"), codec)
        max_tokens = body.get("max_tokens", 16)
    if type(max_tokens) is not int or max_tokens < (0 if echo else 1):  # echo alone scores the prompt
        raise BadRequest(f"max_tokens must be a positive integer (or 0 with echo), got {max_tokens!r}")
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
    if top is not None and (type(top) is not int or not 0 <= top <= limits.max_top_logprobs):
        raise BadRequest(f"{name} must be an integer in [0, {limits.max_top_logprobs}], got {top!r}")
    bias = body.get("logit_bias") or {}
    try:  # JSON object keys are strings
        bias = {int(t): v for t, v in bias.items()}
    except (AttributeError, ValueError):
        raise BadRequest("logit_bias must be an object of token ids to values") from None
    params = None
    if max_tokens:
        sampling = {"temperature": _TEMPERATURE} | {k.name: body[k.name] for k in KNOBS if k.name in body}
        params = SamplingParams(max_new_tokens=max_tokens, stop=tuple(codec.eos_ids), logit_bias=bias,
                                min_tokens=body.get("min_tokens", 0), stop_strings=tuple(stop),
                                logprobs=top is not None, top_logprobs=top or 0,
                                **sampling)
    return CompletionRequest(chat, prompts, texts, n, params, top, echo, bool(body.get("stream")),
                             options.get("include_usage", False))


def _prompts(prompt, codec) -> tuple[list[list[int]], list[str | None]]:
    """A completion request's prompts as token ids, and each one's text (None: given as ids): OpenAI's
    ``prompt`` is a string, a list of token ids, or a list of either (a batch)."""
    def one(p):
        if isinstance(p, str) and p:
            return codec.encode(p)
        if isinstance(p, list) and p and all(type(t) is int for t in p):
            return p
        return None

    batch = prompt if isinstance(prompt, list) and prompt and type(prompt[0]) is not int else [prompt]
    prompts = [one(p) for p in batch]
    if None in prompts:
        raise BadRequest("prompt must be a non-empty string, a list of token ids, or a list of either")
    return prompts, [p if isinstance(p, str) else None for p in batch]


def usage(prompt_tokens: int, generated: int) -> dict:
    """OpenAI's ``usage`` object (each prompt counted once, however many choices)."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": generated, "total_tokens": prompt_tokens + generated}


class Answer:
    """OpenAI's answer objects for one request of ``n`` choices: a completion, or a chat completion
    (``chat``). Log-probability entries are ``(text, log-probability, [(text, log-probability)] of the
    likeliest tokens or None)`` per token."""

    def __init__(self, chat: bool, rid: int, model: str, top: int | None, n: int):
        self.chat, self.top, self.offsets = chat, top, [0] * n  # each choice's text offset, for its logprobs
        self.head = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{rid}", "created": int(time.time()), "model": model}

    def logprobs(self, entries: list | None, index: int):
        """The ``logprobs`` object of choice ``index``'s ``entries``, in this kind's format."""
        if self.top is None or entries is None:
            return None
        if self.chat:
            def item(t, v):
                return {"token": t, "logprob": v, "bytes": list(t.encode())}

            return {"content": [{**item(t, v), "top_logprobs": [item(*x) for x in top]} for t, v, top in entries]}
        offsets = []
        for t, _, _ in entries:
            offsets.append(self.offsets[index])
            self.offsets[index] += len(t)
        # Tokens with the same text (bytes of an incomplete character) share a key: the likeliest keeps it.
        return {"tokens": [t for t, _, _ in entries], "token_logprobs": [v for _, v, _ in entries],
                "top_logprobs": [None if top is None else dict(reversed(top)) for _, _, top in entries]
                if self.top else None,
                "text_offset": offsets}

    def whole(self, choices: list[tuple[str, list, str]], usage: dict) -> dict:
        """The answer to a request that does not stream: ``(text, entries, finish reason)`` per choice."""
        def choice(i, text, entries, finish):
            body = {"message": {"role": "assistant", "content": text}} if self.chat else {"text": text}
            return {"index": i, **body, "logprobs": self.logprobs(entries, i), "finish_reason": finish}

        return {**self.head, "object": "chat.completion" if self.chat else "text_completion",
                "choices": [choice(i, *c) for i, c in enumerate(choices)], "usage": usage}

    def chunk(self, index: int, text: str, entries: list | None, finish: str | None, first: bool = False) -> dict:
        """One event of a stream, for choice ``index`` (a chat stream's first event per choice names the role)."""
        if self.chat:
            body = {"delta": ({"role": "assistant"} if first else {}) | ({"content": text} if text or first else {})}
        else:
            body = {"text": text}
        return {**self.head, "object": "chat.completion.chunk" if self.chat else "text_completion",
                "choices": [{"index": index, **body, "logprobs": self.logprobs(entries, index),
                             "finish_reason": finish}]}

    def usage_chunk(self, usage: dict) -> dict:
        """A stream's last event when the client asked for the usage (``stream_options``)."""
        return {**self.head, "object": "chat.completion.chunk" if self.chat else "text_completion",
                "choices": [], "usage": usage}
