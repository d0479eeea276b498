"""Stop strings on streamed text: release what cannot start a stop string, cut at the first match.

    matcher = StopStringMatcher(["\\n\\n", "END"])
    matcher.feed("abc\\n")   -> "abc"     ("\\n" is held: it may start "\\n\\n")
    matcher.feed("x")       -> "\\nx"
    matcher.feed("yEN")     -> "y"       ("EN" is held)
    matcher.feed("D tail")  -> ""        matcher.matched == "END"; the stop and what follows are dropped

The workers stop on the same strings (they are sent as stop_words); the
gateway still cuts the text, since it detokenizes the token ids itself.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence


def held_suffix_len(text: str, words: Iterable[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of one of `words`."""
    best = 0
    for word in words:
        for k in range(min(len(word) - 1, len(text)), best, -1):
            if text.endswith(word[:k]):
                best = k
                break
    return best


class StopStringMatcher:
    """Per-choice state; not thread-safe."""

    def __init__(self, stops: Sequence[str]) -> None:
        self._stops = tuple(s for s in stops if s)
        self._pending = ""
        self.matched: str | None = None
        """The stop string found, once one is."""

    def feed(self, text: str) -> str:
        """The text that can be released now (nothing once a stop string matched)."""
        if self.matched is not None:
            return ""
        self._pending += text
        if not self._stops:
            out, self._pending = self._pending, ""
            return out
        hit = min(((i, s) for s in self._stops if (i := self._pending.find(s)) != -1), default=None)
        if hit is not None:
            at, self.matched = hit
            out, self._pending = self._pending[:at], ""
            return out
        keep = held_suffix_len(self._pending, self._stops)
        cut = len(self._pending) - keep
        out, self._pending = self._pending[:cut], self._pending[cut:]
        return out

    def flush(self) -> str:
        """At the end of the output: the held text (it never completed a stop string)."""
        out, self._pending = ("" if self.matched is not None else self._pending), ""
        return out
