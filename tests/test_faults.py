"""Read faults during a decode: never a token computed on missing bytes, never a stuck session.

An EIO, or a read that ends early (the file ends), is injected under the reader's positioned
reads at the first, a middle and the last read of a generation, in serial, overlap and read-ahead
modes, with the cache on and off. The generation either fails with ``ReadError`` after emitting
only tokens the fault-free run emits too, or (a fault in a read-ahead nobody waited for) matches
it; either way the next generation on the same session equals a fresh run. A short read that the
reader completes with a second call changes nothing. Then the file changing under a run.
"""

from __future__ import annotations

import asyncio
import errno
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

import bmoe.io.direct as direct
from bmoe.engine.config import MiB, RunConfig
from bmoe.engine.session import Session
from bmoe.errors import ReadError
from bmoe.pipeline.hooks import Hooks
from bmoe.synth.tiny import TinySpec
from tests.helpers import PROMPT

N = 12
CONFIGS = {
    "serial-cache-off": RunConfig(n_ctx=256),
    # No read-ahead of any kind (a prompt's is on by default with a cache): every read is waited for.
    "serial-cache-on": RunConfig(n_ctx=256, cache_bytes=4 * MiB, predict_prompt=False),
    "overlap-cache-off": RunConfig(n_ctx=256, overlap=True),
    "overlap-cache-on": RunConfig(n_ctx=256, overlap=True, cache_bytes=4 * MiB, predict_prompt=False),
    "read-ahead": RunConfig(n_ctx=256, cache_bytes=4 * MiB, predict_prefetch=True, prefetch_layers=1),
    "prompt-read-ahead": RunConfig(n_ctx=256, cache_bytes=14 * MiB, predict_prompt=True, prefill="batch"),
}


