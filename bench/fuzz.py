"""A seeded mutation fuzzer over a valid tiny model's header and metadata, run the way a user runs.

Each case mutates one copy of a valid model (a byte or a bit flipped in the header, a metadata
value set to a boundary, a value's type changed, a tensor's dimension, type or offset changed, the
file cut short) and runs ``bmoe run`` on it, first-open isolation on, in a worker process. The
only acceptable outcomes are a normal run or one ``bmoe: error:`` line and status 1. Anything
else is counted by class: several lines (llama.cpp's log leaking), an internal error (a Python
exception bmoe did not map), another status, a signal (the worker died), a hang (no answer within
the limit). A worker that dies is replaced, so one abort costs one case, not the campaign.

``tests/test_fuzz.py`` runs a few hundred cases of this under a minute; a longer campaign:

    python bench/fuzz.py --cases 2000 --seed 1 --workers 2 [--arch qwen3moe,gemma4] [--json]

Reported per class, with the cases that failed (seed, index, mutation) so each can be replayed.
"""

from __future__ import annotations

import argparse
import collections
import json
import multiprocessing as mp
import os
import random
import shutil
import struct
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

OK, ONE_LINE = "normal run", "one line, exit 1"
BAD = ("several lines", "internal error", "other status", "signal", "hang")
CASE_TIMEOUT_S = 40.0
ISOLATE_TIMEOUT_S = 10.0
_BOUNDARY = (0, 1, 2, 3, 7, 0xFF, 0xFFFF, 0x7FFFFFFF, 0x80000000, 0xFFFFFFFF)
_FLOATS = (0.0, -0.0, -1.0, float("nan"), float("inf"), float("-inf"), 1e-45, 3.4e38)


@dataclass(frozen=True)
class Case:
    index: int
    arch: str
    kind: str
    offset: int
    data: bytes  # bytes written at offset (empty for a truncation: the file ends at offset)

    def describe(self) -> str:
        what = f"cut at {self.offset}" if self.kind == "truncate" else f"{self.data.hex()} at {self.offset}"
        return f"#{self.index} {self.arch} {self.kind}: {what}"


