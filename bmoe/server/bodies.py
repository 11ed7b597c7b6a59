"""How many request bodies the server holds at once, and how many bytes they take together.

A body is held from its first byte until the request it carries is parsed, validated and prepared
(its JSON tree and its tokens are alive until then): twenty 4 MiB bodies arriving together took
the server's memory from 115 to 627 MB, and kept it. Past either bound a request is refused at
once (503 with Retry-After) rather than read. All of it runs on the server's event loop, so the
counts need no lock.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator


class BodiesFull(Exception):
    """Holding one more body (or these bytes) would pass a bound."""


class Held:
    """One request's share: the bytes its body takes so far."""

    def __init__(self, owner: Bodies) -> None:
        self._owner = owner
        self.bytes = 0

    def take(self, n: int) -> None:
        """Count ``n`` more bytes of this body, or raise BodiesFull (the bytes are then not counted)."""
        owner = self._owner
        if owner.bytes + n > owner.max_bytes:
            raise BodiesFull(f"the server holds {owner.bytes} bytes of request bodies, "
                             f"at most {owner.max_bytes} at once")
        owner.bytes += n
        self.bytes += n

    def upto(self, total: int) -> None:
        """Count this body as ``total`` bytes if that is more than counted so far."""
        if total > self.bytes:
            self.take(total - self.bytes)


class Bodies:
    def __init__(self, max_count: int, max_bytes: int) -> None:
        if max_count < 1 or max_bytes < 1:
            raise ValueError("max_count and max_bytes must be >= 1")
        self.max_count, self.max_bytes = max_count, max_bytes
        self.count = 0
        self.bytes = 0

    @contextlib.contextmanager
    def hold(self) -> Iterator[Held]:
        """A place for one body, given back (with its bytes) on leaving; BodiesFull if none is free."""
        if self.count >= self.max_count:
            raise BodiesFull(f"the server is reading or checking {self.count} requests, at most "
                             f"{self.max_count} at once")
        self.count += 1
        held = Held(self)
        try:
            yield held
        finally:
            self.count -= 1
            self.bytes -= held.bytes