class FaultyFill:
    """Wraps the reader's ``_fill``: counts reads, and at read ``at`` (1-based) injects ``kind``."""

    def __init__(self, real, kind: str | None = None, at: int = 0) -> None:  # noqa: ANN001
        self.real, self.kind, self.at = real, kind, at
        self.calls = 0
        self.fired = False
        self._lock = threading.Lock()

    def __call__(self, fd: int, pos: int, stop: int, need: int, addr: int) -> int:
        with self._lock:
            self.calls += 1
            fire = self.calls == self.at and self.kind is not None
        if fire:
            self.fired = True
            if self.kind == "eio":
                raise OSError(errno.EIO, "Input/output error (injected)")
            if self.kind == "eof":
                return pos  # the file ended before the slice did
        if self.kind == "short":  # every read comes back in two parts
            half = pos + max(1, (stop - pos) // 2)
            reached = self.real(fd, pos, half, min(need, half), addr)
            return self.real(fd, reached, stop, need, addr + (reached - pos))
        return self.real(fd, pos, stop, need, addr)


async def _collect(session: Session, out: list[int]) -> None:
    async for piece in session.stream(PROMPT, N, stop_at_end=False):
        if piece.token is not None:
            out.append(piece.token)


def _run(path: Path, config: RunConfig, fill: FaultyFill) -> tuple[list[int], BaseException | None, list[int]]:
    """(tokens of the faulty generation, its error, tokens of the next generation)."""

    async def go() -> tuple[list[int], BaseException | None, list[int]]:
        kind, fill.kind = fill.kind, None  # Session.open's O_DIRECT check reads too: not counted
        with Session.open(path, config) as session:
            fill.calls, fill.kind = 0, kind
            first: list[int] = []
            error = None
            try:
                await _collect(session, first)
            except ReadError as e:
                error = e
            fill.kind = None  # the fault is over: the disk answers again
            again: list[int] = []
            await asyncio.wait_for(_collect(session, again), 60)
            return first, error, again

    return asyncio.run(go())


@pytest.fixture(scope="module")
def reference(tiny) -> dict[str, tuple[list[int], int]]:  # noqa: ANN001
    """Per config, the fault-free tokens and how many reads the generation makes."""
    path = tiny.path(TinySpec())
    out = {}
    for name, config in CONFIGS.items():
        fill = FaultyFill(direct._fill)
        mp = pytest.MonkeyPatch()
        mp.setattr(direct, "_fill", fill)
        try:

            async def go() -> list[int]:
                with Session.open(path, config) as session:
                    fill.calls = 0
                    tokens: list[int] = []
                    await _collect(session, tokens)
                    return tokens

            tokens = asyncio.run(go())
        finally:
            mp.undo()
        out[name] = (tokens, fill.calls)
    return out


@pytest.mark.parametrize("kind", ["eio", "eof"])
@pytest.mark.parametrize("where", ["first", "middle", "last"])
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_a_failed_read_never_yields_a_wrong_token_and_never_sticks(
    tiny, reference, monkeypatch: pytest.MonkeyPatch, name: str, where: str, kind: str,  # noqa: ANN001
) -> None:
    expected, n_reads = reference[name]
    assert n_reads > 3
    at = {"first": 1, "middle": n_reads // 2, "last": n_reads}[where]
    fill = FaultyFill(direct._fill, kind, at)
    monkeypatch.setattr(direct, "_fill", fill)
    first, error, again = _run(tiny.path(TinySpec()), CONFIGS[name], fill)
    assert fill.fired
    if error is None:  # only a read nobody waited for (read-ahead) may fail silently
        assert name in ("read-ahead", "prompt-read-ahead"), "a routed read failed and the generation did not say so"
        assert first == expected
    else:
        assert first == expected[: len(first)], "a token was computed on missing bytes"
    assert again == expected, "the generation after a failed read differs from a fresh run"


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_short_reads_completed_by_a_second_call_change_nothing(
    tiny, reference, monkeypatch: pytest.MonkeyPatch, name: str,  # noqa: ANN001
) -> None:
    fill = FaultyFill(direct._fill, "short")
    monkeypatch.setattr(direct, "_fill", fill)
    first, error, _ = _run(tiny.path(TinySpec()), CONFIGS[name], fill)
    assert error is None and first == reference[name][0]


def test_a_hook_raising_then_the_next_generation_runs(tiny, reference) -> None:  # noqa: ANN001
    """The issue's second way in: ``Hooks.before_read`` raising early in a generation, cache on."""
    state = {"n": 0, "armed": True}

    def before(_request) -> bool:  # noqa: ANN001
        state["n"] += 1
        if state["armed"] and state["n"] == 2:
            raise OSError(errno.EIO, "hook says EIO")
        return True

    async def go() -> tuple[BaseException | None, list[int]]:
        with Session.open(tiny.path(TinySpec()), CONFIGS["serial-cache-on"], hooks=Hooks(before_read=before)) as s:
            error = None
            try:
                await _collect(s, [])
            except ReadError as e:
                error = e
            state["armed"] = False
            again: list[int] = []
            await asyncio.wait_for(_collect(s, again), 60)
            return error, again

    error, again = asyncio.run(go())
    assert error is not None
    assert again == reference["serial-cache-on"][0]


# --- the file changing under a run ---------------------------------------------------------------


@pytest.mark.parametrize("change", ["truncate", "rewrite", "replace"])
def test_a_model_changed_mid_run_stops_it_without_a_wrong_token(tiny, reference, tmp_path: Path, change: str) -> None:  # noqa: ANN001
    path = tmp_path / "m.gguf"
    shutil.copy(tiny.path(TinySpec()), path)
    state = {"n": 0}

    def before(_request) -> bool:  # noqa: ANN001
        state["n"] += 1
        if state["n"] == 40:  # mid-generation
            if change == "truncate":
                os.truncate(path, path.stat().st_size // 2)
            elif change == "rewrite":
                st = path.stat()
                os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # a resumed download's write
            else:
                copy = path.with_suffix(".new")
                shutil.copy(path, copy)
                copy.replace(path)
        return True

    async def go() -> tuple[list[int], BaseException | None]:
        with Session.open(path, CONFIGS["serial-cache-off"], hooks=Hooks(before_read=before)) as s:
            tokens: list[int] = []
            try:
                await _collect(s, tokens)
            except ReadError as e:
                return tokens, e
            return tokens, None

    tokens, error = asyncio.run(go())
    assert error is not None and {"truncate": "truncated", "rewrite": "rewritten", "replace": "replaced"}[change] in str(error)
    expected = reference["serial-cache-off"][0]
    assert tokens == expected[: len(tokens)] and len(tokens) < len(expected)


def test_cli_model_truncated_mid_run_is_one_line(tiny, tmp_path: Path) -> None:  # noqa: ANN001
    path = tmp_path / "m.gguf"
    shutil.copy(tiny.path(TinySpec()), path)
    csv_path = tmp_path / "m.csv"
    proc = subprocess.Popen(
        [sys.executable, "-m", "bmoe.cli", "run", "-m", str(path), "-p", PROMPT, "-n", "1900", "-c", "2048",
         "--csv", str(csv_path), "--json"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        deadline = time.monotonic() + 60
        while not (csv_path.exists() and csv_path.stat().st_size > 4096) and proc.poll() is None:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        assert proc.poll() is None, "the run ended before the file was cut"
        os.truncate(path, path.stat().st_size // 2)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "truncated during the run" in lines[0], err


@pytest.mark.parametrize("config", [RunConfig(mode="resident", n_ctx=256),
                                    RunConfig(mode="stream", n_ctx=256, cache_bytes=64 * MiB)],
                         ids=["resident", "stream-all-cached"])
def test_a_model_rewritten_in_place_stops_the_next_token(tiny, tmp_path: Path, config: RunConfig) -> None:
    """The weights llama.cpp maps are the file's: rewritten in place under a resident session (or
    a streamed one with every expert cached, which reads nothing), the run went on, exit 0, with
    tokens computed from other weights. Now the next token is refused, and the server's health
    check says why."""
    path = tmp_path / "m.gguf"
    shutil.copy(tiny.path(TinySpec()), path)

    async def go() -> tuple[list[int], str | None, BaseException | None]:
        with Session.open(path, config) as s:
            first = (await s.generate(PROMPT, 4, stop_at_end=False)).tokens
            assert s.file_changed() is None
            with open(path, "r+b") as f:  # the last bytes of the last tensor, in place
                f.seek(-64, os.SEEK_END)
                f.write(bytes(64))
            changed = s.file_changed()
            try:
                await s.generate(PROMPT, 4, stop_at_end=False)
            except ReadError as e:
                return first, changed, e
            return first, changed, None

    first, changed, error = asyncio.run(go())
    assert first and changed is not None and "rewritten during the run" in changed
    assert error is not None and str(error) == changed


def test_the_servers_health_fails_once_the_model_file_changed(tiny, tmp_path: Path) -> None:
    import httpx

    from bmoe.server.app import create_app
    from tests.test_server import CONFIG as SERVED
    from tests.test_server import running

    path = tmp_path / "m.gguf"
    shutil.copy(tiny.path(TinySpec()), path)
    with Session.open(path, SERVED) as session, running(create_app(session)) as url:
        assert httpx.get(f"{url}/health").json() == {"status": "ok"}
        os.truncate(path, path.stat().st_size - 4096)
        r = httpx.get(f"{url}/health")
        assert r.status_code == 503 and "truncated during the run" in r.json()["error"]["message"], r.text
