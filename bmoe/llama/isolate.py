"""The first open of a file happens in a child process, so that what llama.cpp aborts on kills
the child, not the user's process.

No list of metadata checks is ever complete (``bmoe.io.hparams`` holds the known ones): a
``GGML_ASSERT`` in llama.cpp ends the process with SIGABRT and no way to catch it, and some files
decode forever. So before a process loads a file it has not seen, a child loads it the cheap way
(the dense bytes only, where memory allows) and decodes a few tokens. A child killed by a signal
or still busy at the time limit becomes one line naming llama.cpp's own assertion (or the time
limit), and the parent never loads the file. Files that passed are remembered in the user cache
directory, keyed by a digest of every shard's header (metadata and tensor index: all llama.cpp
sizes its work from) and size, and by the llama.cpp pin, so the check is paid once per file. Not by
inode and mtime: a file rewritten in place with its mtime set back kept the verdict of the bytes
it replaced, and a value llama.cpp aborts on was then loaded in the user's process.

``BMOE_ISOLATE=0`` turns the check off (the test suite's many tiny models);
``BMOE_ISOLATE_TIMEOUT`` sets the time limit in seconds.

Run as ``python -m bmoe.llama.isolate SHARD1``: the child side.
"""

from __future__ import annotations

import hashlib
import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

from bmoe._version import __version__
from bmoe.errors import ConfigError, ModelFileError
from bmoe.io.layout import ModelLayout

ENV_SWITCH = "BMOE_ISOLATE"
ENV_TIMEOUT = "BMOE_ISOLATE_TIMEOUT"
MEMO_NAME = "opened-ok.txt"
# A child needs a couple of seconds to start Python and llama.cpp; a big model's dense bytes at a
# slow disk's speed take longer, hence the allowance per GiB of dense weights.
BASE_TIMEOUT_S = 60.0
TIMEOUT_S_PER_GIB = 30.0
MEMO_MAX_LINES = 4096  # a bounded memo: the oldest keys are forgotten first
# Enough to build and run the graph (where the rope, norm and head-size asserts fire) and sample:
# a two-token prompt and two more tokens. Each decode of a big model costs seconds on 2 cores.
_TEST_PROMPT = "Hello"
_TEST_TOKENS = 2
_ASSERT_LINE = re.compile(r"([^/\s]+:\d+: .*)$")


def enabled() -> bool:
    return os.environ.get(ENV_SWITCH, "1").strip().lower() not in ("0", "no", "off", "false")


def time_limit(layout: ModelLayout) -> float:
    text = os.environ.get(ENV_TIMEOUT)
    if text is None:
        return BASE_TIMEOUT_S + TIMEOUT_S_PER_GIB * layout.dense_bytes / 2**30
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0 < value < 1e6:
        raise ConfigError(f"{ENV_TIMEOUT}={text!r}: expected a number of seconds, above 0")
    return value


def file_key(layout: ModelLayout) -> str:
    """One line naming this file's header bytes and sizes, for this llama.cpp."""
    from bmoe.llama.seam import llama_lib

    return f"bmoe {__version__} llama_cpp {llama_lib().__version__} {header_digest(layout)}"


