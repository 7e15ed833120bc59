"""``EngineConfig``: an engine's sizes and choices, checked when built."""

from __future__ import annotations

import math
from dataclasses import dataclass

from hkv_jax.engine.sampling_params import is_integer, is_number
from hkv_jax.engine.speculative import DraftModelSpec, NgramSpec
from hkv_jax.models.hf_config import KV_CACHE_DTYPES


@dataclass(frozen=True)
class EngineConfig:
    """What an ``Engine`` serves with. ``ValueError`` for sizes that cannot serve, before anything compiles.

    ``num_blocks`` blocks of ``block_size`` tokens in the KV pool (the null block included), grouped by
    ``policy`` (``hkv_jax.planner``: ``"vllm"`` or ``"min-waste"``); ``max_requests`` request slots;
    ``max_model_len`` tokens per request at most; ``token_budget`` tokens computed per step at most.

    ``token_buckets``: the step is compiled once per size (default: ``min(max_requests, token_budget)``,
    with ``k`` draft tokens also ``min(max_requests * (1 + k), token_budget)``, and ``token_budget``) and
    each step runs the smallest that holds its tokens, so a decode-only step does not pay for prefill-sized
    arrays. ``impl``: the attention
    kernel (``kernels_pallas.choose``).
    ``seed``: the sampling key. ``prefix_caching=False``: nothing ever hits. ``window_aware_eviction``:
    blocks leaving a sliding window go to the front of the free queue. ``vectorised=False`` runs the
    allocator request by request (the exact statement, for tests and comparisons).

    ``decode_steps``: while every running request decodes and no waiting one can start, one call of
    ``Engine.step`` runs up to this many decode steps in one program (one dispatch and one report read for
    all of them; it stops early at a finished or refused request); the tokens and states equal those of
    single steps. ``max_call_seconds`` (with ``decode_steps > 1``): about the longest such a call should
    take, since a request that arrives meanwhile waits for it: a call runs as many steps as fit at the
    last timed call's rate (one until a call has been timed; calls that compiled are not timed). ``None``:
    always up to ``decode_steps``.

    ``max_top_logprobs``: the most likeliest tokens a request may ask to see per generated token (0 leaves
    them out of the step). ``max_logit_bias``: the most logit-bias entries a request may carry (its
    ``logit_bias``, plus one per stop token under ``min_tokens``; 0 leaves them out of the plan).

    ``kv_cache_dtype``: the attention layers' KV cache dtype, by vLLM's names (``"fp8"``: e4m3 pages, scale 1,
    keys centred: ``hkv_jax.models.key_centre``; ``"bfloat16"``, ``"float32"`` ...; ``"auto"``: the model's);
    Mamba states keep theirs.

    ``host_cache_bytes``: bytes of host memory (CPU RAM) for the host tier behind the prefix cache
    (``hkv_jax.allocator.host_tier``; 0: none): blocks the device cache enters are copied down in the step
    that computes them, and a waiting request's hit takes blocks from either. ``Engine`` refuses a size
    over the free host memory or under one block of every group. ``host_cache_unit``: the host unit in
    tokens (0: ``host_tier.default_unit``, 8 of the longest sliding windows or chunks): as blocks are
    computed, the tier keeps what a hit ending on its multiples needs, and a released request's last
    window or state besides. ``host_cache_supersede``: a release sends the earlier end windows of its
    prefix to the head of the host LRU (``host_tier.supersede``; ``False``: they age as any block, which
    suits traffic of repeated prompts).

    ``speculative``: speculative decoding (``NgramSpec``, or ``DraftModelSpec``: a draft model proposes):
    each decoding request drafts up to ``k`` tokens
    in the step and verifies them in the same program; its tokens equal those it decodes without (for a
    greedy or seeded request, token for token). Its drafts take token budget (``1 + k`` a request);
    a step where some request drafts runs alone in its call (``decode_steps`` applies to the others).
    """

    num_blocks: int
    block_size: int = 16
    max_requests: int = 8
    max_model_len: int = 256
    token_budget: int = 64
    policy: str = "vllm"
    impl: str = "auto"
    seed: int = 0
    prefix_caching: bool = True
    window_aware_eviction: bool = False
    vectorised: bool = True
    token_buckets: tuple[int, ...] | None = None
    decode_steps: int = 1
    max_call_seconds: float | None = None
    max_top_logprobs: int = 0
    max_logit_bias: int = 0
    kv_cache_dtype: str = "auto"
    host_cache_bytes: int = 0
    host_cache_unit: int = 0
    host_cache_supersede: bool = True
    speculative: NgramSpec | DraftModelSpec | None = None

    def __post_init__(self):
        for name in ("token_budget", "max_requests", "max_model_len", "block_size", "decode_steps"):
            value = getattr(self, name)
            if not is_integer(value) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        s = self.max_call_seconds
        if s is not None and not (is_number(s) and 0 < s < math.inf):
            raise ValueError(f"max_call_seconds must be a positive number of seconds or None, got {s!r}")
        for name in ("max_top_logprobs", "max_logit_bias"):
            if not is_integer(getattr(self, name)) or getattr(self, name) < 0:
                raise ValueError(f"{name} must be an integer in [0, vocab_size], got {getattr(self, name)!r}")
        for name in ("host_cache_bytes", "host_cache_unit"):
            if not is_integer(getattr(self, name)) or getattr(self, name) < 0:
                raise ValueError(f"{name} must be a non-negative integer, got {getattr(self, name)!r}")
        if not isinstance(self.host_cache_supersede, bool):
            raise ValueError(f"host_cache_supersede must be True or False, got {self.host_cache_supersede!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")
        spec = self.speculative
        if spec is not None:
            if not isinstance(spec, (NgramSpec, DraftModelSpec)):
                raise ValueError(f"speculative must be an NgramSpec, a DraftModelSpec or None, got {spec!r}")
            k = spec.num_speculative_tokens
            if k + 1 > self.token_budget:
                raise ValueError(f"num_speculative_tokens {k} needs a token budget of at least {k + 1} (a request "
                                 f"verifies its draft and one token more in a step), got {self.token_budget}")
            if k + 2 > self.max_model_len:
                raise ValueError(f"num_speculative_tokens {k} leaves no room for a draft in max_model_len "
                                 f"{self.max_model_len} (a prompt token, k drafts and the target's token)")
        buckets = self.buckets
        if buckets[0] < 1 or buckets[-1] != self.token_budget:
            raise ValueError(f"token_buckets must be positive and end at token_budget {self.token_budget}, "
                             f"got {buckets}")

    @property
    def buckets(self) -> list[int]:
        """The token buckets, ascending (by default a decode step's, with speculation also one with every
        request's drafts, and the budget: a step where no request drafts runs in the smaller one)."""
        sizes = {min(self.max_requests, self.token_budget), self.token_budget}
        if self.speculative:
            sizes.add(min(self.max_requests * (1 + self.speculative.num_speculative_tokens), self.token_budget))
        return sorted(set(self.token_buckets or sizes))
