"""A node filter in C in front of the eval callback: only MoE nodes reach Python.

llama.cpp asks the eval callback about every graph node (about 2,700 a token for a 48-layer
Qwen3-MoE), and only nodes named ``ffn_moe_*`` can matter to bmoe. In Python each question is a
ctypes trampoline, the GIL and an 8-byte read: measured at full depth, the filter alone cost about
6 % of decode (``docs/facts.md``). This filter answers "no" to every other node in C, from the
name's first 8 bytes, and hands the MoE nodes to the Python callback unchanged, so the callback
keeps its logic and runs about a fifth as often.

A plain streamed run needs one MoE node a layer, the routing (``ffn_moe_topk-<il>``); the callback
then ``narrow``s the filter to names whose next bytes match, and the filter answers the question
llama.cpp asks before computing that node ("do you want its values?": yes) in C as well: Python
runs once a layer, when the routed ids are there (48 calls a token at 48 layers, about 600 before).
Modes that watch other MoE nodes (overlap's wait points, read-ahead's router input, route traces'
weights, the lossy levers) keep every ``ffn_moe_*`` node.

It is compiled on first use with the system C compiler (``$CC``, else ``cc``) into bmoe's cache
directory, keyed by a hash of its source and the name offset, and loaded with ctypes: no build
step, no fork of llama.cpp. Without a compiler (or with ``BMOE_NODE_FILTER=python``) the Python
callback is installed directly and filters every node itself, as before: same answers, slower.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from bmoe.io.ggml import NAME_OFFSET
from bmoe.io.probe import cache_dir

_SOURCE = r"""
#include <stdbool.h>
#include <stdint.h>
#include <string.h>

typedef bool (*bmoe_eval_fn)(void * node, bool ask, void * data);

struct bmoe_node_filter {
    bmoe_eval_fn inner;  /* the Python callback, for ffn_moe_* nodes only */
    uint64_t prefix;     /* the first 8 bytes of the names it wants, read as one integer */
    uint64_t tail_mask;  /* 0: every name with the prefix; else the next 8 bytes, masked, */
    uint64_t tail;       /* must equal this, and the node's ask is answered "yes" here */
};

bool bmoe_node_filter(void * node, bool ask, void * data) {
    const struct bmoe_node_filter * f = (const struct bmoe_node_filter *) data;
    const char * name = (const char *) node + BMOE_NAME_OFFSET;
    uint64_t head;
    memcpy(&head, name, sizeof head);
    if (head != f->prefix) {
        return false;
    }
    if (f->tail_mask) {
        uint64_t tail;
        memcpy(&tail, name + sizeof head, sizeof tail);
        if ((tail & f->tail_mask) != f->tail) {
            return false;
        }
        if (ask) {
            return true;
        }
    }
    return f->inner(node, ask, NULL);
}
"""

PREFIX = int.from_bytes(b"ffn_moe_", "little")
EvalFn = ctypes.CFUNCTYPE(ctypes.c_bool, ctypes.c_void_p, ctypes.c_bool, ctypes.c_void_p)


class _FilterData(ctypes.Structure):
    _fields_ = [("inner", EvalFn), ("prefix", ctypes.c_uint64), ("tail_mask", ctypes.c_uint64),
                ("tail", ctypes.c_uint64)]


class NodeFilter:
    """The C function and its data for one callback; keep it alive as long as the context."""

    def __init__(self, lib: ctypes.CDLL, inner: EvalFn) -> None:
        self._inner = inner  # the ctypes object must outlive every call through the pointer
        self._data = _FilterData(inner, PREFIX, 0, 0)
        self.fn = ctypes.cast(lib.bmoe_node_filter, EvalFn)
        self.data = ctypes.cast(ctypes.pointer(self._data), ctypes.c_void_p)

    def narrow(self, tail: bytes | None) -> None:
        """From now on only ``ffn_moe_<tail>...`` nodes reach Python, and only once computed (the
        filter wants them all); None: every ``ffn_moe_*`` node again, asked and computed. Call it
        while no decode runs: the compute thread reads the fields."""
        if tail is None:
            self._data.tail_mask = self._data.tail = 0
            return
        if not 0 < len(tail) <= 8:
            raise ValueError(f"a name tail of 1 to 8 bytes, not {tail!r}")
        self._data.tail = int.from_bytes(tail, "little")
        self._data.tail_mask = (1 << (8 * len(tail))) - 1


_loaded: ctypes.CDLL | None = None
_failed: str | None = None  # a build that failed in this process is not tried again at every open
unavailable: str | None = None  # why the C filter is not in use, once that is known


def node_filter(inner: EvalFn) -> NodeFilter | None:
    """The C filter in front of ``inner``; None (and ``unavailable`` says why) when it cannot be
    built here, in which case ``inner`` must be installed as it is."""
    global _loaded, _failed, unavailable
    if os.environ.get("BMOE_NODE_FILTER", "c") == "python":
        unavailable = "BMOE_NODE_FILTER=python"
        return None
    if _loaded is None:
        if _failed is None:
            try:
                _loaded = ctypes.CDLL(str(_build()))
            except (OSError, subprocess.SubprocessError) as e:
                _failed = f"the C node filter could not be built: {e}"
        if _loaded is None:
            unavailable = _failed
            return None
    unavailable = None
    return NodeFilter(_loaded, inner)


def _build() -> Path:
    """The shared library for this source and name offset, compiled once per cache directory."""
    source = _SOURCE.replace("BMOE_NAME_OFFSET", str(NAME_OFFSET))
    digest = hashlib.sha256(source.encode()).hexdigest()[:16]
    target = cache_dir() / f"node-filter-{digest}.so"
    if target.exists():
        return target
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not compiler:
        raise OSError("no C compiler found (set CC)")
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".node-filter-") as tmp:
        src = Path(tmp) / "node_filter.c"
        src.write_text(source)
        out = Path(tmp) / "node_filter.so"
        done = subprocess.run([compiler, "-O2", "-shared", "-fPIC", "-o", str(out), str(src)],
                              capture_output=True, text=True, timeout=60)
        if done.returncode != 0:
            last = done.stderr.strip().splitlines()[-1:] or [f"exit status {done.returncode}"]
            raise OSError(f"{compiler} failed: {last[0]}")
        os.replace(out, target)  # atomic: a concurrent build writes the same bytes
    return target
