"""Draft tokens for speculative decoding: prompt lookup (``draft="ngram"``).

A sequence's next tokens are guessed from its own context: the longest recent n-gram that ends the
context and occurred before is looked up, and the tokens that followed it then are the draft. No
second model, no extra weights: what it costs is the draft's positions computed in the verifying
step (and, streamed, the union of their experts read once with the step's).

The draft only proposes. The step scheduler verifies it: the sequence's own sampler draws at each
drafted position, and the draft is kept up to the first position where the draw differs. Every
emitted token is therefore the sampler's draw on the logits of exactly the context before it, as
in plain decoding (one draw per emitted token, so seeded chains consume their random numbers the
same way); what can differ is only the order llama.cpp sums in when it computes several positions
at once (``docs/scheduler.md``).

The length adapts: a draft taken whole lets the next one grow, a draft cut short is trimmed to what
was taken plus one, and drafts that miss from their first token back off for a growing number of
steps, so text with nothing to copy pays for few failed verifications.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

N_MAX = 4  # the longest n-gram looked up
N_MIN = 2  # the shortest: a single repeated token proposes too much that is wrong
BACKOFF_MAX = 16  # steps without a draft at most, after misses in a row


@dataclass
class DraftStats:
    """What one sequence's drafts did: steps that verified a draft, tokens drafted and kept."""

    steps: int = 0
    drafted: int = 0
    accepted: int = 0

    @property
    def accept_rate(self) -> float | None:
        return self.accepted / self.drafted if self.drafted else None


class NgramDrafter:
    """One sequence's prompt-lookup drafter (pure: token ids in, token ids out)."""

    def __init__(self, max_len: int) -> None:
        if max_len < 1:
            raise ValueError(f"a draft holds at least one token, got max_len={max_len}")
        self.max_len = max_len
        self.length = max_len  # the next draft's length at most
        self._wait = 0  # steps left without drafting
        self._misses = 0  # drafts in a row that missed from their first token
        self.stats = DraftStats()

    def propose(self, context: list[int], limit: int) -> list[int]:
        """Up to ``min(self.length, limit)`` tokens guessed to follow ``context``; [] when nothing
        repeats (or while backing off)."""
        n_want = min(self.length, limit)
        if n_want <= 0:
            return []
        if self._wait > 0:
            self._wait -= 1
            return []
        ctx = np.asarray(context, dtype=np.int64)
        for n in range(min(N_MAX, len(ctx) - 1), N_MIN - 1, -1):
            found = _last_match(ctx, n)
            if found is not None:
                start = found + n
                return ctx[start : start + n_want].tolist()
        return []

    def verified(self, drafted: int, accepted: int) -> None:
        """After a step verified ``drafted`` tokens and kept the first ``accepted`` of them."""
        if drafted <= 0:
            return
        self.stats.steps += 1
        self.stats.drafted += drafted
        self.stats.accepted += accepted
        if accepted == drafted:
            self.length = min(self.max_len, drafted + 2)
            self._misses = 0
        elif accepted == 0:
            self.length = 1
            self._misses += 1
            self._wait = min(BACKOFF_MAX, 1 << (self._misses - 1))
        else:
            self.length = max(1, accepted + 1)
            self._misses = 0


def _last_match(ctx: np.ndarray, n: int) -> int | None:
    """The start of the latest earlier occurrence of the context's last ``n`` tokens that has at
    least one token after it, or None."""
    if len(ctx) <= n:
        return None
    tail = ctx[-n:]
    body = ctx[:-1]  # an occurrence must end before the context's last token
    if len(body) < n:
        return None
    windows = np.lib.stride_tricks.sliding_window_view(body, n)
    hits = np.flatnonzero((windows == tail).all(axis=1))
    return int(hits[-1]) if hits.size else None


__all__ = ["DraftStats", "NgramDrafter"]
