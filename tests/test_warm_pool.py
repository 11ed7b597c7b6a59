"""The warm pool: pages faulted in while idle, handed to slots, never past the cache's budget."""

import time

from bmoe.io.regions import Region, WarmPool, move_pages, resident_bytes_of

MiB = 1 << 20


def _wait(cond, timeout=10.0):
    end = time.monotonic() + timeout
    while not cond() and time.monotonic() < end:
        time.sleep(0.01)
    return cond()


def test_pool_faults_in_up_to_the_room_and_hands_pages_over():
    used = [0]
    pool = WarmPool(8 * MiB, lambda: 8 * MiB, lambda: used[0])
    try:
        used[0] = 3 * MiB  # the cache holds 3 MiB: the spare stops at 5
        assert _wait(lambda: pool.spare_bytes >= 5 * MiB)
        time.sleep(0.2)
        assert pool.spare_bytes <= 5 * MiB, "spare plus the cache never pass the budget"
        with Region(2 * MiB, 0) as r:
            lo = -(-r.base // 4096) * 4096
            src, n = pool.take(MiB)
            assert n == MiB and move_pages(src, lo, n)
            assert resident_bytes_of(lo, n) == n, "the slot got pages already present"
    finally:
        pool.close()


def test_pool_pauses_and_gives_back_when_the_cache_fills():
    used = [0]
    pool = WarmPool(64 * MiB, lambda: 64 * MiB, lambda: used[0])
    try:
        pool.pause()
        at_pause = pool.spare_bytes
        time.sleep(0.2)
        assert pool.spare_bytes <= at_pause + WarmPool.CHUNK, "paused: nothing more faulted in"
        pool.resume()
        assert _wait(lambda: pool.spare_bytes > 0)
        used[0] = 64 * MiB  # full: evictions supply pages from now on
        assert _wait(lambda: pool.take(MiB)[1] == 0)
        assert _wait(lambda: pool._thread is not None and not pool._thread.is_alive())
    finally:
        pool.close()
    pool.close()  # idempotent
