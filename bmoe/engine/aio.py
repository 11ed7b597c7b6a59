"""Which event loop bmoe runs on: uvloop when it is installed, for every front (CLI, sync API,
benchmarks), since the pipeline's thread hops and task steps cost less CPU there than on asyncio's
own loop - CPU the compute threads share on a small machine."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import TypeVar

T = TypeVar("T")


def run(coro: Coroutine[object, object, T]) -> T:
    """Run a coroutine to completion on a fresh loop."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)


def loop_backend_options() -> dict[str, object]:
    """anyio's backend options for the same choice (the sync API's portal)."""
    try:
        import uvloop  # noqa: F401
    except ImportError:
        return {}
    return {"use_uvloop": True}
