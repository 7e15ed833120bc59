"""The layer patterns of the allocator benchmarks, as plain data (the trace format's ``layer_pattern``).

Shared by ``allocator_step.py`` (ours) and ``vllm_decode_mean.py`` (vLLM's allocator, run with the vLLM
oracle's Python, where jax is not installed), so that both time the same models. full32, gemma3 and gptoss
are the vLLM oracle's own bench models; gemma4 is added to its list when missing.
"""

FULL_8x128 = {"type": "full", "num_kv_heads": 8, "head_size": 128, "dtype": "bfloat16"}

MODELS = {
    # llama-3-8b-like: 32 full-attention layers.
    "full32": {"num_layers": 32, "pattern": [FULL_8x128]},
    # gemma-3-27b-like: 62 layers, 5 sliding (1024) : 1 full.
    "gemma3": {"num_layers": 62, "pattern": [
        {"type": "sliding_window", "sliding_window": 1024, "num_kv_heads": 16, "head_size": 128,
         "dtype": "bfloat16"}] * 5 + [{"type": "full", "num_kv_heads": 16, "head_size": 128, "dtype": "bfloat16"}]},
    # gpt-oss-120b-like: 36 layers alternating sliding (128) / full.
    "gptoss": {"num_layers": 36, "pattern": [
        {"type": "sliding_window", "sliding_window": 128, "num_kv_heads": 8, "head_size": 64, "dtype": "bfloat16"},
        {"type": "full", "num_kv_heads": 8, "head_size": 64, "dtype": "bfloat16"}]},
    # gemma-4-31b-like: 60 layers, 5 sliding (1024; 16 KV heads x 256) : 1 full (4 x 512): the full layers'
    # pages are half the sliding ones', so vLLM gives them 32 tokens per block against the sliding 16.
    "gemma4": {"num_layers": 60, "pattern": [
        {"type": "sliding_window", "sliding_window": 1024, "num_kv_heads": 16, "head_size": 256,
         "dtype": "bfloat16"}] * 5 + [{"type": "full", "num_kv_heads": 4, "head_size": 512, "dtype": "bfloat16"}]},
}
