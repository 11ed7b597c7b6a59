"""Helpers the tests share: the prompt and length every gate uses, tiny models written once per
session, and the two ways a gate produces tokens (a Session, or a bare seam.LlamaModel). Fixtures and
pytest hooks stay in ``conftest.py``; this is a plain module so tests import it by name."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

from bmoe.engine.config import RunConfig
from bmoe.engine.session import Session
from bmoe.pipeline.hooks import Hooks
from bmoe.synth.tiny import TinySpec, write_tiny

PROMPT = "Routed experts stream from the disk, token after token."  # >= 16 byte-level tokens
N_TOKENS = 24


class TinyModels:
    def __init__(self, root: Path) -> None:
        self._root = root
        self._paths: dict[TinySpec, Path] = {}
        self._resident: dict[Path, list[int]] = {}

    def path(self, spec: TinySpec) -> Path:
        if spec not in self._paths:
            folder = self._root / f"m{len(self._paths)}"
            folder.mkdir()
            self._paths[spec] = write_tiny(folder / "tiny.gguf", spec)[0]
        return self._paths[spec]

    def resident_tokens(self, path: Path) -> list[int]:
        if path not in self._resident:
            self._resident[path] = generate_tokens(path, RunConfig(mode="resident", n_ctx=256))
        return self._resident[path]


def generate_tokens(path: Path, config: RunConfig, hooks: Hooks | None = None,
                    prompt: str = PROMPT, n: int = N_TOKENS) -> list[int]:
    async def go() -> list[int]:
        with Session.open(path, config, hooks=hooks) as session:
            return (await session.generate(prompt, n, stop_at_end=False)).tokens

    return asyncio.run(go())


def greedy_on(model, n: int, prompt: str = PROMPT):  # noqa: ANN001, ANN201
    """Logits after ``prompt`` and ``n`` greedy tokens, straight on a seam.LlamaModel."""
    import numpy as np

    model.decode(model.tokenize(prompt))
    first = model.logits().copy()
    tokens = []
    for _ in range(n):
        tokens.append(int(np.argmax(model.logits())))
        model.decode([tokens[-1]])
    return first, tokens


def resident_mismatches(session: Session) -> list[tuple[int, int, int]]:
    """Every (layer, projection, expert) the streamed ``session`` marks resident whose bytes in
    memory are not the file's: the gate's fast path computes on exactly these bytes with no read,
    so any entry here is a token computed on bytes that were not the model's."""
    import ctypes
    import os

    residency = session._streaming.residency  # noqa: SLF001 - what the fast path reads
    layout = residency.layout
    bad = []
    fds = [os.open(shard, os.O_RDONLY) for shard in layout.shards]
    try:
        for layer in layout.moe_layers:
            for expert in residency.maps[layer].nonzero()[0].tolist():
                for request in residency.requests(layer, expert):
                    want = os.pread(fds[request.shard], request.nbytes, request.offset)
                    if ctypes.string_at(request.dest, len(want)) != want:
                        bad.append((layer, request.key.proj, expert))
    finally:
        for fd in fds:
            os.close(fd)
    return bad


# --- the command line: one subprocess helper, and the in-process twin for argument errors ---------

CLI_TIMEOUT_S = 120  # a guard against a hang, never a timing assertion


def bmoe(*args: str | bytes | os.PathLike[str], stdin: str | bytes | None = None, cwd: Path | None = None,
         env: dict[str, str] | None = None, binary: bool = False, stdout: int | None = subprocess.PIPE,
         timeout: float = CLI_TIMEOUT_S) -> subprocess.CompletedProcess:
    """``python -m bmoe.cli ARGS`` in a child process, for tests whose point is the process edge (an
    exit status, a signal, standard streams, what reaches the terminal). Text unless ``binary``; an
    argument error alone is cheaper in process (``cli``)."""
    if stdin is None:
        stdin = b"" if binary else ""
    elif binary and isinstance(stdin, str):
        stdin = stdin.encode()
    return subprocess.run([sys.executable, "-m", "bmoe.cli", *map(_arg, args)], input=stdin, stdout=stdout,
                          stderr=subprocess.PIPE, text=not binary, timeout=timeout, cwd=cwd, env=env)


def _arg(a: str | bytes | os.PathLike[str]) -> str | bytes:
    return a if isinstance(a, (str, bytes)) else os.fspath(a)


def one_line(proc: subprocess.CompletedProcess, status: int) -> str:
    """The one ``bmoe: error:`` line a failed command prints, checked to be alone, with ``status``."""
    err = proc.stderr.decode(errors="replace") if isinstance(proc.stderr, bytes) else proc.stderr
    assert proc.returncode == status, (proc.returncode, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("bmoe: error: "), err
    return lines[0]


def cli(*args: str | os.PathLike[str]) -> subprocess.CompletedProcess[str]:
    """``bmoe ARGS`` run in this process (``bmoe.cli.main``), its status and its standard streams
    captured as a child's would be: for argument errors and help, where no process boundary is
    the point (a child costs a Python start and bmoe's imports, about a second each)."""
    import contextlib
    import io

    from bmoe.cli import main

    out, err = io.StringIO(), io.StringIO()
    argv = [os.fspath(a) for a in args]
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            status = main(argv)
        except SystemExit as exit_:  # argparse's usage errors and --help
            status = exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
    return subprocess.CompletedProcess(["bmoe", *argv], status, out.getvalue(), err.getvalue())
