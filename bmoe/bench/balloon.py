"""A memory balloon: emulate a smaller machine by locking anonymous memory in a helper process.

``plan_balloon`` is pure arithmetic over numbers read (or injected by a test): how much to lock so
that only ``limit`` bytes stay available to the page cache and the engine together, refused when
that leaves less than the model's dense part + 1 GiB, or when RLIMIT_MEMLOCK forbids the lock.
``Balloon`` runs the lock in a child process (``python -m bmoe.bench.balloon BYTES PARENT_PID``):

- the child maps anonymous memory, ``mlock``s it (which faults every page in), says ``locked N``
  on stdout and then waits; it exits when its stdin reaches end of file, when its parent pid
  changes, or at once with SIGKILL when the parent dies (``prctl(PR_SET_PDEATHSIG)``);
- the parent kills it in ``release`` (called from ``__exit__``: on success, on error, on Ctrl-C).

``Balloon(n, lock=False)`` only writes every page instead of locking it (``held N``): no privilege
needed, the same effect on a machine without swap, and what the tests use to squeeze a run.

Locked pages are neither reclaimable nor swappable, so while the balloon stands MemAvailable is
what the limit says (give or take what other processes do meanwhile: the harness re-reads it).
"""

from __future__ import annotations

import ctypes
import mmap
import os
import resource
import select
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Self

from bmoe.errors import BudgetError
from bmoe.pipeline.budget import read_meminfo

MiB = 1 << 20
GiB = 1 << 30
HEADROOM = GiB  # the least a limit may leave beyond the model's dense part
_PR_SET_PDEATHSIG = 1
_CAP_IPC_LOCK = 14


@dataclass(frozen=True)
class BalloonPlan:
    limit_bytes: int
    available_bytes: int  # MemAvailable (or the cgroup's room, if smaller) when planned
    lock_bytes: int  # 0: nothing to lock, the machine already has no more than the limit
    how: str


def size(nbytes: int) -> str:
    """A byte count for people: GiB from 1 GiB on, MiB below."""
    return f"{nbytes / GiB:.2f} GiB" if abs(nbytes) >= GiB else f"{nbytes / MiB:.1f} MiB"


def has_cap_ipc_lock() -> bool:
    """Whether this process may lock memory past RLIMIT_MEMLOCK (CAP_IPC_LOCK, e.g. root)."""
    try:
        with open("/proc/self/status") as f:
            caps = next(int(line.split()[1], 16) for line in f if line.startswith("CapEff:"))
    except (OSError, StopIteration, ValueError):
        return os.geteuid() == 0
    return bool(caps >> _CAP_IPC_LOCK & 1)


def cgroup_room() -> int | None:
    """memory.max - memory.current of this process's cgroup (v2), None when unlimited/unknown."""
    try:
        with open("/proc/self/cgroup") as f:
            rel = next(line.split(":", 2)[2].strip() for line in f if line.startswith("0::"))
        base = f"/sys/fs/cgroup{rel}".rstrip("/")
        with open(f"{base}/memory.max") as f:
            top = f.read().strip()
        if top == "max":
            return None
        with open(f"{base}/memory.current") as f:
            return max(0, int(top) - int(f.read().strip()))
    except (OSError, StopIteration, ValueError, IndexError):
        return None


def available_bytes(meminfo: Mapping[str, int] | None = None, cgroup: int | None = None) -> tuple[int, str]:
    """(bytes, how): MemAvailable, or the cgroup's room when that is smaller."""
    info = read_meminfo() if meminfo is None else meminfo
    avail = info.get("MemAvailable")
    if avail is None:
        raise BudgetError("/proc/meminfo has no MemAvailable: cannot size a RAM limit on this kernel")
    if cgroup is not None and cgroup < avail:
        return cgroup, f"cgroup memory.max - memory.current ({cgroup / GiB:.2f} GiB, below MemAvailable)"
    return avail, f"MemAvailable ({avail / GiB:.2f} GiB)"


