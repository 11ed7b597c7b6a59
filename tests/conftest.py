"""Fixtures and hooks: tiny models generated once per test session into a temporary directory, the
first-open check off for the suite, async tests on both loops. Shared helpers live in ``helpers.py``."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable

import pytest

from tests.helpers import TinyModels

# The first-open check runs a child per new file: the suite's many tiny files skip it (and so do
# the CLI subprocesses, which inherit this); tests/test_isolate.py turns it on for real.
os.environ["BMOE_ISOLATE"] = "0"


@pytest.fixture(scope="session")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> TinyModels:
    return TinyModels(tmp_path_factory.mktemp("tiny"))


def pytest_asyncio_loop_factories(config: pytest.Config, item: pytest.Item) -> dict[str, Callable[[], asyncio.AbstractEventLoop]]:
    """Every ``pytest.mark.asyncio`` test runs on both loops bmoe may run on (``bmoe.engine.aio``
    picks uvloop when it is installed)."""
    factories: dict[str, Callable[[], asyncio.AbstractEventLoop]] = {"asyncio": asyncio.new_event_loop}
    try:
        import uvloop
    except ImportError:
        return factories
    factories["uvloop"] = uvloop.new_event_loop
    return factories