def header_digest(layout: ModelLayout) -> str:
    """SHA-256 of every shard's bytes up to its first tensor's data (the whole shard when it holds
    none), with its size: what the open parsed, read again (a few MiB at most for a big
    vocabulary). The tensor data is not read: llama.cpp sizes and checks nothing from it."""
    h = hashlib.sha256()
    for i, shard in enumerate(layout.shards):
        starts = [s.offset for s in layout.tensors.values() if s.shard == i]
        fd = os.open(shard, os.O_RDONLY)
        try:
            size = os.fstat(fd).st_size
            end = min(min(starts, default=size), size)
            h.update(f"shard {i} size {size} header {end}\n".encode())
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)  # no read-ahead into tensor data
            pos = 0
            while pos < end:
                chunk = os.pread(fd, min(1 << 20, end - pos), pos)
                if not chunk:
                    break  # shrunk since the open read it: the digest differs, a new check runs
                h.update(chunk)
                pos += len(chunk)
            os.posix_fadvise(fd, 0, end, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return h.hexdigest()


def memo_path() -> Path:
    from bmoe.io.probe import cache_dir

    return cache_dir() / MEMO_NAME


def _remembered(key: str, memo: Path) -> bool:
    try:
        with memo.open(encoding="utf-8", errors="replace") as f:
            return any(line.rstrip("\n") == key for line in f)
    except OSError:
        return False


def _remember(key: str, memo: Path) -> None:
    """Append the key (one short write with O_APPEND, safe beside another process); a cache that
    cannot be written only costs another check next time."""
    try:
        memo.parent.mkdir(parents=True, exist_ok=True)
        lines = memo.read_text(encoding="utf-8", errors="replace").splitlines() if memo.exists() else []
        if len(lines) >= MEMO_MAX_LINES:
            tmp = memo.with_name(f".{memo.name}.{os.getpid()}")
            tmp.write_text("".join(f"{line}\n" for line in lines[-MEMO_MAX_LINES // 2 :]), encoding="utf-8")
            tmp.replace(memo)
        fd = os.open(memo, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, f"{key}\n".encode())
        finally:
            os.close(fd)
    except OSError:
        pass


def check_first_open(layout: ModelLayout, *, timeout_s: float | None = None, memo: Path | None = None) -> bool:
    """Raise ``ModelFileError`` if a child process cannot load ``layout``'s file and decode a few
    tokens; return whether a child ran (False: turned off, or the file passed before)."""
    if not enabled():
        return False
    memo = memo or memo_path()
    key = file_key(layout)
    if _remembered(key, memo):
        return False
    _run_child(layout, time_limit(layout) if timeout_s is None else timeout_s)
    _remember(key, memo)
    return True


def _run_child(layout: ModelLayout, timeout_s: float) -> None:
    path = layout.shards[0]
    env = os.environ | {ENV_SWITCH: "0", "GGML_NO_BACKTRACE": "1"}
    cmd = [sys.executable, "-m", "bmoe.llama.isolate", str(path)]
    try:
        child = subprocess.Popen(
            cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env,
            start_new_session=True,  # a Ctrl-C meant for the user's run must not orphan the child
        )
    except OSError as e:
        raise ModelFileError(f"{path}: could not start the test open in a child process: {e}") from e
    try:
        _, err = child.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(child.pid, signal.SIGKILL)
        child.communicate()
        raise ModelFileError(
            f"{path}: llama.cpp did not finish a test load and {_TEST_TOKENS}-token decode of this file "
            f"within {timeout_s:.0f} s (a decode that never returns; {ENV_TIMEOUT} sets the limit)"
        ) from None
    except BaseException:
        os.killpg(child.pid, signal.SIGKILL)
        child.communicate()
        raise
    if child.returncode == 0:
        return
    text = err.decode(errors="replace")
    if child.returncode < 0:
        sig = signal.Signals(-child.returncode).name
        raise ModelFileError(
            f"{path}: llama.cpp kills the process on this file ({sig} in a test open in a child process): "
            f"{_assertion(text)}"
        )
    raise ModelFileError(f"{path}: a test open in a child process failed: {_last_error(text)}")


def _assertion(stderr: str) -> str:
    """llama.cpp's own message, without the build machine's path: ``ops.cpp:4132: GGML_ASSERT(..) failed``."""
    for line in stderr.splitlines():
        if "GGML_ASSERT" in line or "GGML_ABORT" in line or "fatal error" in line:
            m = _ASSERT_LINE.search(line.strip())
            return m[1] if m else line.strip()
    last = [line for line in stderr.splitlines() if line.strip()]
    return last[-1].strip() if last else "no message"


def _last_error(stderr: str) -> str:
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    for line in reversed(lines):
        if line.startswith("bmoe: error: "):
            return line[len("bmoe: error: ") :]
    return lines[-1] if lines else "no message"


def _child(path: str) -> int:
    """Load the file the cheap way, no validation (the parent did that), decode a few tokens."""
    import numpy as np

    from bmoe.llama.callback import EvalCallback
    from bmoe.llama.loader import open_model
    from bmoe.llama.seam import LlamaModel
    from bmoe.errors import BmoeError
    from bmoe.io.layout import read_layout
    from bmoe.io.regions import unmap
    from bmoe.pipeline.gate import RoutingGate

    try:
        layout = read_layout(path)
        opened = open_model(layout, streaming=True, mode="auto")
        zeros = _zero_experts(opened, layout) if opened.open_mode == "reserved" else []
        threads = len(os.sched_getaffinity(0))
        model = LlamaModel(opened, n_ctx=64, n_threads=threads, callback=EvalCallback(RoutingGate()), install=False)
        try:
            tokens = model.tokenize(_TEST_PROMPT)[:2] or [0]
            model.decode(tokens)
            for _ in range(_TEST_TOKENS):
                token = int(np.argmax(model.logits()))
                model.piece(token)
                model.decode([token])
        finally:
            model.close()
            for addr, length in zeros:
                unmap(addr, length)
    except BmoeError as e:
        print(f"bmoe: error: {e}", file=sys.stderr)
        return 1
    return 0


def _zero_experts(opened: Any, layout: ModelLayout) -> list[tuple[int, int]]:
    """Point a reserved open's expert tensors at zeros for the test decode. Their reservation is
    ``PROT_NONE`` until a session binds its own regions, so a decode on them dies of SIGSEGV, and
    every model past RAM + swap (the reason the reserved open exists) was refused as one llama.cpp
    kills. Private read-only anonymous pages read as the kernel's zero page: no memory, no commit
    charge, whatever the bank's size; the check is of llama.cpp's graph on this file, not of the
    expert values. Returns the mappings to unmap after the model is freed."""
    from bmoe.io.ggml import GgmlTensor
    from bmoe.io.regions import map_zeros

    out: list[tuple[int, int]] = []
    for key, addr in opened.expert_tensors(layout).items():
        length = layout.experts[key].span.nbytes
        out.append((map_zeros(length), length))
        GgmlTensor.from_address(addr).data = out[-1][0]
    return out


if __name__ == "__main__":
    sys.exit(_child(sys.argv[1]))
