"""A run stopped by a signal keeps what it wrote: the decode stops, the CSV holds every token so far
and its summary line, the route trace is complete, and the status says which signal (128 + n)."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from bmoe.metrics.sinks import read_csv
from bmoe.pipeline.trace import read_trace
from bmoe.synth.tiny import TinySpec
from tests.helpers import PROMPT


def _rows(path: Path) -> int:
    try:
        return sum(1 for line in path.read_text().splitlines() if line and not line.startswith("#")) - 1
    except OSError:
        return 0


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP, signal.SIGINT])
def test_a_signal_mid_run_flushes_the_sinks_and_exits_128_plus_n(tiny, tmp_path: Path, sig: int) -> None:
    model = tiny.path(TinySpec())
    csv_path, trace_path = tmp_path / "m.csv", tmp_path / "r.trace"
    proc = subprocess.Popen(
        [sys.executable, "-m", "bmoe.cli", "run", "-m", str(model), "-p", PROMPT, "-n", "1900", "-c", "2048",
         "--csv", str(csv_path), "--route-trace", str(trace_path)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        # Mid-run: the CSV has rows (its writer flushes in blocks), the run is far from its end.
        deadline = time.monotonic() + 60
        while _rows(csv_path) < 3 and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        assert proc.poll() is None, ("the run ended before the signal", proc.stderr.read() if proc.stderr else "")
        proc.send_signal(sig)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + sig, err
    assert "Traceback" not in err
    assert err.strip().splitlines()[-1].startswith("bmoe: interrupted by"), err
    _, rows, summary = read_csv(csv_path)
    assert summary is not None, "no summary line"
    assert 3 <= len(rows) < 1900
    assert [int(r["index"]) for r in rows] == list(range(len(rows)))  # every token so far, in order
    assert summary["n_tokens"] == len(rows)
    trace = read_trace(trace_path)
    assert trace.n_layer == 2


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_while_a_piped_chat_waits_for_a_line_ends_it(tiny, sig: int) -> None:
    """Standard input a pipe that stays open (a script or another program feeding the chat): the
    wait for the next line must not outlive a stop signal (a reading thread once kept the process
    alive until the next line came)."""
    proc = subprocess.Popen([sys.executable, "-m", "bmoe.cli", "chat", "-m", str(tiny.path(TinySpec())), "-c", "256",
                             "-n", "4", "-q"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdin is not None and proc.stderr is not None
    try:
        proc.stdin.write(b"hello\n")
        proc.stdin.flush()
        seen = b""
        while seen.count(b"> ") < 2:  # the reply is done and the second prompt waits for a line
            byte = proc.stderr.read(1)
            assert byte, seen
            seen += byte
        # A reader thread blocked in the pipe is what held the process: let it get there if there
        # is one (the kernel names its wait), so that the signal finds the state that hung.
        for _ in range(200):
            if any("pipe_read" in w.read_text() for w in Path(f"/proc/{proc.pid}/task").glob("*/wchan")):
                break
            time.sleep(0.01)
        proc.send_signal(sig)
        proc.wait(60)  # a guard against the hang, not a timing
        err = proc.stderr.read().decode()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdin.close()
    assert proc.returncode == 128 + sig, err
    assert "Traceback" not in err and err.strip().startswith("bmoe: interrupted by"), err


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP, signal.SIGINT])
def test_a_signal_stops_the_server_after_its_route_trace_is_written(tiny, tmp_path: Path, sig: int) -> None:
    """uvicorn re-raised SIGTERM after its graceful shutdown and SIGHUP was not handled: either
    killed ``bmoe serve`` before the session closed, leaving the route trace empty."""
    trace_path = tmp_path / "serve.trace"
    proc = subprocess.Popen([sys.executable, "-m", "bmoe.cli", "serve", "-m", str(tiny.path(TinySpec())), "--port", "0",
                             "-c", "256", "--route-trace", str(trace_path)], stderr=subprocess.PIPE, text=True)
    assert proc.stderr is not None
    try:
        url = proc.stderr.readline().split()[-1]
        body = httpx.post(f"{url}/completions", json={"prompt": PROMPT, "max_tokens": 5}, timeout=120).json()
        assert body["usage"]["completion_tokens"] == 5
        proc.send_signal(sig)
        err = proc.communicate(timeout=60)[1]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 128 + sig, err
    # the server's own line: "bmoe: interrupted by ...; the output written so far is complete" was run's
    assert err.strip().splitlines()[-1] == f"bmoe serve: stopped by {signal.Signals(sig).name}", err
    assert read_trace(trace_path).n_layer == 2


def test_a_second_sigint_forces_the_servers_exit_without_a_traceback(tiny) -> None:
    """uvicorn's forced exit cancels the lifespan task, and starlette logged that as a failed
    shutdown, traceback and all."""
    proc = subprocess.Popen([sys.executable, "-m", "bmoe.cli", "serve", "-m", str(tiny.path(TinySpec())), "--port", "0",
                             "-c", "256"], stderr=subprocess.PIPE, text=True)
    assert proc.stderr is not None
    try:
        assert "bmoe serve:" in proc.stderr.readline()
        proc.send_signal(signal.SIGINT)
        time.sleep(0.05)  # two deliveries, not one pending signal (the check does not depend on it)
        proc.send_signal(signal.SIGINT)
        err = proc.communicate(timeout=60)[1]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 128 + signal.SIGINT, err
    assert "Traceback" not in err and "CancelledError" not in err, err
