"""Positioned reads into regions: O_DIRECT and buffered, neighbours, EOF, fallback, threads."""

from __future__ import annotations

import ctypes
import errno
import os
import random
import shutil
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from bmoe.errors import ReadError
from bmoe.io.direct import DIRECT_ALIGN, ShardReader
from bmoe.io.regions import Region

pytestmark = pytest.mark.pure  # no model, no llama.cpp: `pytest -m pure` runs these in seconds

TENSOR_OFFSET = 3 * DIRECT_ALIGN + 1000  # where the "tensor" starts in the file: not aligned
STRIDE = 5 * DIRECT_ALIGN + 333  # one "expert": straddles pages
N_EXPERT = 6
FILE_SIZE = TENSOR_OFFSET + N_EXPERT * STRIDE  # the last expert ends at EOF, mid-block


@pytest.fixture
def data_file(tmp_path: Path) -> tuple[Path, bytes]:
    data = random.Random(1).randbytes(FILE_SIZE)
    path = tmp_path / "shard.bin"
    path.write_bytes(data)
    return path, data


@pytest.fixture
def region() -> Iterator[Region]:
    with Region(N_EXPERT * STRIDE, TENSOR_OFFSET) as r:
        yield r


def odirect_allowed(path: Path) -> bool:
    try:
        os.close(os.open(path, os.O_RDONLY | os.O_DIRECT))
    except OSError:
        return False
    return True


def reader_for(path: Path, mode: str) -> ShardReader:
    if mode == "odirect" and not odirect_allowed(path):
        pytest.skip(f"{path.parent} refuses O_DIRECT")
    reader = ShardReader([path], direct=mode == "odirect")
    assert reader.mode == mode
    return reader


def refuse_odirect(monkeypatch: pytest.MonkeyPatch) -> None:
    real_open = os.open

    def fake_open(path: object, flags: int, *args: int) -> int:
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, os.strerror(errno.EINVAL), str(path))
        return real_open(path, flags, *args)

    monkeypatch.setattr(os, "open", fake_open)


