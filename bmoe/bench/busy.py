"""CPU contention for the bench (``--busy N``): N processes that each spin on a core beside the
engine during the measured runs, as the balloon takes memory, so "a laptop doing other things"
is a measured row rather than a guess.

Each spinner is ``python -m bmoe.bench.busy PARENT_PID``: it asks the kernel to kill it when its
parent dies (``prctl(PR_SET_PDEATHSIG)``), also stops when its parent's pid changes, and burns
CPU in pure Python (no syscalls, no memory to speak of) otherwise. ``Spinners.stop`` kills them
(from ``__exit__``: on success, on error, on Ctrl-C)."""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Self


class Spinners:
    """``n`` spinning child processes, started by ``start`` and killed by ``stop``."""

    def __init__(self, n: int) -> None:
        self.n = n
        self._procs: list[subprocess.Popen[bytes]] = []

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._procs]

    def start(self) -> Self:
        for _ in range(self.n):
            self._procs.append(subprocess.Popen(
                [sys.executable, "-m", "bmoe.bench.busy", str(os.getpid())],
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            ))
        return self

    def alive(self) -> int:
        """How many still spin (one killed by the OOM killer, or by a user, is not load any more)."""
        return sum(p.poll() is None for p in self._procs)

    def stop(self) -> None:
        procs, self._procs = self._procs, []
        for p in procs:
            if p.poll() is None:
                p.kill()
        for p in procs:
            p.wait()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def how(self) -> str:
        return (f"{self.n} process(es) each spinning on a core in pure Python (python -m bmoe.bench.busy), "
                "started before the first run and killed after the last: the device probes before the runs "
                "and after them ran without them, each row's own probe with them")


def _spin(parent: int) -> None:
    from bmoe.bench.balloon import die_with_parent

    die_with_parent()
    while True:
        for _ in range(1_000_000):
            pass
        if os.getppid() != parent:
            return


if __name__ == "__main__":
    if len(sys.argv) != 2:
        print("usage: python -m bmoe.bench.busy PARENT_PID (run by `bmoe bench --busy N`)", file=sys.stderr)
        sys.exit(2)
    _spin(int(sys.argv[1]))