class Target:
    """A valid model and where its header's parts sit (from gguf-py's reader: tiny, so cheap)."""

    def __init__(self, path: Path, arch: str) -> None:
        from gguf import GGUFReader, GGUFValueType

        self.path, self.arch = path, arch
        self.size = path.stat().st_size
        reader = GGUFReader(path)
        base = reader.data.__array_interface__["data"][0]

        def at(part) -> int:  # noqa: ANN001
            return part.__array_interface__["data"][0] - base

        self.header_end = reader.data_offset
        self.scalars: list[tuple[int, GGUFValueType]] = []  # value offset and type
        self.types: list[int] = []  # offsets of a value's type field
        for field in reader.fields.values():
            if field.name.startswith("GGUF."):
                continue
            self.types.append(at(field.parts[2]))
            vtype = field.types[0]
            if vtype not in (GGUFValueType.ARRAY, GGUFValueType.STRING):
                self.scalars.append((at(field.parts[field.data[0]]), vtype))
        self.keys: list[tuple[str, int]] = []  # (name, offset of the name's first byte)
        for field in reader.fields.values():
            if not field.name.startswith("GGUF.") and field.types[0] not in (GGUFValueType.ARRAY,):
                self.keys.append((field.name, at(field.parts[1])))
        self.tensor_fields: list[tuple[int, int]] = []  # (offset, width) of dims, type, data offset
        for t in reader.tensors:
            parts = t.field.parts
            for part in parts[3:]:
                self.tensor_fields.append((at(part), part.nbytes))

    def mutate(self, rng: random.Random, index: int) -> Case:
        from gguf import GGUFValueType

        kind = rng.choices(("flip", "bit", "value", "type", "tensor", "truncate"), (3, 2, 4, 1, 2, 1))[0]
        if kind in ("flip", "bit"):
            offset = rng.randrange(8, self.header_end)  # past the magic and version
            old = self.path.read_bytes()[offset]
            new = old ^ (rng.randrange(1, 256) if kind == "flip" else 1 << rng.randrange(8))
            return Case(index, self.arch, kind, offset, bytes([new]))
        if kind == "value":
            offset, vtype = rng.choice(self.scalars)
            if vtype in (GGUFValueType.FLOAT32, GGUFValueType.FLOAT64):
                fmt = "<f" if vtype == GGUFValueType.FLOAT32 else "<d"
                return Case(index, self.arch, kind, offset, struct.pack(fmt, rng.choice(_FLOATS)))
            width = {GGUFValueType.UINT8: 1, GGUFValueType.INT8: 1, GGUFValueType.BOOL: 1, GGUFValueType.UINT16: 2,
                     GGUFValueType.INT16: 2, GGUFValueType.UINT64: 8, GGUFValueType.INT64: 8}.get(vtype, 4)
            value = rng.choice(_BOUNDARY + (rng.randrange(1 << (8 * width)),)) % (1 << (8 * width))
            return Case(index, self.arch, kind, offset, value.to_bytes(width, "little"))
        if kind == "type":
            return Case(index, self.arch, kind, rng.choice(self.types), struct.pack("<I", rng.randrange(0, 14)))
        if kind == "tensor":
            offset, width = rng.choice(self.tensor_fields)
            value = rng.choice(_BOUNDARY + (rng.randrange(1 << 16),)) % (1 << (8 * width))
            return Case(index, self.arch, kind, offset, value.to_bytes(width, "little"))
        return Case(index, self.arch, "truncate", rng.randrange(0, self.size), b"")

    def sweep(self, start: int) -> list[Case]:
        """Each scalar key set to 0, 1 and its type's maximum (NaN for floats), and deleted (its
        name changed in place, so llama.cpp no longer finds it)."""
        from gguf import GGUFValueType

        cases = []
        by_offset = dict(self.scalars)
        for name, name_at in self.keys:
            if name == "general.architecture":
                continue
            value_at = next((o for o, _ in self.scalars if o > name_at), None)
            vtype = by_offset.get(value_at)
            if vtype is not None and name_at < value_at < name_at + len(name) + 16:
                if vtype in (GGUFValueType.FLOAT32, GGUFValueType.FLOAT64):
                    fmt = "<f" if vtype == GGUFValueType.FLOAT32 else "<d"
                    values = [struct.pack(fmt, v) for v in (0.0, 1.0, float("nan"))]
                else:
                    width = {GGUFValueType.UINT8: 1, GGUFValueType.INT8: 1, GGUFValueType.BOOL: 1,
                             GGUFValueType.UINT16: 2, GGUFValueType.INT16: 2, GGUFValueType.UINT64: 8,
                             GGUFValueType.INT64: 8}.get(vtype, 4)
                    values = [v.to_bytes(width, "little") for v in (0, 1, (1 << (8 * width)) - 1)]
                for data in values:
                    cases.append(Case(start + len(cases), self.arch, f"set {name}", value_at, data))
            cases.append(Case(start + len(cases), self.arch, f"delete {name}", name_at, b"X"))
        return cases

    def write(self, case: Case, out: Path) -> Path:
        shutil.copyfile(self.path, out)
        with out.open("r+b") as f:
            if case.kind == "truncate":
                f.truncate(case.offset)
            else:
                f.seek(case.offset)
                f.write(case.data)
        return out


# --- the worker: bmoe's own CLI, in a process of its own ---------------------------------------


