"""The output processor: the text of a request's tokens and its stop strings (the scheduler books the
tokens themselves: ``Scheduler.update_from_output``).
"""

from __future__ import annotations

from typing import Callable

from hkv_jax.engine.request import Request


class OutputProcessor:
    """Text for requests; ``detokenize`` (token ids -> text, or ``None``) gives the text that stop strings
    and ``text`` need."""

    def __init__(self, detokenize: Callable[[list[int]], str] | None):
        self.detokenize = detokenize

    # --- text ---------------------------------------------------------------------------------

    def text(self, r: Request, stable: bool = False) -> str:
        """``Engine.text`` of request ``r``."""
        if self.detokenize is None:
            raise ValueError("text needs the engine's detokenize (Engine(..., detokenize=codec.decode))")
        text = self.detokenize(r.generated)
        if r.stop_string is not None:
            return text[:self._stop_strings_in(r, text)[r.stop_string]]
        if stable and not r.done:
            held = min(len(text) - len(text.rstrip("\ufffd")), 3) + max(map(len, r.stop_strings), default=1) - 1
            return text[:max(len(text) - held, 0)]
        return text

    def stop_string(self, r: Request) -> str | None:
        """The earliest of ``r``'s stop strings its text holds, or ``None``. It runs after each of ``r``'s
        tokens, so a string not found before ends in the newest token's text: the text of the last few
        tokens is searched (a token holds at least a quarter of a character, as byte-fallback pieces do),
        and the whole text only on a hit, so a long generation is not decoded whole every step."""
        tail = self.detokenize(r.generated[-4 * (max(map(len, r.stop_strings)) + 2):])
        if not any(s in tail for s in r.stop_strings):
            return None
        found = self._stop_strings_in(r, self.detokenize(r.generated))
        return min(found, key=found.get) if found else None

    def _stop_strings_in(self, r: Request, text: str) -> dict[str, int]:
        """The index in ``text`` of each of ``r``'s stop strings found there, first occurrence. Under
        ``min_tokens`` only a string that ends after the text of its first ``min_tokens`` tokens counts,
        as in vLLM, which looks for them only in the text that comes after."""
        floor = len(self.detokenize(r.generated[:r.min_tokens])) if r.min_tokens else 0
        at = {s: text.find(s, max(floor - len(s) + 1, 0)) for s in r.stop_strings}
        return {s: i for s, i in at.items() if i >= 0}
