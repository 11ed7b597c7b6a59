"""Fixtures and hooks: tiny models generated once per test session into a temporary directory, the
first-open check off for the suite, async tests on both loops. Shared helpers live in ``helpers.py``."""

from __future__ import annotations

import asyncio
import errno
import os
import shutil
import stat
import tempfile
from collections.abc import Callable

import pytest

from tests.helpers import TinyModels

# The first-open check runs a child per new file: the suite's many tiny files skip it (and so do
# the CLI subprocesses, which inherit this); tests/test_isolate.py turns it on for real.
os.environ["BMOE_ISOLATE"] = "0"

# What the suite and its subprocesses cache (the compiled node filter, the first-open check's
# memo, matplotlib's font list) goes into a folder of this run's, never the user's ~/.cache: no
# test depends on, or leaves, files from another run.
_CACHE = tempfile.mkdtemp(prefix="bmoe-test-cache-")
os.environ["XDG_CACHE_HOME"] = _CACHE
os.environ["MPLCONFIGDIR"] = os.path.join(_CACHE, "matplotlib")


def pytest_unconfigure(config: pytest.Config) -> None:
    shutil.rmtree(_CACHE, ignore_errors=True)


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


@pytest.fixture
def full_device(tmp_path) -> str:  # noqa: ANN001
    """A path where every write fails with "No space left on device": a node of the test's own in
    its temporary folder (made as root), else, for a user who cannot remove it, the machine's
    /dev/full. A test of a command that once removed what it half wrote (run as root, the device
    node itself) must not be able to take the machine's /dev/full with it."""
    own = tmp_path / "full"
    try:
        os.mknod(own, 0o666 | stat.S_IFCHR, os.makedev(1, 7))
        with open(own, "wb", buffering=0) as f:
            f.write(b"x")
    except OSError as e:
        if os.path.lexists(own) and e.errno == errno.ENOSPC:
            return str(own)
        if os.path.lexists(own):
            os.unlink(own)
    if os.geteuid() == 0:  # root could remove /dev/full if a writer regressed: never lend it
        pytest.skip("no full device of the test's own here (mknod refused, or a nodev temp folder)")
    if stat.S_ISCHR(os.stat("/dev/full").st_mode if os.path.exists("/dev/full") else 0):
        return "/dev/full"  # not root: /dev/full cannot be removed or replaced
    pytest.skip("no full device here (/dev/full missing, and mknod refused)")