def _worker(conn, cache_dir: str, isolate: bool) -> None:  # noqa: ANN001
    os.environ["BMOE_ISOLATE"] = "1" if isolate else "0"
    os.environ["BMOE_ISOLATE_TIMEOUT"] = str(ISOLATE_TIMEOUT_S)
    os.environ["XDG_CACHE_HOME"] = cache_dir
    from bmoe.cli import main

    devnull = os.open(os.devnull, os.O_WRONLY)
    while True:
        try:
            path = conn.recv()
        except EOFError:
            return
        err_path = f"{path}.stderr"
        saved_out, saved_err = os.dup(1), os.dup(2)
        with open(err_path, "w+b") as err:
            os.dup2(devnull, 1)
            os.dup2(err.fileno(), 2)
            try:
                status = main(["run", "-m", path, "-p", "Hello there", "-n", "2", "-c", "64", "-t", "1", "--json"])
            except SystemExit as e:
                status = e.code if isinstance(e.code, int) else 1
            except BaseException as e:  # noqa: BLE001 - what main let through is a finding
                status = f"raised {type(e).__name__}: {e}"
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os.dup2(saved_out, 1)
                os.dup2(saved_err, 2)
                os.close(saved_out)
                os.close(saved_err)
            err.seek(0)
            text = err.read().decode(errors="replace")
        conn.send((status, text))


def classify(status: object, stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.strip()]
    if status == 0:
        return OK
    if status == 1 and lines and lines[0].startswith("bmoe: error: internal error"):
        return "internal error"
    if status == 1 and len(lines) == 1 and lines[0].startswith("bmoe: error: "):
        return ONE_LINE
    if status == 1:
        return "several lines"
    if isinstance(status, str) or "Traceback" in stderr:
        return "internal error"
    return "other status"


def _with_isolation(path: Path, cache_dir: str, seen: tuple[str, str]) -> tuple[str, str]:
    """Re-run a case that killed or hung an unisolated worker through the CLI, isolation on."""
    env = os.environ | {"BMOE_ISOLATE": "1", "BMOE_ISOLATE_TIMEOUT": str(ISOLATE_TIMEOUT_S), "XDG_CACHE_HOME": cache_dir}
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "bmoe.cli", "run", "-m", str(path), "-p", "Hello there", "-n", "2", "-c", "64", "-t", "1"],
            capture_output=True, text=True, timeout=CASE_TIMEOUT_S, env=env,
        )
    except subprocess.TimeoutExpired:
        return "hang", f"{seen[1]}; with isolation: no answer within {CASE_TIMEOUT_S:.0f} s"
    status = proc.returncode if proc.returncode >= 0 else None
    if status is None:
        return "signal", f"{seen[1]}; with isolation: killed by signal {-proc.returncode}"
    outcome = classify(status, proc.stderr)
    return outcome, f"without isolation: {seen[0]} ({seen[1]}); with it: {proc.stderr.strip()}"


class Pool:
    """Workers that answer one case at a time; one that dies or hangs is replaced."""

    def __init__(self, n: int, cache_dir: str, isolate: bool) -> None:
        self._ctx = mp.get_context("spawn")
        self._cache_dir = cache_dir
        self._isolate = isolate
        self._slots = [self._start() for _ in range(n)]

    def _start(self):  # noqa: ANN202
        parent, child = self._ctx.Pipe()
        proc = self._ctx.Process(target=_worker, args=(child, self._cache_dir, self._isolate), daemon=True)
        proc.start()
        child.close()
        return proc, parent

    def run(self, jobs: list[tuple[Case, Path]]) -> list[tuple[Case, str, str]]:
        results: list[tuple[Case, str, str]] = []
        queue = collections.deque(jobs)
        busy: dict[int, tuple[Case, Path, float]] = {}
        while queue or busy:
            for i, (proc, conn) in enumerate(self._slots):
                if i not in busy and queue:
                    case, path = queue.popleft()
                    conn.send(str(path))
                    busy[i] = (case, path, time.monotonic())
            for i in list(busy):
                proc, conn = self._slots[i]
                case, path, t0 = busy[i]
                outcome = None
                if conn.poll(0.01):
                    try:
                        status, text = conn.recv()
                        outcome = (classify(status, text), text.strip())
                    except (EOFError, OSError):
                        proc.join(5)
                        outcome = ("signal", f"worker ended with status {proc.exitcode}")
                elif not proc.is_alive():
                    outcome = ("signal", f"worker ended with status {proc.exitcode}")
                elif time.monotonic() - t0 > CASE_TIMEOUT_S:
                    proc.kill()
                    proc.join()
                    outcome = ("hang", f"no answer within {CASE_TIMEOUT_S:.0f} s")
                if outcome is None:
                    continue
                if outcome[0] in ("signal", "hang"):
                    self._slots[i] = self._start()
                    if not self._isolate:  # what a user meets: the same file with isolation on
                        outcome = _with_isolation(path, self._cache_dir, outcome)
                results.append((case, *outcome))
                del busy[i]
                path.unlink(missing_ok=True)
        return results

    def close(self) -> None:
        for proc, conn in self._slots:
            conn.close()
            proc.join(10)
            if proc.is_alive():
                proc.kill()