def plan_balloon(
    limit_bytes: int,
    dense_bytes: int,
    *,
    meminfo: Mapping[str, int] | None = None,
    cgroup: int | None = None,
    memlock: tuple[int, int] | None = None,
    privileged: bool | None = None,
) -> BalloonPlan:
    """How much to lock so that ``limit_bytes`` stay available. Every input can be injected:
    ``meminfo`` (bytes, as ``read_meminfo`` gives), ``cgroup`` room, ``memlock`` (soft, hard
    RLIMIT_MEMLOCK) and ``privileged`` (CAP_IPC_LOCK); by default they are read from this machine."""
    if limit_bytes <= 0:
        raise BudgetError(f"a RAM limit must be positive, got {limit_bytes} bytes")
    floor = dense_bytes + HEADROOM
    if limit_bytes < floor:
        raise BudgetError(
            f"--ram-limit {size(limit_bytes)} is too tight: it must leave at least the model's "
            f"dense part ({size(dense_bytes)}) + {size(HEADROOM)} = {size(floor)}; refusing to lock memory"
        )
    avail, what = available_bytes(meminfo, cgroup_room() if meminfo is None and cgroup is None else cgroup)
    lock = avail - limit_bytes
    if lock <= 0:
        return BalloonPlan(limit_bytes, avail, 0, f"{what} is already <= the {limit_bytes / GiB:.2f} GiB "
                                                  "limit: nothing locked")
    soft, _hard = resource.getrlimit(resource.RLIMIT_MEMLOCK) if memlock is None else memlock
    may_exceed = has_cap_ipc_lock() if privileged is None else privileged
    if not may_exceed and soft != resource.RLIM_INFINITY and soft < lock:
        raise BudgetError(
            f"--ram-limit needs {lock / GiB:.2f} GiB locked but RLIMIT_MEMLOCK allows "
            f"{soft / MiB:.0f} MiB and this process lacks CAP_IPC_LOCK: raise it (`ulimit -l unlimited`, "
            "or memlock in /etc/security/limits.conf) or run as root"
        )
    return BalloonPlan(limit_bytes, avail, lock, f"locked {what} - limit {limit_bytes / GiB:.2f} GiB = "
                                                 f"{lock / GiB:.2f} GiB of anonymous memory (mlock)")