@pytest.mark.parametrize("mode", ["odirect", "buffered"])
def test_slices_at_odd_offsets(data_file: tuple[Path, bytes], region: Region, mode: str) -> None:
    path, data = data_file
    reader = reader_for(path, mode)
    try:
        for rel, n in [(0, 1), (1, 4095), (4095, 2), (STRIDE, STRIDE), (7, 3 * DIRECT_ALIGN), (12345, 6789)]:
            got = reader.read_into(0, TENSOR_OFFSET + rel, n, region.base + rel)
            assert ctypes.string_at(region.base + rel, n) == data[TENSOR_OFFSET + rel : TENSOR_OFFSET + rel + n]
            if mode == "buffered":
                assert got == n
            else:
                lo = (TENSOR_OFFSET + rel) // DIRECT_ALIGN * DIRECT_ALIGN
                hi = -(-(TENSOR_OFFSET + rel + n) // DIRECT_ALIGN) * DIRECT_ALIGN
                assert got == hi - lo
    finally:
        reader.close()


def test_odirect_neighbours_get_the_files_bytes(data_file: tuple[Path, bytes], region: Region) -> None:
    path, data = data_file
    reader = reader_for(path, "odirect")
    region.fill(0)
    expert = 2
    rel = expert * STRIDE
    reader.read_into(0, TENSOR_OFFSET + rel, STRIDE, region.base + rel)
    lo = (region.base + rel) // DIRECT_ALIGN * DIRECT_ALIGN
    hi = -(-(region.base + rel + STRIDE) // DIRECT_ALIGN) * DIRECT_ALIGN
    file_lo = TENSOR_OFFSET + (lo - region.base)
    assert lo < region.base + rel and hi > region.base + rel + STRIDE  # the superset is wider
    assert ctypes.string_at(lo, hi - lo) == data[file_lo : file_lo + hi - lo]
    reader.close()


@pytest.mark.parametrize("mode", ["odirect", "buffered"])
def test_last_expert_ending_mid_block_at_eof(data_file: tuple[Path, bytes], region: Region, mode: str) -> None:
    path, data = data_file
    reader = reader_for(path, mode)
    rel = (N_EXPERT - 1) * STRIDE
    reader.read_into(0, TENSOR_OFFSET + rel, STRIDE, region.base + rel)
    assert ctypes.string_at(region.base + rel, STRIDE) == data[-STRIDE:]
    reader.close()


@pytest.mark.parametrize("mode", ["odirect", "buffered"])
def test_read_past_eof(data_file: tuple[Path, bytes], region: Region, mode: str) -> None:
    path, _ = data_file
    reader = reader_for(path, mode)
    rel = (N_EXPERT - 1) * STRIDE + 10
    with pytest.raises(ReadError, match=f"{path}.*at offset {TENSOR_OFFSET + rel}.*file ends"):
        reader.read_into(0, TENSOR_OFFSET + rel, STRIDE, region.base + rel)
    reader.close()


def test_odirect_destination_not_congruent(data_file: tuple[Path, bytes], region: Region) -> None:
    path, _ = data_file
    reader = reader_for(path, "odirect")
    with pytest.raises(ReadError, match="not congruent"):
        reader.read_into(0, TENSOR_OFFSET, 100, region.base + 1)
    reader.close()


def test_read_error_carries_the_os_error(data_file: tuple[Path, bytes], region: Region) -> None:
    path, _ = data_file
    reader = reader_for(path, "buffered")
    os.close(reader._fds[0])  # the descriptor goes bad under the reader: EBADF
    with pytest.raises(ReadError, match="Bad file descriptor") as info:
        reader.read_into(0, TENSOR_OFFSET, 10, region.base)
    assert isinstance(info.value.__cause__, OSError)
    reader._fds = []


@pytest.mark.parametrize("mode", ["odirect", "buffered"])
def test_concurrent_reads(data_file: tuple[Path, bytes], region: Region, mode: str) -> None:
    """Four lanes read overlapping experts into one region; supersets only ever write file bytes."""
    path, data = data_file
    reader = reader_for(path, mode)
    expected = data[TENSOR_OFFSET:]
    errors: list[BaseException] = []

    def lane(seed: int) -> None:
        rng = random.Random(seed)
        try:
            for _ in range(200):
                e = rng.randrange(N_EXPERT)
                reader.read_into(0, TENSOR_OFFSET + e * STRIDE, STRIDE, region.base + e * STRIDE)
                assert ctypes.string_at(region.base + e * STRIDE, STRIDE) == expected[e * STRIDE : (e + 1) * STRIDE]
        except BaseException as exc:  # reported from the main thread
            errors.append(exc)

    threads = [threading.Thread(target=lane, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    reader.close()


def test_multiple_shards(tmp_path: Path) -> None:
    paths = [tmp_path / f"s{i}.bin" for i in range(3)]
    blobs = [bytes([i + 1]) * (3 * DIRECT_ALIGN) for i in range(3)]
    for p, b in zip(paths, blobs, strict=True):
        p.write_bytes(b)
    reader = ShardReader(paths)
    with Region(100, 4100) as r:
        for shard in range(3):
            reader.read_into(shard, 4100, 100, r.base)
            assert ctypes.string_at(r.base, 100) == blobs[shard][:100]
    reader.close()


def test_verify_keeps_odirect_when_it_agrees(data_file: tuple[Path, bytes]) -> None:
    path, _ = data_file
    reader = reader_for(path, "odirect")
    reader.verify(0, TENSOR_OFFSET + 17, STRIDE)
    assert reader.mode == "odirect" and reader.fallback_reason is None
    reader.close()


def test_verify_mismatch_falls_back(data_file: tuple[Path, bytes], region: Region, tmp_path: Path) -> None:
    path, data = data_file
    reader = reader_for(path, "odirect")
    other = tmp_path / "other.bin"
    other.write_bytes(bytes(FILE_SIZE))
    os.dup2(os.open(other, os.O_RDONLY | os.O_DIRECT), reader._direct[0])  # O_DIRECT now sees other bytes
    reader.verify(0, TENSOR_OFFSET, STRIDE)
    assert reader.mode == "buffered"
    assert "differs from a buffered read" in reader.fallback_reason
    reader.read_into(0, TENSOR_OFFSET + 1, STRIDE, region.base + 1)
    assert ctypes.string_at(region.base + 1, STRIDE) == data[TENSOR_OFFSET + 1 : TENSOR_OFFSET + 1 + STRIDE]
    reader.close()


def test_verify_einval_falls_back(data_file: tuple[Path, bytes], monkeypatch: pytest.MonkeyPatch) -> None:
    path, _ = data_file
    reader = reader_for(path, "odirect")
    direct_fd, real_preadv = reader._direct[0], os.preadv

    def fake_preadv(fd: int, buffers: list, offset: int) -> int:
        if fd == direct_fd:
            raise OSError(errno.EINVAL, os.strerror(errno.EINVAL))
        return real_preadv(fd, buffers, offset)

    monkeypatch.setattr(os, "preadv", fake_preadv)
    reader.verify(0, TENSOR_OFFSET, STRIDE)
    assert reader.mode == "buffered" and "refused" in reader.fallback_reason
    reader.close()


def test_filesystem_refusing_odirect_at_open(
    data_file: tuple[Path, bytes], region: Region, monkeypatch: pytest.MonkeyPatch
) -> None:
    path, data = data_file
    refuse_odirect(monkeypatch)
    reader = ShardReader([path])
    assert reader.mode == "buffered"
    assert "refuses O_DIRECT" in reader.fallback_reason and str(path) in reader.fallback_reason
    reader.verify(0, TENSOR_OFFSET, STRIDE)  # nothing to verify: stays buffered
    reader.read_into(0, TENSOR_OFFSET + 5, 999, region.base + 5)
    assert ctypes.string_at(region.base + 5, 999) == data[TENSOR_OFFSET + 5 : TENSOR_OFFSET + 5 + 999]
    reader.close()


def test_tmpfs(region: Region) -> None:
    """tmpfs refuses O_DIRECT before Linux 6.6 and accepts it after: either way reads are right."""
    tmpfs = next((line.split()[1] for line in Path("/proc/mounts").read_text().splitlines()
                  if line.split()[2:3] == ["tmpfs"] and os.access(line.split()[1], os.W_OK)
                  and line.split()[1] in ("/dev/shm", "/run/shm", "/tmp")), None)
    if tmpfs is None:
        pytest.skip("no writable tmpfs (/dev/shm, /run/shm, /tmp) here")
    folder = Path(tempfile.mkdtemp(prefix="bmoe-test-", dir=tmpfs))  # the test's own, removed below
    path = folder / "f.bin"
    data = random.Random(2).randbytes(FILE_SIZE)
    path.write_bytes(data)
    try:
        reader = ShardReader([path])
        assert (reader.mode == "odirect") == (reader.fallback_reason is None)
        reader.verify(0, TENSOR_OFFSET, STRIDE)
        reader.read_into(0, TENSOR_OFFSET + STRIDE, STRIDE, region.base + STRIDE)
        want = data[TENSOR_OFFSET + STRIDE : TENSOR_OFFSET + 2 * STRIDE]
        assert ctypes.string_at(region.base + STRIDE, STRIDE) == want
        reader.close()
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def test_disabled_by_caller(data_file: tuple[Path, bytes]) -> None:
    path, _ = data_file
    reader = ShardReader([path], direct=False)
    assert reader.mode == "buffered" and "disabled by the caller" in reader.fallback_reason
    reader.close()


def test_missing_shard(tmp_path: Path) -> None:
    with pytest.raises(ReadError, match="nope.bin"):
        ShardReader([tmp_path / "nope.bin"])


def test_close_is_idempotent(data_file: tuple[Path, bytes]) -> None:
    def open_fds() -> set[str]:
        return set(os.listdir("/proc/self/fd"))

    before = open_fds()
    reader = ShardReader([data_file[0]])
    assert open_fds() - before, "the reader holds the shard open"
    reader.close()
    assert open_fds() == before, "close gives every descriptor back"
    reader.close()  # a second close is a no-op, not an error on a reused descriptor
    assert open_fds() == before
