"""Opening a model without reading its experts: llama.cpp's ways in, and the memory each costs.

llama.cpp's plain load maps the file with ``MAP_POPULATE`` and ``WILLNEED``: opening reads the
whole file once, experts included (a 40 GB model reads 40 GB). A streamed run needs only the
dense bytes at open. Four open modes:

``user``
    ``llama_model_init_from_user``: llama.cpp builds the model from a gguf context (tensor types
    and metadata) and asks a callback for each tensor's bytes. The callback reads the dense tensors
    from the file (buffered ``pread`` on a descriptor with ``POSIX_FADV_RANDOM``, so no readahead
    pulls in the experts around them; their page-cache copies are dropped afterwards, since the
    model holds its own copy) and, when streaming, leaves the expert tensors untouched: their pages
    are never written, so they cost no RAM. Reads about 1.0x the dense bytes. All tensors, experts
    included, live in one anonymous CPU allocation, which the kernel's overcommit policy may refuse
    (mode 0: one allocation larger than RAM + swap; mode 2: beyond CommitLimit - Committed_AS).
``reserved``
    The user open with the expert tensors placed (``tensor_buft_overrides``) in a buffer type of
    bmoe's own over an uncommitted ``PROT_NONE`` reservation (``bmoe.llama.open_reserved``):
    reads the same dense bytes, commits only them, so it opens models bigger than RAM + swap.
    Streamed runs only; ``auto`` picks it where the user allocation would be refused.
``mmap``
    The plain load (``load_mode=1``): reads the whole file at open. For resident runs.
``mmap-drop``
    The plain load as well (so it too reads the whole file once at open, and survives models
    bigger than RAM because its pages are clean page cache), after which the caller, having
    captured the expert tensors, gives their pages back with ``release_file_pages``: the model
    then holds only dense pages. For streamed runs whose user allocation would be refused.

What ``init_from_user`` needs beyond the file (pin 0.3.36, checked on qwen3moe, qwen2moe and gemma4
tiny models in F32 and Q8_0): it creates every *optional* tensor the architecture knows, whether or
not the file has it, typed F32 unless the gguf context says otherwise, and its bytes are whatever
the callback writes. The generic pass adds ``<w>.scale`` and ``<w>.input_scale`` for every
attention, dense FFN, shared-expert and expert weight; qwen3moe adds ``attn_{q,k,v}.bias``, gemma4
``layer_output_scale.weight``; llama-style models ``rope_freqs.weight``. They are filled with the
value that makes them exact no-ops: biases 0.0, scales, input scales (unused by the graph on this
pin), the layer output scale and rope frequency factors 1.0 (the CPU rope divides by a factor of
1.0f when there is none). A tied output (no ``output.weight`` in the file, llama.cpp's plain load
would reuse ``token_embd.weight``) gets a tensor info with ``token_embd``'s type and shape added to
the gguf context and a copy of its bytes, so the output matmul is the same computation. Anything
else the file lacks (gemma4 with separate gate/up experts, where llama.cpp then creates a fused
``ffn_gate_up_exps``; an absent optional ``attn_v``) cannot be filled faithfully: the open fails
with SeamError and ``mode="auto"`` falls back to ``mmap-drop``, saying why.
The extra per-expert ``.scale`` tensors change the MoE graph: each expert matmul becomes
MUL_MAT_ID -> (reshape, repeat, get_rows of the scale) -> MUL, llama.cpp names the MUL
``ffn_moe_{gate,up,down}_scaled-<il>``, and the MUL_MAT_ID itself is left unnamed (``node_<n>``).
``ffn_moe_topk`` and everything before it are unchanged, so the serial wait at topk holds; but a
node-name search for ``ffn_moe_gate``/``_up``/``_down`` finds no matmul any more (the warm-up
capture, overlap-mode wait points): ``OpenedModel.scaled_expert_matmuls`` says when. gemma4's
fused ``ffn_gate_up_exps`` gets no scale on this pin, so ``ffn_moe_gate_up`` keeps its name there.

Split sets: the gguf context is shard 1's, which lists only shard 1's tensors; the tensor infos of
the other shards are added to it (``gguf_add_tensor``) so llama.cpp types them right, and each
tensor is read from its own shard. The header is read exactly (one ``pread`` through the random-
access descriptor, then ``gguf_init_from_buffer``): ``gguf_init_from_file``'s stdio reads on a
default descriptor start a readahead window (``read_ahead_kb``, 8 MiB here) whose marks inside the
first dense tensors later pulled megabytes of experts in (measured: 2.4x the dense bytes, 1.01x
without). With transparent huge pages on, writing a dense tensor faults in the 2 MiB page around
it, neighbouring experts included: after a streaming user open the expert ranges of the
allocation get ``MADV_NOHUGEPAGE`` + ``MADV_DONTNEED``.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import re
import resource
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cache
from typing import Any

import numpy as np

from bmoe.llama.open_reserved import open_reserved
from bmoe.llama.seam import forget_llama_errors, llama_lib, model_params
from bmoe.errors import LlamaCallError, ModelFileError, SeamError, as_bmoe_error
from bmoe.io.ggml import GGML_MAX_SRC, GgmlTensor, libggml_base
from bmoe.io.layout import ModelLayout, TensorSpan
from bmoe.io.pagecache import interior_pages, madvise_range, read_io_bytes
from bmoe.io.recipes import recipe_for
from bmoe.pipeline.budget import read_meminfo

MODES = ("user", "reserved", "mmap", "mmap-drop")
LOAD_MODE_MMAP = 1
GGML_TYPE_F32 = 0
_PAGE = mmap.PAGESIZE
_GIB = 1 << 30
_MIB = 1 << 20
# llama.cpp's CPU buffer pads every tensor to TENSOR_ALIGNMENT (32) inside one allocation.
_TENSOR_ALIGN = 32
# Headroom over the estimated user allocation: llama.cpp's own extras (the optional tensors it
# creates, padding) plus whatever else the process maps while the allocation is live.
_MARGIN_MIN = 256 * _MIB
_MARGIN_FRACTION = 1 / 32
_MAX_PREAD = 1 << 30  # Linux caps one read at 0x7ffff000 bytes
_MADV_NOHUGEPAGE = getattr(mmap, "MADV_NOHUGEPAGE", 15)

# What llama.cpp creates on the user path that a file may lack, and the fill that makes each an
# exact no-op. Anything else missing refuses the user path.
_ZERO_FILL = re.compile(r"\.bias$")
_ONE_FILL = re.compile(r"(\.scale|\.input_scale)$|(^|\.)layer_output_scale\.weight$|^rope_freqs\.weight$")
_TOKEN_EMBD = "token_embd.weight"
_OUTPUT = "output.weight"


_WHAT = {
    "user": "only dense bytes read",
    "reserved": "only dense bytes read, experts in a reserved uncommitted buffer (bmoe.llama.open_reserved)",
    "mmap": "plain load, reads the whole file once",
    "mmap-drop": "plain load (reads the whole file once), expert pages dropped after capture",
}


class UserPathUnsupported(SeamError):
    """init_from_user would build a model that differs from the plain load's (see module doc)."""


