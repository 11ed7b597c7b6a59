"""Dense weights in anonymous memory: the ``--dense-weights anon`` policy.

After an mmap open the dense weights (attention, norms, embeddings, routers, shared experts) are
clean page-cache pages of llama.cpp's file mapping: under page-cache pressure (the streamed
experts, other processes) the kernel may drop them, and the next decode stalls re-reading them.
``AnonDense`` copies each dense tensor's bytes into one anonymous region, points the tensor's
``->data`` at the copy, and releases the mapping's pages of those ranges (``release_file_pages``),
so they are held once, in memory the kernel can only swap, never drop. ``restore`` puts the
original pointers back (they refault from the file); ``close`` restores and frees the region.

Tensors sharing their bytes (llama.cpp duplicates a tied output and per-layer rope factors as
separate structs over the same data) get one copy, and every struct pointing at those bytes is
rebound. After a ``user`` open the dense weights already live in llama.cpp's anonymous buffer:
the policy is then a no-op (``active`` False, ``inactive_reason`` says why).
"""

from __future__ import annotations

import ctypes
from collections.abc import Mapping, Sequence

from bmoe.errors import SeamMismatchError
from bmoe.io.direct import align_up
from bmoe.io.ggml import GgmlTensor
from bmoe.io.layout import ModelLayout, TensorSpan
from bmoe.io.pagecache import file_mapped, release_file_pages
from bmoe.io.regions import Region

# ggml's CPU kernels may use aligned vector loads; ggml_aligned_malloc aligns to 64.
ALIGN = 64


class AnonDense:
    """Copies of the dense tensors in one anonymous region, bound in place of the file mapping.

    ``tensors`` maps a tensor name to its ggml_tensor address, or to every address carrying that
    name (``loader.capture_weights``); names of expert tensors or not in the file are ignored.
    """

    def __init__(
        self, layout: ModelLayout, tensors: Mapping[str, int | Sequence[int]], *, open_mode: str,
    ) -> None:
        self.layout = layout
        self.open_mode = open_mode
        self.active = open_mode not in ("user", "reserved")
        self.inactive_reason = (
            None if self.active else f"{open_mode} open: dense weights already live in llama.cpp's anonymous buffer"
        )
        expert_names = {et.span.name for et in layout.experts.values()}
        dense_names = [n for n in layout.tensors if n not in expert_names]
        self.missing = [n for n in dense_names if n not in tensors]  # dense tensors nobody captured
        # original data address -> (span, structs pointing at it)
        self._groups: dict[int, tuple[TensorSpan, list[GgmlTensor]]] = {}
        for name in dense_names:
            addrs = tensors.get(name)
            if addrs is None:
                continue
            span = layout.tensors[name]
            for addr in [addrs] if isinstance(addrs, int) else addrs:
                struct = GgmlTensor.from_address(addr)
                if struct.name.decode(errors="replace") != name:
                    raise SeamMismatchError(f"tensor at {addr:#x} is {struct.name!r}, expected {name!r}")
                group = self._groups.setdefault(struct.data, (span, []))
                if group[0].nbytes != span.nbytes:
                    raise SeamMismatchError(f"{name} and {group[0].name} share data but differ in size")
                group[1].append(struct)
        self._region: Region | None = None
        self._original: list[tuple[GgmlTensor, int]] = []
        self.not_mapped: list[str] = []  # captured dense tensors not on the file mapping: left alone
        self.bytes_copied = 0
        self.bytes_released = 0

    @property
    def bound(self) -> bool:
        return bool(self._original)

    def apply(self) -> None:
        """Copy, rebind, then release the mapping's pages. Idempotent; a no-op when inactive.
        After ``restore`` (without ``close``) it rebinds to the copies it already made."""
        if not self.active or self.bound or not self._groups:
            return
        if self._region is None:
            # Only bytes on llama.cpp's file mapping need the copy (and can be released).
            items = list(self._groups.items())
            mapped = file_mapped(self.layout, [(span, data) for data, (span, _) in items])
            self.not_mapped = [span.name for (_, (span, _)), ok in zip(items, mapped) if not ok]
            self._groups = {data: g for (data, g), ok in zip(items, mapped) if ok}
        plan: list[tuple[int, int, TensorSpan, list[GgmlTensor]]] = []
        total = 0
        for data, (span, structs) in self._groups.items():
            plan.append((total, data, span, structs))
            total = align_up(total + span.nbytes, ALIGN)
        if self._region is None:
            region = Region(max(total, 1), 0)  # base is page-aligned
            try:
                for off, data, span, _ in plan:
                    ctypes.memmove(region.base + off, data, span.nbytes)
            except BaseException:
                region.close()
                raise
            self._region = region
            self.bytes_copied = sum(span.nbytes for _, _, span, _ in plan)
        base = self._region.base
        for off, data, _, structs in plan:
            for struct in structs:
                self._original.append((struct, data))
                struct.data = base + off
        # From here llama.cpp reads only the copies: the mapping's pages can go.
        self.bytes_released = release_file_pages(self.layout, [(span, data) for _, data, span, _ in plan])

    def restore(self) -> None:
        """Point every rebound tensor at its original (file-mapped) bytes again."""
        for struct, data in reversed(self._original):
            struct.data = data
        self._original.clear()

    def close(self) -> None:
        """Restore, then free the copies. Idempotent."""
        self.restore()
        if self._region is not None:
            self._region.close()
            self._region = None
