"""The engine's counters (``Stats``) and its KV pool's use (``KVUsage``)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Stats:
    """Counters over the engine's life."""

    steps: int = 0
    tokens_computed: int = 0
    prompt_tokens: int = 0
    cache_hit_tokens: int = 0
    generated: int = 0
    preemptions: int = 0
    aborted: int = 0
    host_to_device_bytes: int = 0   # plans (when they change), releases and new prompts
    device_to_host: int = 0         # reads of a step's report (one per step; two after a lean miss)
    prepare_calls: int = 0  # steps that released or admitted requests
    bucket_steps: dict[str, int] = field(
        default_factory=dict
    )  # steps per program: token bucket, "lean " ones, "multi-step " ones
    lean_misses: int = 0            # lean steps that found a block to move (the full step ran after)
    array_steps: int = 0            # decode-only steps planned and booked with arrays, not per request
    multi_step_calls: int = 0       # programs that ran several decode steps (``decode_steps > 1``)
    spec_drafts: int = 0            # speculative decoding: drafts verified (one per request and step) ...
    spec_draft_tokens: int = 0      # ... their tokens ...
    spec_accepted_tokens: int = 0   # ... and those accepted
    seconds: float = 0.0            # in ``step()``
    device_seconds: float = 0.0     # ... from the first program's dispatch to the report's arrival

    @property
    def acceptance_rate(self) -> float:
        """Accepted draft tokens per draft token verified (0 before any)."""
        return self.spec_accepted_tokens / max(self.spec_draft_tokens, 1)

    def count_program(self, key: str, steps: int = 1) -> None:
        self.bucket_steps[key] = self.bucket_steps.get(key, 0) + steps


@dataclass(frozen=True)
class KVUsage:
    """A read-only view of the KV pool and the queues, between two steps (``Engine.kv_usage``)."""

    num_blocks: int   # blocks of the pool, the null block left out
    free_blocks: int  # blocks no request holds (prefix-cached ones included)
    running: int      # requests running
    waiting: int      # requests waiting

    @property
    def usage(self) -> float:
        """The fraction of the pool's blocks that requests hold (prefix-cached free blocks count as free)."""
        return 1 - self.free_blocks / self.num_blocks


@dataclass(frozen=True)
class HostUsage:
    """A read-only view of the host tier (``Engine.host_usage``): its blocks, those cached per KV cache
    group, and what it served and moved since the engine started."""

    num_blocks: int               # host blocks
    cached_per_group: list[int]   # host blocks cached per allocator group
    block_bytes: int              # bytes of a block (a page of every shared tensor)
    hit_tokens: int               # prompt tokens whose hit needed blocks from the host
    blocks_down: int              # blocks copied device -> host
    blocks_up: int                # blocks copied host -> device
    superseded_blocks: int        # cached blocks a later release superseded: the first to be evicted

    @property
    def capacity_bytes(self) -> int:
        """Bytes of the host tier's blocks."""
        return self.num_blocks * self.block_bytes

    @property
    def used_bytes(self) -> int:
        """Bytes of the blocks it holds."""
        return sum(self.cached_per_group) * self.block_bytes

    @property
    def superseded_bytes(self) -> int:
        """Bytes of the blocks it holds that a later release superseded (``host_tier.supersede``): evicted
        first."""
        return self.superseded_blocks * self.block_bytes

    @property
    def kept_bytes(self) -> int:
        """Bytes of the blocks it holds that no later release superseded: what its hits need."""
        return self.used_bytes - self.superseded_bytes

    @property
    def bytes_down(self) -> int:
        return self.blocks_down * self.block_bytes

    @property
    def bytes_up(self) -> int:
        return self.blocks_up * self.block_bytes
