"""Bind: expert tensors point at reserved regions that the pipeline fills.

``Residency`` owns the memory side: one reserved region per (layer, projection), expert ``e`` at
``base + e*stride`` so ``mul_mat_id`` indexes it unchanged; rebinding ``->data`` once at open and
restoring the original pointers before the regions are freed; handing an evicted expert's pages to
the experts about to be read, or releasing them; and the per-layer resident maps the eval
callback's fast path reads (``FastPath.resident``), which the ready stage (``ready``) sets once a
layer's reads have landed.

With the cache off for good (``shared``), every layer's tensors of one projection point into one
shared slot region instead (``SlotView``: the layer's own offset mod 4096 inside it, so O_DIRECT
still lands in place): layers run one after another, and the cache never keeps an expert past
its layer, so one layer's worth of slots serves them all. Its pages are never given back: every
read lands in memory already present (no fault, no zeroing, no page moves splitting mappings), at
a fixed cost of one layer's expert bank at most.
"""

from __future__ import annotations

import ctypes
from collections import deque
from collections.abc import Iterable, Mapping

import numpy as np

from bmoe.errors import SeamMismatchError
from bmoe.io.direct import DIRECT_ALIGN
from bmoe.io.ggml import GgmlTensor
from bmoe.io.layout import ExpertTensor, ModelLayout
from bmoe.io.regions import (
    Region,
    WarmPool,
    map_count,
    map_count_limit,
    move_pages,
    renew_pages,
)

MAP_CHECK_EVERY = 1024  # page moves between two counts of the process's mappings (~10 ms at 40 000)
from bmoe.pipeline.cache import Entry
from bmoe.pipeline.events import ExpertKey, ReadRequest


class SlotView:
    """One layer's window on a shared slot region: its tensor at ``base``, nothing ever released."""

    def __init__(self, slot: Region, head: int, nbytes: int) -> None:
        self._slot = slot
        self.base = slot.base + head
        self.nbytes = nbytes

    def fill(self, byte: int) -> None:
        ctypes.memset(self.base, byte, self.nbytes)

    def release(self, start: int, end: int) -> int:
        return 0  # the pages stay: the next layer's reads land in them

    def close(self) -> None:
        pass  # the shared slot is closed by its owner