def campaign(n_cases: int, seed: int, workers: int, archs: tuple[str, ...], folder: Path, *, isolate: bool = True,
             sweep: bool = False) -> dict:
    """Run ``n_cases`` seeded mutations (or, ``sweep``, every scalar key of every arch set to 0, 1,
    max and deleted); returns counts per class and the failures."""
    from bmoe.synth.tiny import TinySpec, write_tiny

    targets = []
    for arch in archs:
        path = write_tiny(folder / f"valid-{arch}.gguf", TinySpec(arch=arch, n_embd=64, n_ff=32))[0]
        targets.append(Target(path, arch))
    rng = random.Random(seed)
    jobs = []
    if sweep:
        for target in targets:
            for case in target.sweep(len(jobs)):
                jobs.append((case, target.write(case, folder / f"case-{case.index}.gguf")))
        n_cases = len(jobs)
    for i in range(0 if sweep else n_cases):
        target = targets[i % len(targets)]
        case = target.mutate(rng, i)
        jobs.append((case, target.write(case, folder / f"case-{i}.gguf")))
    pool = Pool(workers, str(folder / "cache"), isolate)
    t0 = time.monotonic()
    try:
        results = pool.run(jobs)
    finally:
        pool.close()
    counts = collections.Counter(outcome for _, outcome, _ in results)
    caught_by_child = sum(1 for _, o, text in results if o == ONE_LINE and "in a child process" in text)
    unisolated = sum(1 for _, _, text in results if text.startswith("without isolation"))
    failures = [{"case": c.describe(), "class": o, "stderr": text[-600:]}
                for c, o, text in sorted(results, key=lambda r: r[0].index) if o in BAD]
    by_child = [f"{c.describe()}: {text[-200:]}" for c, o, text in sorted(results, key=lambda r: r[0].index)
                if o == ONE_LINE and "in a child process" in text]
    return {"seed": seed, "cases": n_cases, "archs": list(archs), "wall_s": round(time.monotonic() - t0, 1),
            "counts": {k: counts.get(k, 0) for k in (OK, ONE_LINE, *BAD)},
            "one_line_from_the_isolation_child": caught_by_child, "killed_an_unisolated_worker": unisolated,
            "failures": failures,
            "caught_by_the_child": by_child}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--arch", default="qwen3moe,gemma4")
    ap.add_argument("--no-isolate", action="store_true",
                    help="workers run without the first-open child (faster; a worker killed is re-run with it)")
    ap.add_argument("--sweep", action="store_true", help="every scalar key set to 0, 1, max and deleted")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="bmoe-fuzz-") as tmp:
        report = campaign(args.cases, args.seed, args.workers, tuple(args.arch.split(",")), Path(tmp),
                          isolate=not args.no_isolate, sweep=args.sweep)
    if args.json:
        print(json.dumps(report, indent=1))
        return
    print(f"seed {report['seed']}, {report['cases']} cases over {', '.join(report['archs'])}, {report['wall_s']} s")
    for k, v in report["counts"].items():
        print(f"  {k:>18}: {v}")
    print(f"  (of the one-line errors, {report['one_line_from_the_isolation_child']} came from the isolation child; "
          f"{report['killed_an_unisolated_worker']} cases killed or hung a worker without isolation)")
    for line in report["caught_by_the_child"]:
        print(f"    {line}")
    for f in report["failures"]:
        print(f"  FAIL {f['class']}: {f['case']}\n      {f['stderr'][-300:]}")


if __name__ == "__main__":
    main()
