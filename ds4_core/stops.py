"""Stop strings over streamed text: emit only what can no longer become a stop string."""

from __future__ import annotations

from collections.abc import Sequence


class StopScanner:
    """Feed decoded text piece by piece; get back the text safe to show and the stop string hit, if any."""

    def __init__(self, stops: Sequence[str]):
        self.stops = tuple(s for s in stops if s)
        self.held = ""

    def push(self, text: str) -> tuple[str, str | None]:
        """Consume ``text``; return ``(visible, hit)``. After a hit, ``visible`` ends before the stop string."""
        text = self.held + text
        hits = [(i, s) for s in self.stops if (i := text.find(s)) >= 0]
        if hits:
            cut, hit = min(hits)
            self.held = ""
            return text[:cut], hit
        keep = self._partial_suffix(text)
        self.held = text[len(text) - keep:] if keep else ""
        return text[:len(text) - keep], None

    def flush(self) -> str:
        """Text held back because it might have started a stop string (generation ended without one)."""
        held, self.held = self.held, ""
        return held

    def _partial_suffix(self, text: str) -> int:
        """Length of the longest suffix of ``text`` that is a proper prefix of a stop string."""
        best = 0
        for s in self.stops:
            for n in range(min(len(s) - 1, len(text)), best, -1):
                if text.endswith(s[:n]):
                    best = n
                    break
        return best
