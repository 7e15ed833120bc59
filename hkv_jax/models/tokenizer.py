"""Text <-> token ids without torch: a ``tokenizers.Tokenizer`` from a GGUF file or a ``tokenizer.json``.

A GGUF file stores a sentencepiece vocabulary (pieces, scores, token types) but
no merges. For Gemma the merges are rebuilt from the vocabulary, as Hugging
Face transformers does: every split of a piece into two pieces of the
vocabulary is a merge, ranked by the merged piece's position in the file (a
lower id merges first; Gemma's scores do not follow the merge order). Pieces of
two or more spaces are stored as spaces and respelled with ``▁``. Control
tokens (``<start_of_turn>`` ...) are special tokens, matched whole.

Building takes a few seconds for Gemma's 262144 pieces; the result is cached
as ``tokenizer.json`` next to the GGUF file, which loads in about a second.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

_SPACE = "\u2581"
_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp token types


def _merges(pieces: list[str]) -> list[tuple[str, str]]:
    """Merges implied by a BPE vocabulary in merge order: pieces by id, each piece's splits longest-left first."""
    ids = {p: i for i, p in enumerate(pieces)}
    out = []
    for piece in pieces:
        splits = [(piece[:k], piece[k:]) for k in range(len(piece) - 1, 0, -1)
                  if piece[:k] in ids and piece[k:] in ids]
        out.extend(splits)
    return out


def tokenizer_from_gguf(path: str | Path):
    """A ``tokenizers.Tokenizer`` for a Gemma GGUF file (cached as ``<file>.tokenizer.json`` beside it)."""
    from tokenizers import AddedToken, Tokenizer, decoders, normalizers
    from tokenizers.models import BPE

    path = Path(path)
    cached = path.with_suffix(".tokenizer.json")
    if cached.is_file() and cached.stat().st_mtime >= path.stat().st_mtime:
        return Tokenizer.from_file(str(cached))
    from hkv_jax.models.gguf_file import GGUFFile

    meta = GGUFFile(path).metadata
    model = meta.get("tokenizer.ggml.model")
    if model != "llama":
        raise ValueError(f"{path}: tokenizer model {model!r}; only sentencepiece ('llama') vocabularies are supported")
    pieces = [_SPACE * len(p) if p and not p.strip(" ") else p for p in meta["tokenizer.ggml.tokens"]]
    types = meta["tokenizer.ggml.token_type"]
    unk = pieces[int(meta["tokenizer.ggml.unknown_token_id"])]
    tok = Tokenizer(BPE(vocab={p: i for i, p in enumerate(pieces)}, merges=_merges(pieces),
                        unk_token=unk, fuse_unk=True, byte_fallback=True))
    tok.normalizer = normalizers.Replace(" ", _SPACE)
    tok.decoder = decoders.Sequence([decoders.Replace(_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()])
    tok.add_special_tokens([AddedToken(p, normalized=False, special=True)
                            for p, t in zip(pieces, types) if t == _CONTROL])
    tok.add_tokens([AddedToken(p, normalized=False, special=False)
                    for p, t in zip(pieces, types) if t == _USER_DEFINED])
    try:
        tok.save(str(cached))
    except OSError:  # a read-only location: build it again next time
        pass
    return tok


@dataclass(frozen=True)
class TextCodec:
    """Encode prompts (BOS first) and decode generated ids, for one model's tokenizer."""

    tokenizer: object
    bos_id: int
    eos_ids: tuple[int, ...]
    chat_template: str | None = None  # the model's jinja2 chat template (``hkv_jax.serve.protocol.ChatTemplate``)

    def encode(self, text: str, *, bos: bool = True) -> list[int]:
        """Token ids of ``text``, BOS first unless ``bos=False``; control tokens in the text stay whole."""
        ids = self.tokenizer.encode(text, add_special_tokens=False).ids
        return [self.bos_id, *ids] if bos else ids

    def decode(self, ids: list[int]) -> str:
        """The text of ``ids`` (special tokens dropped)."""
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)


def check_messages(messages) -> None:
    """``ValueError`` unless ``messages`` is a non-empty list of OpenAI-style messages (``role``: system,
    user or assistant; ``content``: text)."""
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list")
    for m in messages:
        if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant") \
                or not isinstance(m.get("content"), str):
            raise ValueError("each message needs a role (system, user or assistant) and a string content")


def gemma_chat(messages: list[dict]) -> str:
    """OpenAI-style ``messages`` in Gemma's turn format, as its chat template writes them (content trimmed;
    Gemma has no system turn, so system text opens the first user turn), ending with the model's turn
    opened. ``ValueError`` for a malformed list (``check_messages``)."""
    check_messages(messages)
    system, turns = [], []
    for m in messages:
        if m["role"] == "system":
            system.append(m["content"].strip())
        else:
            turns.append(("user" if m["role"] == "user" else "model", m["content"].strip()))
    if system and (not turns or turns[0][0] != "user"):
        turns.insert(0, ("user", ""))
    if system:
        turns[0] = ("user", "\n\n".join(system + [turns[0][1]]))
    return "".join(f"<start_of_turn>{role}\n{text}<end_of_turn>\n" for role, text in turns) + "<start_of_turn>model\n"


def gemma_codec(tokenizer, *, bos_id: int = 2, eos_id: int = 1, chat_template: str | None = None) -> TextCodec:
    """Gemma's codec: BOS 2, and generation stops at ``<eos>`` or ``<end_of_turn>``."""
    end_of_turn = tokenizer.token_to_id("<end_of_turn>")
    return TextCodec(tokenizer, bos_id, (eos_id,) if end_of_turn is None else (eos_id, end_of_turn), chat_template)


def chat_template_of(path: str | Path) -> str | None:
    """The chat template a model ships (``None``: none): a GGUF file's ``tokenizer.chat_template``, or a
    Hugging Face directory's ``chat_template.jinja`` or ``tokenizer_config.json``'s ``chat_template`` (a
    string, or named templates of which ``default`` is taken)."""
    path = Path(path)
    if path.suffix == ".gguf":
        from hkv_jax.models.gguf_file import GGUFFile

        return GGUFFile(path).metadata.get("tokenizer.chat_template")
    if (path / "chat_template.jinja").is_file():
        return (path / "chat_template.jinja").read_text()
    config = path / "tokenizer_config.json"
    template = json.loads(config.read_text()).get("chat_template") if config.is_file() else None
    if isinstance(template, list):  # [{"name": ..., "template": ...}]
        template = next((t["template"] for t in template if t.get("name") == "default"), None)
    return template


@dataclass(frozen=True)
class ByteCodec:
    """The text codec of the tiny models (vocabulary 256): a token is one byte of the UTF-8 text."""

    eos_ids: tuple[int, ...] = ()

    def encode(self, text: str, *, bos: bool = True) -> list[int]:
        """The UTF-8 bytes of ``text`` (there is no BOS token; ``bos`` is taken for ``TextCodec``'s sake)."""
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        """The text of the bytes ``ids`` (an invalid or incomplete sequence becomes U+FFFD)."""
        return bytes(ids).decode("utf-8", errors="replace")