@dataclass
class OpenedModel:
    """A loaded llama_model and how it got there. ``free`` releases it (idempotent)."""

    model: Any  # llama_cpp.llama_model_p (a c_void_p)
    open_mode: str
    open_reason: str
    open_bytes_read: int | None  # /proc/self/io read_bytes across the open; None if unreadable
    # ggml_tensor address by name, for every tensor the user path saw (first one of a duplicated
    # name); empty for the mmap modes, where the caller captures by a warm-up decode.
    tensors: dict[str, int] = field(default_factory=dict)
    # The optional tensors the user path filled as no-ops (1.0 scales, 0.0 biases), by address: the
    # node filter mutes the nodes that apply them (``NodeFilter.skip_noops``).
    noop_ones: tuple[int, ...] = ()
    noop_zeros: tuple[int, ...] = ()
    # The user path's keep-alive: gguf context, ctypes callback, filler state.
    _keep: list[Any] = field(default_factory=list, repr=False)
    _freers: list[Callable[[], None]] = field(default_factory=list, repr=False)

    @property
    def scaled_expert_matmuls(self) -> bool:
        """True when llama.cpp created per-expert ``.scale`` tensors (the user path always does
        for split gate/up/down experts): the expert MUL_MAT_ID nodes are then unnamed and
        ``ffn_moe_*_scaled-<il>`` names the multiply after them (see the module doc)."""
        return any(n.endswith("_exps.scale") for n in self.tensors)

    def expert_tensors(self, layout: ModelLayout) -> dict[tuple[int, str], int]:
        """(layer, suffix) -> ggml_tensor address, as the session's capture returns them."""
        out = {}
        for key, et in layout.experts.items():
            addr = self.tensors.get(et.span.name)
            if addr is not None:
                out[key] = addr
        return out

    def free(self) -> None:
        if self.model:
            llama_lib().llama_model_free(self.model)
            self.model = None
        while self._freers:
            self._freers.pop()()
        self._keep.clear()


