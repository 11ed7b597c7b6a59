"""Running one side of the bench: one configuration in a fresh child process
(``python -m bmoe.bench.child SPEC RESULT``), and what became of it: the child's result, or one
line saying how it failed (an error it reported, a timeout, a signal: an OOM kill or llama.cpp
aborting). The process boundary is the point: peak RSS is the run's own, no mapping of an earlier
run keeps file pages cached, and a run that dies under a RAM limit is a row, not the bench's end.

``spawn`` is ``subprocess.run`` unless a test hands in its own."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from bmoe.bench.options import WARMUP_PROMPT, BenchOptions
from bmoe.bench.plan import Outcome, Run

Spawn = Callable[..., "subprocess.CompletedProcess[str]"]


def child_spec(run: Run, model: Path, opts: BenchOptions) -> dict[str, Any]:
    """What the child of ``run`` is told: its side, its engine settings, the prompt and counts."""
    return {
        "kind": run.kind, "model": str(model), "config": run.config, "prompt": opts.prompt,
        "tokens": opts.tokens, "warmup": run.warmup, "warmup_tokens": opts.warmup,
        "warmup_prompt": WARMUP_PROMPT, "n_threads": opts.n_threads, "n_ctx": opts.n_ctx, **run.extra,
    }


def execute(run: Run, model: Path, opts: BenchOptions, scratch: Path, spawn: Spawn = subprocess.run) -> Outcome:
    """Run one configuration in a child process and say what became of it."""
    timeout = run.timeout_s or opts.timeout_s
    spec_path, result_path = scratch / f"{run.id}.spec.json", scratch / f"{run.id}.result.json"
    spec_path.write_text(json.dumps(child_spec(run, model, opts)))
    result_path.unlink(missing_ok=True)
    try:
        proc = spawn(
            [sys.executable, "-m", "bmoe.bench.child", str(spec_path), str(result_path)],
            check=False, capture_output=True, text=True, timeout=timeout,
        )
    except subprocess.TimeoutExpired:
        partial = json.loads(result_path.read_text()) if result_path.exists() else {}
        if "partial" in partial:  # the measured generation finished: keep it, say what is missing
            missing = f"timed out after {timeout:.0f} s {partial.pop('partial')}"
            partial["warnings"] = [*partial.get("warnings", []), missing]
            return Outcome(result=partial)
        return Outcome(error=f"timed out after {timeout:.0f} s")
    if result_path.exists():
        data = json.loads(result_path.read_text())
        return Outcome(error=data["error"]) if "error" in data else Outcome(result=data)
    return Outcome(error=death(proc.returncode, proc.stderr))


def death(returncode: int, stderr: str) -> str:
    """One line for a child that left no result: how it ended, its last words, the likely cause."""
    tail = (stderr.strip().splitlines() or [""])[-1]
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        how = f"killed by {name}"
    else:
        how = f"exit status {returncode}"
    # SIGKILL: the kernel's OOM killer, most likely; SIGABRT/SIGILL: llama.cpp aborting (GGML_ASSERT,
    # a failed allocation) or an instruction this CPU lacks.
    why = {-signal.SIGKILL: " (out of memory?)",
           -signal.SIGABRT: " (llama.cpp aborted: an assertion or a failed allocation?)",
           -signal.SIGILL: " (llama.cpp aborted, or an instruction this CPU lacks)"}.get(returncode, "")
    return f"child {how}" + (f": {tail}" if tail else "") + why


@contextmanager
def terminate_as_exit() -> Iterator[None]:
    """SIGTERM unwinds like Ctrl-C (finally blocks run: the balloon and a running child die)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, _frame: object) -> None:
        raise SystemExit(128 + signum)

    old = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)
