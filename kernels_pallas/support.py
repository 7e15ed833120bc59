"""``Support``: a kernel's answer to "do you take these shapes?", with the reason when it does not."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Support:
    """True when the kernel takes the shapes; else false, with ``reason`` (for the log or the error)."""

    reason: str | None = None

    def __bool__(self) -> bool:
        return self.reason is None

    def __contains__(self, text: str) -> bool:
        return text in (self.reason or "")


YES = Support()


def no(reason: str) -> Support:
    """The shapes are out of reach, because of ``reason``."""
    return Support(reason)
