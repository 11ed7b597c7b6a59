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

The child's private writable memory is capped (``RLIMIT_DATA``), so that a size llama.cpp
multiplies into an allocation (a recurrent state sized by ``ssm.inner_size`` = 0xffffffff grew a
child past 10 GB) ends as one line, not as a machine driven into swap or the OOM killer: while it
opens the file, at the largest anonymous allocation an open of this file makes plus a margin;
once it is open, at what it holds then plus what a 64-token context may need. Not ``RLIMIT_AS``:
that counts the file mappings and the reserved open's bank, which cost no memory, and the open
reads it to choose its mode. In a container, a child the cgroup's OOM killer ended is said to be,
with the limit, and not blamed on the file.

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
from bmoe.errors import BmoeError, BudgetError, ConfigError, ModelFileError
from bmoe.io.layout import ModelLayout
from bmoe.pipeline.cgroup import read_cgroup_memory

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
# The child's memory cap: the interpreter, numpy and llama.cpp's own bookkeeping, plus per thread
# a stack and what the decode's threads allocate. A 64-token context's KV and compute buffers are
# tens of MiB even for the largest supported models.
CAP_MARGIN = 1 << 30
CAP_PER_THREAD = 32 << 20
_CAP_LINE = re.compile(r"^bmoe: memory cap (\d+)$", re.M)
_OUT_OF_MEMORY = ("failed to allocate", "insufficient memory", "bad_alloc", "cannot allocate memory",
                  "out of memory", "memoryerror")
MiB = 1 << 20


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


def _child_command(path: Path) -> list[str]:
    return [sys.executable, "-m", "bmoe.llama.isolate", str(path)]


def _oom_kills() -> int | None:
    limits = read_cgroup_memory()
    return None if limits is None else limits.oom_kills


def _run_child(layout: ModelLayout, timeout_s: float) -> None:
    path = layout.shards[0]
    env = os.environ | {ENV_SWITCH: "0", "GGML_NO_BACKTRACE": "1"}
    cmd = _child_command(path)
    oom_before = _oom_kills()
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
    raise verdict(layout, child.returncode, err.decode(errors="replace"), oom_before, _oom_kills())


def verdict(layout: ModelLayout, returncode: int, stderr: str, oom_before: int | None,
            oom_after: int | None) -> BmoeError:
    """The one-line error a failed child becomes. A SIGKILL is never llama.cpp's (it aborts):
    the cgroup's OOM killer when its count rose meanwhile, else the kernel's or someone's; an
    allocation refused at the child's cap is the file's values asking for more than it may."""
    path = layout.shards[0]
    if returncode == -signal.SIGKILL:
        limits = read_cgroup_memory()
        if oom_before is not None and oom_after is not None and oom_after > oom_before and limits is not None:
            return BudgetError(
                f"{path}: the test open of this file in a child process was killed by the container's memory "
                f"limit ({limits.limit // MiB} MiB, {limits.what}); the model's dense part alone is "
                f"{layout.dense_bytes // MiB} MiB: give the container more memory"
            )
        return BudgetError(
            f"{path}: the test open of this file in a child process was killed (SIGKILL, which llama.cpp never "
            "sends: the kernel's OOM killer when memory ran out, or another process)"
        )
    caps = _CAP_LINE.findall(stderr)
    if caps and any(word in stderr.lower() for word in _OUT_OF_MEMORY):
        return ModelFileError(
            f"{path}: the file's first open needed more than {int(caps[-1]) // MiB} MiB, the cap of a test open of "
            f"this file (a size in its metadata multiplies into an allocation no real model makes): {_last_error(stderr)}"
        )
    if returncode < 0:
        sig = signal.Signals(-returncode).name
        return ModelFileError(
            f"{path}: llama.cpp kills the process on this file ({sig} in a test open in a child process): "
            f"{_assertion(stderr)}"
        )
    return ModelFileError(f"{path}: a test open in a child process failed: {_last_error(stderr)}")


def _assertion(stderr: str) -> str:
    """llama.cpp's own message, without the build machine's path: ``ops.cpp:4132: GGML_ASSERT(..) failed``."""
    for line in stderr.splitlines():
        if "GGML_ASSERT" in line or "GGML_ABORT" in line or "fatal error" in line:
            m = _ASSERT_LINE.search(line.strip())
            return m[1] if m else line.strip()
    last = [line for line in stderr.splitlines() if line.strip() and not _CAP_LINE.match(line.strip())]
    return last[-1].strip() if last else "no message"


def _last_error(stderr: str) -> str:
    lines = [line.strip() for line in stderr.splitlines() if line.strip() and not _CAP_LINE.match(line.strip())]
    for line in reversed(lines):
        if line.startswith("bmoe: error: "):
            return line[len("bmoe: error: ") :]
    return lines[-1] if lines else "no message"


def _child(path: str) -> int:
    """Load the file the cheap way, no validation (the parent did that), decode a few tokens."""
    import numpy as np

    from bmoe.llama.callback import EvalCallback
    from bmoe.llama.loader import open_model, user_alloc_bytes
    from bmoe.llama.seam import LlamaModel, last_llama_error
    from bmoe.io.layout import read_layout
    from bmoe.io.regions import unmap
    from bmoe.pipeline.gate import RoutingGate

    try:
        layout = read_layout(path)
        threads = len(os.sched_getaffinity(0))
        margin = CAP_MARGIN + CAP_PER_THREAD * threads
        _cap_data(user_alloc_bytes(layout) + _data_bytes() + margin)  # the largest open's one buffer
        opened = open_model(layout, streaming=True, mode="auto")
        zeros = _zero_experts(opened, layout) if opened.open_mode == "reserved" else []
        _cap_data(_data_bytes() + margin)  # open: what it holds, and a 64-token context's room
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
        said = last_llama_error()
        print(f"bmoe: error: {e}" + (f" ({said})" if said and said not in str(e) else ""), file=sys.stderr)
        return 1
    except MemoryError:
        print("bmoe: error: MemoryError: an allocation was refused", file=sys.stderr)
        return 1
    return 0


def _data_bytes() -> int:
    """This process's private writable memory now (VmData: what ``RLIMIT_DATA`` counts)."""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmData:"))
    except (OSError, StopIteration, ValueError):
        return 0


def _cap_data(nbytes: int) -> None:
    """Lower ``RLIMIT_DATA`` to ``nbytes`` (never above a hard limit already set), and say so on
    stderr for the parent's verdict."""
    import resource

    _, hard = resource.getrlimit(resource.RLIMIT_DATA)
    if hard != resource.RLIM_INFINITY:
        nbytes = min(nbytes, hard)
    try:
        resource.setrlimit(resource.RLIMIT_DATA, (nbytes, hard))
    except (OSError, ValueError):
        return
    print(f"bmoe: memory cap {nbytes}", file=sys.stderr, flush=True)


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
