"""``hkv serve``: OpenAI-style completion endpoints over one engine (``server.py``: the HTTP layer and the
engine thread; ``protocol.py``: request parsing into ``SamplingParams``, chat templates, answer objects)."""

from hkv_jax.serve.protocol import BadRequest, ChatTemplate
from hkv_jax.serve.server import CompletionServer, warm_up

__all__ = ["BadRequest", "ChatTemplate", "CompletionServer", "warm_up"]