class Residency:
    """``tensors`` None: regions are filled but no llama.cpp tensor points at them (replay).
    ``recycle``: move evicted pages to the slots about to be read instead of faulting fresh ones.
    ``shared``: the cache is off for good: every layer reads into one shared set of slots.
    ``pool``: pages faulted in ahead by a background thread, handed to slots once no evicted
    pages are left (a fresh cache's first misses); only used while ``recycle`` holds, since each
    hand-over is a page move. The residency closes it."""

    def __init__(
        self, layout: ModelLayout, tensors: Mapping[tuple[int, str], int] | None, recycle: bool = True,
        shared: bool = False, pool: WarmPool | None = None,
    ) -> None:
        self.layout = layout
        self.shared = shared
        self.recycle = recycle and not shared
        self.pool = pool
        self.recycled_bytes = 0
        self._moves = 0
        self._experts: dict[int, tuple[ExpertTensor, ...]] = {
            il: layout.layer_experts(il) for il in layout.moe_layers
        }
        self._regions: dict[tuple[int, int], Region | SlotView] = {}
        self._slots: list[Region] = []  # shared mode: one per projection
        self._structs: dict[tuple[int, int], GgmlTensor] = {}
        self._original: dict[tuple[int, int], int] = {}
        self.maps = [np.zeros(layout.n_expert, dtype=bool) for _ in range(layout.n_layer)]
        for il, experts in self._experts.items():
            for p, et in enumerate(experts):
                if tensors is None:
                    continue
                addr = tensors.get((il, et.suffix))
                if addr is None:
                    raise SeamMismatchError(f"llama.cpp graph never used blk.{il}.{et.suffix}.weight")
                struct = GgmlTensor.from_address(addr)
                if struct.ne[2] != et.n_expert or struct.nb[2] != et.stride:
                    raise SeamMismatchError(
                        f"blk.{il}.{et.suffix}.weight: llama.cpp has ne[2]={struct.ne[2]} "
                        f"nb[2]={struct.nb[2]}, the file index says {et.n_expert} x {et.stride} bytes"
                    )
                self._structs[il, p] = struct
        if shared:
            span: dict[int, int] = {}
            for experts in self._experts.values():
                for p, et in enumerate(experts):
                    span[p] = max(span.get(p, 0), et.span.offset % DIRECT_ALIGN + et.span.nbytes)
            self._slots = [Region(span[p], 0) for p in sorted(span)]
            for il, experts in self._experts.items():
                for p, et in enumerate(experts):
                    self._regions[il, p] = SlotView(self._slots[p], et.span.offset % DIRECT_ALIGN, et.span.nbytes)
            return
        for il, experts in self._experts.items():
            for p, et in enumerate(experts):
                self._regions[il, p] = Region(et.span.nbytes, et.span.offset)

    def n_proj(self, layer: int) -> int:
        return len(self._experts[layer])

    def entry_bytes(self) -> dict[int, int]:
        return self.layout.entry_bytes()

    def bind(self) -> None:
        """Point every expert tensor at its region: from now on llama.cpp reads only our bytes."""
        for key, struct in self._structs.items():
            self._original[key] = struct.data
            struct.data = self._regions[key].base

    def restore(self) -> None:
        for key, data in self._original.items():
            self._structs[key].data = data
        self._original.clear()

    def requests(self, layer: int, expert: int) -> list[ReadRequest]:
        out = []
        for p, et in enumerate(self._experts[layer]):
            region = self._regions[layer, p]
            out.append(
                ReadRequest(
                    ExpertKey(layer, p, expert),
                    et.span.shard,
                    et.file_offset(expert),
                    et.stride,
                    region.base + expert * et.stride,
                )
            )
        return out

    def layer_spans(self, layer: int) -> list[tuple[int, int]]:
        return [(self._regions[layer, p].base, et.span.nbytes) for p, et in enumerate(self._experts[layer])]

    def fill_layer(self, layer: int, byte: int) -> None:
        for p in range(self.n_proj(layer)):
            self._regions[layer, p].fill(byte)

    def release(self, layer: int, expert: int) -> None:
        self.maps[layer][expert] = False
        for p, et in enumerate(self._experts[layer]):
            self._regions[layer, p].release(expert * et.stride, (expert + 1) * et.stride)

    def reuse(self, evicted: Iterable[Entry], needed: Iterable[Entry]) -> None:
        """Evict ``evicted`` (no read may be in flight into them) and move their pages into the
        slots of ``needed``, about to be read; pages left over are released. A slot given only
        part of what it needs faults the rest in when its read lands. Every evicted slot is mapped
        afresh once emptied (``renew_pages``): the slots a move split off merge back."""
        if self.shared:
            for layer, expert in evicted:
                self.maps[layer][expert] = False
            return
        spans = []
        for layer, expert in evicted:
            self.maps[layer][expert] = False
            spans.extend((lo, hi) for lo, hi in self._pages(layer, expert) if hi > lo)
        donors: deque[list[int]] = deque([lo, hi] for lo, hi in spans)
        for layer, expert in needed:
            for lo, hi in self._pages(layer, expert):
                if self.recycle:
                    lo = self._move_into(lo, hi, donors)
                    if lo < hi and self.pool is not None and self.recycle:
                        self._take_pooled(lo, hi)
        for lo, hi in spans:
            renew_pages(lo, hi)

    def _take_pooled(self, lo: int, hi: int) -> None:
        """Fill what the pool has ready of the pages [lo, hi); the rest fault in on the read."""
        while lo < hi:
            src, n = self.pool.take(hi - lo)  # type: ignore[union-attr]
            if n == 0 or not self._move(src, lo, n):
                return
            lo += n

    def _move_into(self, lo: int, hi: int, donors: deque[list[int]]) -> int:
        """Fill the pages [lo, hi) from the front of ``donors``, splitting a donor run as needed;
        returns where the filled pages end."""
        while lo < hi and donors:
            donor = donors[0]
            n = min(hi - lo, donor[1] - donor[0])
            if not self._move(donor[0], lo, n):
                return lo
            donor[0] += n
            lo += n
            self.recycled_bytes += n
            if donor[0] == donor[1]:
                donors.popleft()
        return lo

    def _move(self, src: int, dst: int, n: int) -> bool:
        if not move_pages(src, dst, n):
            self.recycle = False  # refused once (old kernel, map count): fault from now on
            return False
        self._moves += 1
        if self._moves % MAP_CHECK_EVERY == 0 and map_count() > map_count_limit() * 3 // 5:
            # Every move can split a mapping for good: stop before the process's mappings run
            # out for llama.cpp and the allocator (a refused mmap there is a crash).
            self.recycle = False
        return True

    def resident_bytes(self) -> int:
        """Bytes of all regions in RAM now (a measurement: allocates)."""
        regions = self._slots if self.shared else self._regions.values()
        return sum(region.resident_bytes() for region in regions)  # type: ignore[union-attr]

    def _pages(self, layer: int, expert: int) -> list[tuple[int, int]]:
        return [
            self._regions[layer, p].pages(expert * et.stride, (expert + 1) * et.stride)
            for p, et in enumerate(self._experts[layer])
        ]

    def close(self) -> None:
        self.restore()
        if self.pool is not None:
            self.pool.close()
        for region in [*self._regions.values(), *self._slots]:
            region.close()
        self._regions.clear()
        self._slots.clear()


class SimResidency:
    """Residency with no memory behind it, for replays that model reads instead of making them:
    experts sized from the trace, split into the architecture's projections, nothing to bind."""

    recycled_bytes = 0
    pool = None

    def __init__(self, n_layer: int, n_expert: int, entry_bytes: Mapping[int, int], n_proj: int = 1) -> None:
        self._entry = dict(entry_bytes)
        self._n_proj = n_proj
        self.maps = [np.zeros(n_expert, dtype=bool) for _ in range(n_layer)]

    def n_proj(self, layer: int) -> int:
        return self._n_proj

    def entry_bytes(self) -> dict[int, int]:
        return dict(self._entry)

    def bind(self) -> None:
        pass

    def requests(self, layer: int, expert: int) -> list[ReadRequest]:
        """The expert's bytes split evenly over its projections (the last takes the remainder)."""
        total = self._entry[layer]
        part = total // self._n_proj
        sizes = [part] * (self._n_proj - 1) + [total - part * (self._n_proj - 1)]
        return [ReadRequest(ExpertKey(layer, p, expert), 0, expert * total, n, 0) for p, n in enumerate(sizes)]

    def layer_spans(self, layer: int) -> list[tuple[int, int]]:
        return []

    def release(self, layer: int, expert: int) -> None:
        self.maps[layer][expert] = False

    def reuse(self, evicted: Iterable[Entry], needed: Iterable[Entry]) -> None:
        for layer, expert in evicted:
            self.maps[layer][expert] = False

    def close(self) -> None:
        pass
