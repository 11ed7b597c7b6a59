"""Issue 15, traces and the device probe: hostile input ends as one line, within seconds, under a
memory cap; the probe's scratch file is bounded and never left behind, not even when killed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from bmoe.errors import TraceFormatError
from bmoe.io import probe
from bmoe.pipeline.trace import read_trace

CAP = 1536 << 20  # address space for the child: numpy and the CLI fit, an unbounded read does not
HEAD = "# route_trace v1\n"
COLS = "turn,phase,step,layer,slot,expert,weight,residency,expert_bytes\n"


def _capped_replay(path: Path | str, tmp: Path) -> subprocess.CompletedProcess[str]:
    code = textwrap.dedent(f"""
        import resource, sys
        resource.setrlimit(resource.RLIMIT_AS, ({CAP}, {CAP}))
        from bmoe.cli import main
        sys.argv = ["bmoe", "replay", {str(path)!r}, "--cache-mb", "1"]
        sys.exit(main())
    """)
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp)}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env)


CASES = {
    "zero": None,  # /dev/zero
    "binary": bytes(range(256)) * 64,
    "long-line": HEAD.encode() + b"# " + b"x" * 100_000 + b"\n",
    "layers": (HEAD + "# model=m arch=qwen3moe n_layer=2000000000 n_expert=8 n_expert_used=2\n").encode(),
    "experts": (HEAD + "# model=m arch=qwen3moe n_layer=2 n_expert=99999999999 n_expert_used=2\n").encode(),
    "expert-bytes": (HEAD + "# model=m arch=qwen3moe n_layer=2 n_expert=8 n_expert_used=2\n"
                     "# layer=0 expert_bytes=1000000000000000 dense_bytes=0\n").encode(),
    "layer-index": (HEAD + "# model=m arch=qwen3moe n_layer=2 n_expert=8 n_expert_used=2\n"
                    "# layer=2000000000 expert_bytes=10 dense_bytes=0\n").encode(),
    "used": (HEAD + "# model=m arch=qwen3moe n_layer=2 n_expert=8 n_expert_used=9\n").encode(),
    "latin1": (HEAD + "# model=m\xe9 arch=x n_layer=1 n_expert=8 n_expert_used=2\n").encode("latin-1"),
}


@pytest.mark.pure
@pytest.mark.parametrize("case", sorted(CASES))
def test_hostile_trace_is_one_line_under_a_memory_cap(case: str, tmp_path: Path) -> None:
    data = CASES[case]
    path: Path | str = "/dev/zero"
    if data is not None:
        path = tmp_path / f"{case}.route.csv"
        path.write_bytes(data)
    proc = _capped_replay(path, tmp_path)
    assert proc.returncode == 1, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("bmoe: error:"), proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.pure
def test_header_bounds_in_process(tmp_path: Path) -> None:
    path = tmp_path / "t.route.csv"
    path.write_text(HEAD + "# model=m arch=qwen3moe n_layer=2000000000 n_expert=8 n_expert_used=2\n" + COLS)
    with pytest.raises(TraceFormatError, match=r"t.route.csv:2: n_layer=2000000000 is out of range"):
        read_trace(path)
    path.write_text(HEAD + "# layer=7 expert_bytes=10 dense_bytes=0\n"
                    "# model=m arch=qwen3moe n_layer=2 n_expert=8 n_expert_used=2\n" + COLS)
    with pytest.raises(TraceFormatError, match="describes layer 7 but n_layer=2"):
        read_trace(path)


@pytest.mark.pure
def test_probe_caps_its_scratch_and_leaves_nothing(tmp_path: Path, monkeypatch) -> None:  # noqa: ANN001
    monkeypatch.setattr(probe, "_SCRATCH_BYTES", 4 << 20)
    monkeypatch.setattr(probe, "MAX_PROBE_SLICE", 1 << 20)
    monkeypatch.setattr(probe, "MAX_SCRATCH_BYTES", 8 << 20)
    r = probe.measure(tmp_path, 1 << 40, 1, reads=4)  # an absurd expert size from a corrupt trace
    assert r.slice_bytes == 1 << 40 and "cap" in r.how and r.mib_s > 0
    assert list(tmp_path.iterdir()) == []


@pytest.mark.pure
def test_probe_scratch_is_unnamed_even_when_killed(tmp_path: Path) -> None:
    code = textwrap.dedent(f"""
        import os, sys, time
        from pathlib import Path
        from bmoe.io.probe import _unnamed_scratch
        fd = _unnamed_scratch(Path({str(tmp_path)!r}))
        os.write(fd, b"x" * (1 << 20))
        print("ready", flush=True)
        time.sleep(60)
    """)
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "ready"
        assert list(tmp_path.iterdir()) == []  # nothing named, even while it is written
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=10)
    assert list(tmp_path.iterdir()) == []
