"""The disk-rate limit of the read lanes (``RunConfig.disk_limit_mib_s``): the token bucket's
arithmetic on a fake clock, its reader wrapper, and the choice of cgroup ``io.max`` on a fake
/proc and /sys tree. No timing: nothing here sleeps."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from bmoe.io.iomax import IoMax, find_io_max
from bmoe.stages.read import BucketReader, TokenBucket, limit_reads

pytestmark = pytest.mark.pure  # no model, no llama.cpp: `pytest -m pure` runs these in seconds
MiB = 1 << 20


class Clock:
    """A clock that moves only when told to, and a sleep that records what it was asked."""

    def __init__(self, t: float = 0.0) -> None:
        self.t = t
        self.slept: list[float] = []

    def __call__(self) -> float:
        return self.t

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.t += seconds


def test_reads_land_one_after_another_at_the_rate() -> None:
    bucket = TokenBucket(10 * MiB, clock=Clock())
    assert bucket.land_at(MiB, started=0.0) == pytest.approx(0.1)
    assert bucket.land_at(MiB, started=0.0) == pytest.approx(0.2), "a second lane's read waits for the first"
    assert bucket.land_at(5 * MiB, started=0.05) == pytest.approx(0.7)


def test_an_idle_disk_banks_nothing_beyond_its_burst() -> None:
    bucket = TokenBucket(10 * MiB, clock=Clock())
    bucket.land_at(MiB, started=0.0)
    assert bucket.land_at(MiB, started=5.0) == pytest.approx(5.1), "idle from 0.1 to 5: no credit"
    ahead = TokenBucket(10 * MiB, burst_s=0.5, clock=Clock())
    ahead.land_at(MiB, started=0.0)
    assert ahead.land_at(MiB, started=5.0) == pytest.approx(4.6), "half a second of credit, no more"
    assert ahead.land_at(MiB, started=5.0) == pytest.approx(4.7)


def test_take_waits_the_rest_of_the_reads_time() -> None:
    clock = Clock()
    bucket = TokenBucket(10 * MiB, clock=clock, sleep=clock.sleep)
    clock.t = 0.04  # the device took 40 ms; the emulated one takes 100
    assert bucket.take(MiB, started=0.0) == pytest.approx(0.06)
    assert clock.slept == [pytest.approx(0.06)]
    clock.t = 1.0  # a read that took longer than the rate asks: no wait
    assert bucket.take(MiB, started=0.5) == 0.0 and len(clock.slept) == 1


def test_every_lane_draws_on_one_bucket() -> None:
    """Eight threads reserving at once: every byte is counted once (the lock holds the sum)."""
    bucket = TokenBucket(1.0, clock=Clock())

    def lane() -> None:
        for _ in range(2000):
            bucket.land_at(1, started=0.0)

    threads = [threading.Thread(target=lane) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert bucket.land_at(0, started=0.0) == 16000.0


def test_a_rate_of_zero_is_refused() -> None:
    with pytest.raises(ValueError, match="above 0"):
        TokenBucket(0.0)


class FakeReader:
    mode = "odirect"
    fallback_reason = None

    def __init__(self, superset: int = 0) -> None:
        self.superset = superset
        self.closed = False

    def read_into(self, shard: int, offset: int, nbytes: int, dest: int) -> int:
        return nbytes + self.superset

    def close(self) -> None:
        self.closed = True


def test_the_bucket_reader_charges_the_bytes_transferred() -> None:
    """O_DIRECT transfers whole aligned pages: a disk of the rate would transfer those too."""
    clock = Clock()
    reader = BucketReader(FakeReader(superset=MiB), TokenBucket(10 * MiB, clock=clock, sleep=clock.sleep), "how")
    assert reader.read_into(0, 0, MiB, 0) == 2 * MiB
    assert clock.slept == [pytest.approx(0.2)] and reader.waited_s == pytest.approx(0.2)
    assert reader.mode == "odirect" and reader.limit_how == "how"  # the rest is the wrapped reader's
    reader.close()
    assert reader.inner.closed


def test_no_limit_is_the_reader_itself() -> None:
    inner = FakeReader()
    assert limit_reads(inner, None, []) is inner


def fake_tree(root: Path, model: Path, *, own: str = "/work", io_max: bool = True, writable: bool = True) -> None:
    """A /proc and /sys where this process is in cgroup ``own`` of a cgroup2 mount, with the
    model's device a partition of disk 8:0."""
    (root / "proc/self").mkdir(parents=True)
    (root / "proc/self/cgroup").write_text(f"0::{own}\n")
    (root / "proc/self/mountinfo").write_text(
        "30 1 0:26 / /sys/fs/cgroup rw,nosuid shared:4 - cgroup2 cgroup2 rw,nsdelegate\n")
    folder = root / "sys/fs/cgroup" / own.lstrip("/")
    folder.mkdir(parents=True, exist_ok=True)
    if io_max:
        (folder / "io.max").write_text("8:0 rbps=max wbps=max riops=max wiops=max\n")
        if not writable:
            (folder / "io.max").chmod(0o444)
    st = os.stat(model).st_dev
    disk = root / "sys/devices/sda"
    (disk / "sda1").mkdir(parents=True)
    (disk / "dev").write_text("8:0\n")
    (disk / "sda1/partition").write_text("1\n")
    (root / "sys/dev/block").mkdir(parents=True)
    (root / "sys/dev/block" / f"{os.major(st)}:{os.minor(st)}").symlink_to(disk / "sda1")


def test_io_max_is_found_where_it_exists_and_is_writable(tmp_path: Path) -> None:
    model = tmp_path / "m.gguf"
    model.write_bytes(b"x")
    fake_tree(tmp_path / "root", model)
    found = find_io_max([model], root=tmp_path / "root")
    assert isinstance(found, IoMax) and found.device == "8:0", found  # the partition's disk
    found.apply(300)
    assert found.path.read_text() == f"8:0 rbps={300 * MiB}\n"
    found.restore()
    assert found.path.read_text() == "8:0 rbps=max\n"


@pytest.mark.parametrize("kw,why", [({"own": "/"}, "root cgroup"), ({"io_max": False}, "not enabled")])
def test_no_io_max_is_a_reason(tmp_path: Path, kw: dict, why: str) -> None:
    model = tmp_path / "m.gguf"
    model.write_bytes(b"x")
    fake_tree(tmp_path / "root", model, **kw)
    found = find_io_max([model], root=tmp_path / "root")
    assert isinstance(found, str) and why in found, found


def test_without_cgroup_v2_it_is_the_bucket(tmp_path: Path) -> None:
    (tmp_path / "proc/self").mkdir(parents=True)
    (tmp_path / "proc/self/cgroup").write_text("4:memory:/x\n0::/\n")
    (tmp_path / "proc/self/mountinfo").write_text("")
    assert find_io_max([tmp_path], root=tmp_path) == "cgroup v2 is not mounted"