# --- choosing a mode -----------------------------------------------------------------------


def read_overcommit() -> int:
    with open("/proc/sys/vm/overcommit_memory") as f:
        return int(f.read().strip())


def user_alloc_bytes(layout: ModelLayout) -> int:
    """What init_from_user allocates in one CPU buffer: every tensor padded to 32 bytes, plus a
    copy of token_embd for a tied output. The optional tensors it adds are small (a few per
    weight, n_expert floats at most): the margin covers them."""
    total = sum(-(-s.nbytes // _TENSOR_ALIGN) * _TENSOR_ALIGN for s in layout.tensors.values())
    if _OUTPUT not in layout.tensors and _TOKEN_EMBD in layout.tensors:
        total += layout.tensors[_TOKEN_EMBD].nbytes
    return total


def _address_space_left() -> int | None:
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft == resource.RLIM_INFINITY:
        return None
    try:
        with open("/proc/self/status") as f:
            vm = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
    except (OSError, StopIteration, ValueError):
        vm = 0
    return max(0, soft - vm)


def user_path_refusal(layout: ModelLayout) -> str | None:
    """Why ``init_from_user`` must not be given this file, from the index alone; None if it may.

    MTP blocks: the plain load skips their tensors, the user path hits GGML_ASSERT on the first
    skipped one and the process dies, so this is checked before llama.cpp is called at all.
    Fused-on-user archs with split gate/up experts: llama.cpp would create a fused tensor the
    file lacks; the plain load then costs one whole-file read at open, which building the fused
    tensor from the two file ranges would save (not measured here, not done)."""
    recipe = recipe_for(layout.arch)
    if layout.n_nextn:
        return f"{layout.n_nextn} MTP block(s), which llama.cpp's user open aborts on"
    if recipe.user_open_refusal:
        return recipe.user_open_refusal
    split = layout.moe_layers and "ffn_gate_up_exps" not in {e.suffix for e in layout.layer_experts(layout.moe_layers[0])}
    if recipe.user_open_fuses and split:
        return f"{layout.arch} with split gate/up experts: llama.cpp's user open builds a fused ffn_gate_up_exps the file lacks"
    return None


def choose_open_mode(
    layout: ModelLayout, streaming: bool, *,
    meminfo: Callable[[], Mapping[str, int]] | None = None,
    overcommit: Callable[[], int] | None = None,
) -> tuple[str, str]:
    """(mode, one-line reason). Not streaming: ``mmap``. Streaming: ``user`` if the kernel will
    grant its one allocation with a margin to spare, else ``mmap-drop``. ``meminfo`` and
    ``overcommit`` replace the readers of /proc/meminfo and /proc/sys/vm/overcommit_memory."""
    if not streaming:
        return "mmap", f"resident run: {_WHAT['mmap']}"
    refusal = user_path_refusal(layout)
    if refusal is not None:
        return "mmap-drop", f"user path refused ({refusal}); {_WHAT['mmap-drop']}"
    need = user_alloc_bytes(layout)
    try:
        policy = (overcommit or read_overcommit)()
        info = (meminfo or read_meminfo)()
    except (OSError, ValueError) as e:
        return "mmap-drop", f"cannot read the memory limits ({e}); {_WHAT['mmap-drop']}"
    if policy == 1:
        return "user", f"overcommit_memory=1 never refuses: one {need / _GIB:.2f} GiB allocation, only dense bytes read"
    if policy == 2:
        limit = info.get("CommitLimit", 0) - info.get("Committed_AS", 0)
        what = "CommitLimit - Committed_AS"
    else:
        limit = info.get("MemTotal", 0) + info.get("SwapTotal", 0)
        what = "MemTotal + SwapTotal"
    rlimit = _address_space_left()
    if rlimit is not None and rlimit < limit:
        limit, what = rlimit, "RLIMIT_AS left"
    margin = max(_MARGIN_MIN, int(limit * _MARGIN_FRACTION))
    numbers = (
        f"{need / _GIB:.2f} GiB + margin {margin / _GIB:.2f} GiB vs {what} {limit / _GIB:.2f} GiB "
        f"(overcommit_memory={policy})"
    )
    if need + margin <= limit:
        return "user", f"user allocation fits: {numbers}; only dense bytes read"
    # The reserved open commits only the dense bytes (its expert reservation is PROT_NONE, never
    # charged), but under RLIMIT_AS the whole reservation counts.
    committed = need if what == "RLIMIT_AS left" else reserved_commit_bytes(layout)
    if committed + margin <= limit:
        return "reserved", (
            f"user allocation would be refused: {numbers}; reserved open commits "
            f"{committed / _GIB:.2f} GiB: {_WHAT['reserved']}"
        )
    return "mmap-drop", f"user allocation would be refused: {numbers}; {_WHAT['mmap-drop']}"


def reserved_commit_bytes(layout: ModelLayout) -> int:
    """What the reserved open commits: the user allocation without the expert tensors."""
    experts = sum(-(-et.span.nbytes // _TENSOR_ALIGN) * _TENSOR_ALIGN for et in layout.experts.values())
    return user_alloc_bytes(layout) - experts


# --- opening ---------------------------------------------------------------------------------


def open_model(
    layout: ModelLayout, *, streaming: bool, mode: str = "auto", mparams: Any = None,
) -> OpenedModel:
    """Open ``layout``'s file with the mode ``choose_open_mode`` picks (or the one forced).

    ``mparams`` (llama_model_params) defaults to ``seam.model_params()``; it is copied, and
    ``n_gpu_layers=0`` / ``use_extra_bufts=False`` are enforced whatever it says. A forced ``user``
    that cannot be built faithfully raises SeamError; ``auto`` falls back to ``mmap-drop`` then.
    """
    lib = llama_lib()
    forget_llama_errors()  # a failure below quotes llama.cpp's own line, not an older one
    if mode == "auto":
        mode, reason = choose_open_mode(layout, streaming)
        forced = False
    elif mode in MODES:
        reason, forced = f"{mode} forced by the caller: {_WHAT[mode]}", True
    else:
        raise ValueError(f"open mode {mode!r}: expected auto or one of {', '.join(MODES)}")
    params = lib.llama_model_params.from_buffer_copy(mparams if mparams is not None else model_params())
    params.n_gpu_layers = 0
    params.use_extra_bufts = False
    before = read_io_bytes()  # a refused user attempt's reads count too
    if mode == "reserved" and not streaming:
        raise SeamError("the reserved open holds no expert bytes: it is for streamed runs only")
    if mode in ("user", "reserved"):
        # The reserved open builds the model through init_from_user too: the same refusals.
        refusal = user_path_refusal(layout)
        if refusal is not None and forced:
            raise UserPathUnsupported(f"cannot open {layout.shards[0]} with the {mode} path: {refusal}")
        try:
            if mode == "reserved":
                opened = open_reserved(layout, params, _open_user)
            else:
                opened = _open_user(layout, streaming, params)
        except SeamError as e:
            # auto falls back from what cannot be built faithfully, and from a reserved open
            # the seam refuses (a buffer-type mirror mismatch, a refused reservation).
            if forced or (mode == "user" and not isinstance(e, UserPathUnsupported)):
                raise
            mode, reason = "mmap-drop", f"{mode} path refused ({e}); {_WHAT['mmap-drop']}"
        else:
            opened.open_reason = reason
            opened.open_bytes_read = _delta(before, read_io_bytes())
            return opened
    params.load_mode = LOAD_MODE_MMAP
    model = lib.llama_model_load_from_file(str(layout.shards[0]).encode(), params)
    after = read_io_bytes()
    if not model:
        raise LlamaCallError(f"llama.cpp could not load {layout.shards[0]}{_why()}")
    return OpenedModel(model, mode, reason, _delta(before, after))


def _why() -> str:
    from bmoe.llama.seam import last_llama_error

    line = last_llama_error()
    return f": {line}" if line else ""


def _delta(before: int | None, after: int | None) -> int | None:
    return None if before is None or after is None else after - before


@cache
def _gguf() -> ctypes.CDLL:
    g = libggml_base()
    g.gguf_init_from_buffer.restype = ctypes.c_void_p
    g.gguf_init_from_buffer.argtypes = [ctypes.c_char_p, ctypes.c_size_t, _GgufInitParams]
    g.gguf_free.restype = None
    g.gguf_free.argtypes = [ctypes.c_void_p]
    g.gguf_find_tensor.restype = ctypes.c_int64
    g.gguf_find_tensor.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
    g.gguf_add_tensor.restype = None
    g.gguf_add_tensor.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    g.ggml_type_size.restype = ctypes.c_size_t
    g.ggml_type_size.argtypes = [ctypes.c_int]
    g.ggml_blck_size.restype = ctypes.c_int64
    g.ggml_blck_size.argtypes = [ctypes.c_int]
    return g


class _GgufInitParams(ctypes.Structure):
    _fields_ = [("no_alloc", ctypes.c_bool), ("ctx", ctypes.c_void_p)]


def _tensor_info(name: str, ggml_type: int, ne: Sequence[int]) -> GgmlTensor:
    """A ggml_tensor carrying only what gguf_add_tensor copies: name, type, shape, strides."""
    g = _gguf()
    t = GgmlTensor()
    t.type = ggml_type
    dims = list(ne) + [1] * (4 - len(ne))
    for i, n in enumerate(dims):
        t.ne[i] = n
    t.nb[0] = g.ggml_type_size(ggml_type)
    t.nb[1] = t.nb[0] * (dims[0] // g.ggml_blck_size(ggml_type))
    for i in (2, 3):
        t.nb[i] = t.nb[i - 1] * dims[i - 1]
    t.name = name.encode()
    return t


def _header_bytes(layout: ModelLayout, fd: int) -> bytes:
    """Shard 1's header (metadata + tensor index), read exactly through the random-access
    descriptor: gguf_init_from_file would read it through stdio on a default descriptor, whose
    readahead window (read_ahead_kb, 8 MiB on some machines) marks pages deep inside the dense
    tensors after it, and a later read hitting such a mark pulls in megabytes of experts."""
    first = [s.offset for s in layout.tensors.values() if s.shard == 0]
    # gguf packs tensor data from offset 0 of the data section, so the first tensor's offset is
    # where the header ends; a shard 1 without tensors is all header.
    size = min(first) if first else os.fstat(fd).st_size
    out = bytearray()
    while len(out) < size:
        chunk = os.pread(fd, size - len(out), len(out))
        if not chunk:
            raise ModelFileError(f"{layout.shards[0]}: header ends early at {len(out)} of {size} bytes")
        out += chunk
    return bytes(out)


def _gguf_context(layout: ModelLayout, fd: int, tie_output: bool) -> int:
    """Shard 1's gguf context (metadata + its tensor infos), with the infos of the other shards'
    tensors and of a tied output added so llama.cpp types every tensor as the file does."""
    g = _gguf()
    header = _header_bytes(layout, fd)
    ctx = g.gguf_init_from_buffer(header, len(header), _GgufInitParams(True, None))
    if not ctx:
        raise ModelFileError(f"{layout.shards[0]}: llama.cpp's gguf reader refuses the header{_why()}")
    try:
        extra = [s for s in layout.tensors.values() if s.shard != 0]
        if tie_output:
            tok = layout.tensors[_TOKEN_EMBD]
            extra.append(TensorSpan(_OUTPUT, tok.shard, tok.offset, tok.nbytes, tok.ne, tok.ggml_type))
        for span in extra:
            if g.gguf_find_tensor(ctx, span.name.encode()) != -1:  # gguf_add_tensor aborts on a duplicate
                raise ModelFileError(f"{layout.shards[0]}: tensor {span.name!r} is in shard 1 and shard {span.shard + 1}")
            info = _tensor_info(span.name, span.ggml_type, span.ne)
            g.gguf_add_tensor(ctx, ctypes.addressof(info))
    except BaseException:
        g.gguf_free(ctx)
        raise
    return ctx


class _Filler:
    """The set_tensor_data callback: dense bytes from the file, experts left alone when streaming,
    the file's missing optional tensors filled with their no-op value. Errors are recorded (ctypes
    would swallow them) and stop all further reads; ``open`` raises them after the load."""

    def __init__(self, layout: ModelLayout, streaming: bool, tie_output: bool) -> None:
        self.layout = layout
        self.streaming = streaming
        self.tie_output = tie_output
        self.expert_names = {et.span.name for et in layout.experts.values()}
        self.tensors: dict[str, int] = {}
        self.noop_ones: list[int] = []  # the optional tensors filled with 1.0 / 0.0 (no-op scales, biases)
        self.noop_zeros: list[int] = []
        self.error: BaseException | None = None
        self.bytes_filled = 0
        self.fds: list[int] = []
        self._nbytes = libggml_base().ggml_nbytes
        self.c_callback = llama_lib().llama_model_set_tensor_data_t(self._callback)
        try:
            for path in layout.shards:
                fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
                self.fds.append(fd)
                # Random access: readahead would read the experts around each dense tensor.
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        except OSError as e:
            self.close()
            raise ModelFileError(f"{e.filename}: cannot open for reading: {e.strerror}") from e

    def close(self) -> None:
        while self.fds:
            os.close(self.fds.pop())

    def _callback(self, tensor: int, _ud: int | None) -> None:
        if self.error is not None:
            return
        try:
            self._fill(tensor)
        except BaseException as exc:  # noqa: BLE001 - ctypes would swallow it
            self.error = exc

    def _fill(self, tensor: int) -> None:
        t = GgmlTensor.from_address(tensor)
        name = t.name.decode(errors="replace")
        self.tensors.setdefault(name, tensor)
        nbytes = self._nbytes(tensor)
        span = self.layout.tensors.get(name)
        if span is None and self.tie_output and name == _OUTPUT:
            span = self.layout.tensors[_TOKEN_EMBD]
        if span is not None:
            if t.type != span.ggml_type or nbytes != span.nbytes:
                raise UserPathUnsupported(
                    f"llama.cpp made {name} type {t.type}, {nbytes} bytes; the file has type "
                    f"{span.ggml_type}, {span.nbytes} bytes"
                )
            if self.streaming and name in self.expert_names:
                return
            self._read(span, t.data)
            return
        if _ZERO_FILL.search(name):
            value = 0.0
        elif _ONE_FILL.search(name):
            value = 1.0
        else:
            raise UserPathUnsupported(f"llama.cpp asks for {name}, which the file lacks and bmoe cannot fill")
        if t.type != GGML_TYPE_F32 or nbytes % 4:
            raise UserPathUnsupported(f"llama.cpp made the missing {name} type {t.type}, not F32")
        np.ndarray(nbytes // 4, np.float32, (ctypes.c_char * nbytes).from_address(t.data)).fill(value)
        (self.noop_zeros if value == 0.0 else self.noop_ones).append(tensor)

    def _read(self, span: TensorSpan, addr: int) -> None:
        fd = self.fds[span.shard]
        pos, end = span.offset, span.offset + span.nbytes
        while pos < end:
            n = os.preadv(fd, [(ctypes.c_char * min(end - pos, _MAX_PREAD)).from_address(addr)], pos)
            if n <= 0:
                raise ModelFileError(f"{self.layout.shards[span.shard]}: {span.name} ends early at {pos}")
            pos += n
            addr += n
        self.bytes_filled += span.nbytes
        # The model now holds its own copy: the page cache's is a duplicate.
        os.posix_fadvise(fd, span.offset, span.nbytes, os.POSIX_FADV_DONTNEED)


def _open_user(layout: ModelLayout, streaming: bool, params: Any) -> OpenedModel:
    lib = llama_lib()
    g = _gguf()
    tie_output = _OUTPUT not in layout.tensors and _TOKEN_EMBD in layout.tensors
    filler = _Filler(layout, streaming, tie_output)
    try:
        ctx = _gguf_context(layout, filler.fds[0], tie_output)
    except BaseException:
        filler.close()
        raise
    try:
        model = lib.llama_model_init_from_user(ctx, filler.c_callback, None, params)
    finally:
        filler.close()
    if not model:
        g.gguf_free(ctx)
        if filler.error is not None:
            raise _as_seam_error(filler.error)
        raise UserPathUnsupported(
            f"llama_model_init_from_user failed for {layout.shards[0]} (its one "
            f"{user_alloc_bytes(layout) / _GIB:.2f} GiB allocation refused?)"
        )
    opened = OpenedModel(model, "user", "", None, dict(filler.tensors), noop_ones=tuple(filler.noop_ones),
                         noop_zeros=tuple(filler.noop_zeros))
    opened._keep.extend([filler, filler.c_callback])
    opened._freers.append(lambda: g.gguf_free(ctx))
    if filler.error is not None:
        opened.free()
        raise _as_seam_error(filler.error)
    missing = [n for n in layout.tensors if n not in filler.tensors]
    if missing:
        opened.free()
        raise UserPathUnsupported(f"llama.cpp never asked for {len(missing)} file tensors, e.g. {missing[0]}")
    if streaming:
        _drop_unused_expert_pages(layout, opened.tensors)
    return opened


def _as_seam_error(exc: BaseException) -> BaseException:
    return as_bmoe_error(exc, SeamError, "filling the model's tensors failed")


def _drop_unused_expert_pages(layout: ModelLayout, tensors: Mapping[str, int]) -> None:
    """The never-written expert bytes of the user allocation: keep them out of RAM for good.

    With transparent huge pages on, writing a dense tensor faults in the whole 2 MiB page around
    it, experts included, and khugepaged may later collapse sparse ranges into huge pages: no
    huge pages there (MADV_NOHUGEPAGE) and the pages given back (MADV_DONTNEED). Streaming
    rebinds these tensors, so nothing reads this memory."""
    for et in layout.experts.values():
        addr = tensors.get(et.span.name)
        if addr is None:
            continue
        lo, hi = interior_pages(GgmlTensor.from_address(addr).data, et.span.nbytes)
        if hi > lo:
            madvise_range(lo, hi, _MADV_NOHUGEPAGE, "MADV_NOHUGEPAGE")
            madvise_range(lo, hi, mmap.MADV_DONTNEED, "MADV_DONTNEED")


# --- dense weights from a live graph -----------------------------------------------------------


def capture_weights(model: Any, names: Iterable[str], *, n_threads: int = 1) -> dict[str, list[int]]:
    """Every ggml_tensor named in ``names`` that a one-token decode uses, by name (a name can have
    several structs: llama.cpp duplicates tied outputs and rope factors). Runs on a throwaway
    context of its own, so the caller's context and KV are untouched. For the mmap modes, where
    no tensor callback told us the addresses."""
    lib = llama_lib()
    wanted = {n.encode() for n in names}
    found: dict[str, list[int]] = {}
    seen: set[int] = set()
    src_offset = GgmlTensor.src.offset

    def visit(node: int, _ask: bool, _ud: int | None) -> bool:
        try:
            for i in range(GGML_MAX_SRC):
                src = ctypes.c_void_p.from_address(node + src_offset + 8 * i).value
                if not src or src in seen:
                    continue
                name = GgmlTensor.from_address(src).name
                if name in wanted:
                    seen.add(src)
                    found.setdefault(name.decode(), []).append(src)
        except BaseException:  # noqa: BLE001 - ctypes would swallow it; a miss shows as absent
            pass
        return False

    c_visit = ctypes.CFUNCTYPE(ctypes.c_bool, ctypes.c_void_p, ctypes.c_bool, ctypes.c_void_p)(visit)
    cparams = lib.llama_context_default_params()
    cparams.n_ctx = cparams.n_batch = cparams.n_ubatch = 64
    cparams.n_threads = cparams.n_threads_batch = n_threads
    cparams.cb_eval = c_visit
    cparams.no_perf = True
    ctx = lib.llama_init_from_model(model, cparams)
    if not ctx:
        raise LlamaCallError("llama.cpp could not create a capture context")
    try:
        token = (ctypes.c_int32 * 1)(0)
        rc = lib.llama_decode(ctx, lib.llama_batch_get_one(token, 1))
        if rc != 0:
            raise LlamaCallError(f"capture decode returned {rc}")
    finally:
        lib.llama_free(ctx)
    return found


__all__ = [
    "MODES", "OpenedModel", "UserPathUnsupported", "capture_weights", "choose_open_mode",
    "open_model", "read_meminfo", "read_overcommit", "reserved_commit_bytes", "user_alloc_bytes",
]

