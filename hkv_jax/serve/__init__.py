"""``hkv serve``: OpenAI-style completion endpoints over one engine (``server.py``: the HTTP layer;
``engine_client.py``: the thread that owns the engine; ``metrics.py``: the Prometheus text; ``protocol.py``:
request parsing into ``SamplingParams``, chat templates, answer objects)."""

from hkv_jax.serve.protocol import BadRequest, ChatTemplate
from hkv_jax.serve.server import CompletionServer, warm_up

__all__ = ["BadRequest", "ChatTemplate", "CompletionServer", "warm_up"]
