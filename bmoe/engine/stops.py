"""Stop strings: text is never emitted past a stop string, even when one spans several tokens.

Text goes in as the tokens are decoded; what comes out is everything that can no longer turn into
a stop string. The tail that is still a prefix of some stop string is held back until the next
piece settles it: either it completes a stop (the text before the stop is released and the
generation ends, the stop itself never shown) or it cannot any more (the tail is released).
"""

from __future__ import annotations

from collections.abc import Sequence

from bmoe.errors import ConfigError

MAX_STOPS = 16


class StopStrings:
    def __init__(self, stops: Sequence[str] | str | None) -> None:
        if stops is None:
            stops = ()
        elif isinstance(stops, str):
            stops = (stops,)
        elif not isinstance(stops, (list, tuple)):
            raise ConfigError(f"stop must be a string or a list of strings, got {type(stops).__name__}")
        if len(stops) > MAX_STOPS:
            raise ConfigError(f"at most {MAX_STOPS} stop strings, got {len(stops)}")
        for s in stops:
            if not isinstance(s, str) or not s:
                raise ConfigError(f"a stop string must be non-empty text, got {s!r}")
        self.stops = tuple(stops)
        self._held = ""
        self.hit: str | None = None

    def feed(self, text: str) -> str:
        """Text that may be shown now. After a stop is found (``hit``), it returns only the text
        before the stop, and nothing more ever."""
        if self.hit is not None:
            return ""
        if not self.stops:
            return text
        pending = self._held + text
        first = None
        for s in self.stops:
            at = pending.find(s)
            if at >= 0 and (first is None or at < first[0]):
                first = (at, s)
        if first is not None:
            self.hit = first[1]
            self._held = ""
            return pending[: first[0]]
        keep = self._partial(pending)
        self._held = pending[len(pending) - keep :] if keep else ""
        return pending[: len(pending) - keep]

    def flush(self) -> str:
        """The held-back tail, at the end of a generation that did not stop on a string."""
        out, self._held = self._held, ""
        return out if self.hit is None else ""

    def _partial(self, text: str) -> int:
        """Length of the longest suffix of ``text`` that is a proper prefix of a stop string."""
        best = 0
        for s in self.stops:
            for n in range(min(len(s) - 1, len(text)), best, -1):
                if text.endswith(s[:n]):
                    best = n
                    break
        return best