def die_with_parent() -> None:
    """Ask the kernel to SIGKILL this process when its parent dies (Linux; a no-op elsewhere)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        pass


class Balloon:
    """The lock, held by a child process from ``inflate`` until ``release`` (idempotent)."""

    def __init__(self, lock_bytes: int, *, timeout_s: float | None = None, lock: bool = True) -> None:
        self.lock_bytes = lock_bytes
        self.lock = lock
        # mlock faults in and zeroes every page: 2.5 s per GiB measured on this project's VMs;
        # allow twice that, plus a floor.
        self.timeout_s = timeout_s if timeout_s is not None else 30.0 + 5.0 * lock_bytes / GiB
        self._proc: subprocess.Popen[bytes] | None = None
        self.inflate_s: float | None = None  # from start to every page held
        self._t0 = 0.0
        self._buf = b""

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def inflate(self) -> Self:
        """Start the child and wait until every page is locked (or written)."""
        return self.start().wait_ready()

    def start(self) -> Self:
        """Start the child and return at once: memory goes while the caller carries on (a squeeze
        mid-run); ``ready_nowait`` or ``wait_ready`` tell when it is all taken."""
        if self._proc is not None:
            raise BudgetError("balloon already inflated")
        self._t0 = time.perf_counter()
        self._buf = b""
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "bmoe.bench.balloon", str(self.lock_bytes), str(os.getpid()),
             *([] if self.lock else ["--touch"])],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        )
        return self

    def wait_ready(self) -> Self:
        try:
            self._check(self._first_line())
        except BaseException:
            self.release()
            raise
        return self

    def ready_nowait(self) -> bool:
        """Whether the child has said it holds its memory; raises if it failed instead."""
        if self.inflate_s is not None:
            return True
        chunk = self._read_some(0.0)
        if b"\n" not in self._buf and chunk != b"":
            return False  # nothing yet, or half a line
        try:
            self._check(self._buf.decode(errors="replace").strip())
        except BaseException:
            self.release()
            raise
        return True

    def _check(self, line: str) -> None:
        assert self._proc is not None
        if not line.startswith(("locked ", "held ")):
            code = self._proc.wait(timeout=5)
            err = (self._proc.stderr.read() if self._proc.stderr else b"").decode(errors="replace")
            last = (err.strip().splitlines() or [""])[-1]
            reason = line or last or f"it exited with status {code}" + (
                " (killed: out of memory?)" if code == -signal.SIGKILL else "")
            raise BudgetError(f"the memory balloon could not lock {self.lock_bytes / GiB:.2f} GiB: {reason}")
        self.inflate_s = time.perf_counter() - self._t0

    def _read_some(self, wait_s: float) -> bytes | None:
        """Append what the child wrote within ``wait_s`` to the buffer; b"" at end of file."""
        assert self._proc is not None and self._proc.stdout is not None
        fd = self._proc.stdout.fileno()
        ready, _, _ = select.select([fd], [], [], wait_s)
        if not ready:
            return None
        chunk = os.read(fd, 4096)
        self._buf += chunk
        return chunk

    def _first_line(self) -> str:
        deadline = time.monotonic() + self.timeout_s
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0:
                raise BudgetError(f"the memory balloon did not lock {self.lock_bytes / GiB:.2f} GiB "
                                  f"within {self.timeout_s:.0f} s")
            if self._read_some(min(left, 0.5)) == b"":
                break
        return self._buf.decode(errors="replace").strip()

    def alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def release(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        for stream in (proc.stdin, proc.stdout, proc.stderr):
            if stream is not None:
                stream.close()

    def __enter__(self) -> Self:
        return self.inflate()

    def __exit__(self, *exc: object) -> None:
        self.release()


def _set_oom_score_adj(value: int) -> None:
    try:
        with open("/proc/self/oom_score_adj", "w") as f:
            f.write(str(value))
    except OSError:
        pass  # lowering needs CAP_SYS_RESOURCE; raising is always allowed


def offer_to_oom_killer() -> None:
    """A run under test goes first when it outgrows the limit: the kernel must kill that run
    (a failed row), not the balloon (which would lift the limit for the runs after it)."""
    _set_oom_score_adj(1000)


def _spare_from_oom_killer() -> None:
    """The balloon is the machine being emulated, not a contender (where the sandbox allows)."""
    _set_oom_score_adj(-1000)


def _hold(nbytes: int, parent: int, wait: Callable[[], bool], lock: bool = True) -> int:
    die_with_parent()
    if os.getppid() != parent:  # the parent died before the death signal was armed
        return 1
    _spare_from_oom_killer()
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mlock.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    region = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    addr = ctypes.addressof(ctypes.c_char.from_buffer(region))
    if not lock:
        ctypes.memset(addr, 1, nbytes)  # every page written: taken, as anonymous memory without swap is
        print(f"held {nbytes}", flush=True)
        while wait():
            if os.getppid() != parent:
                break
        return 0
    if libc.mlock(addr, nbytes) != 0:
        err = ctypes.get_errno()
        hint = {
            1: "not permitted (RLIMIT_MEMLOCK / CAP_IPC_LOCK)",
            12: "out of memory, or above RLIMIT_MEMLOCK",
            11: "some of the memory could not be locked",
        }.get(err, os.strerror(err))
        print(f"mlock of {nbytes} bytes failed: {hint}", flush=True)
        return 1
    print(f"locked {nbytes}", flush=True)
    while wait():
        if os.getppid() != parent:
            break
    return 0


def _stdin_open() -> bool:
    """Wait up to 1 s; False once stdin (the parent's pipe) reaches end of file."""
    ready, _, _ = select.select([sys.stdin.fileno()], [], [], 1.0)
    return not (ready and not os.read(sys.stdin.fileno(), 4096))


def main(argv: list[str]) -> int:
    if len(argv) not in (2, 3) or argv[2:] not in ([], ["--touch"]):
        print("usage: python -m bmoe.bench.balloon BYTES PARENT_PID [--touch]", file=sys.stderr)
        return 2
    try:
        return _hold(int(argv[0]), int(argv[1]), _stdin_open, lock=argv[2:] != ["--touch"])
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
