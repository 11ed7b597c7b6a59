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

The user open fills the optional tensors a file lacks with no-op values (1.0 scales, 0.0
biases), and llama.cpp's graph applies each one: at full depth some 16 extra nodes a layer, each a
thread barrier, which made an all-cached token about 0.85x the plain load's. Told those tensors
(``skip_noops``), the filter mutes their nodes at the ask (``GGML_OP_NONE``, which the CPU loop
skips without a barrier) in one-token graphs, where nothing but the filter looks at them.

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
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from bmoe.errors import SeamMismatchError
from bmoe.io.ggml import DATA_OFFSET, NAME_OFFSET, NE_OFFSET, OP_OFFSET, SRC_OFFSET
from bmoe.io.ggml_ffn import op_code
from bmoe.io.probe import cache_dir
from bmoe.pipeline.boundary import FastHit, UnseenHits

_SOURCE = r"""
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef bool (*bmoe_eval_fn)(void * node, bool ask, void * data);

struct bmoe_node_filter {
    bmoe_eval_fn inner;  /* the Python callback, for ffn_moe_* nodes only */
    uint64_t prefix;     /* the first 8 bytes of the names it wants, read as one integer */
    uint64_t tail_mask;  /* 0: every name with the prefix; else the next 8 bytes, masked, */
    uint64_t tail;       /* must equal this, and the node's ask is answered "yes" here */
    /* The routing fast path (narrowed to the routing node only): a one-token routing whose
       experts are all resident is answered here and logged for the cache; anything else, Python. */
    const uint8_t * const * resident;  /* per layer: one bool per expert, or NULL */
    int32_t n_layers;
    int32_t n_expert;
    int32_t fast;        /* 1: serve all-resident routings here; Python sets it between decodes */
    int32_t log_len;     /* ints logged so far; Python drains the log and sets it back to 0 */
    int32_t log_cap;
    int32_t pad;
    int32_t * log;       /* per routing served here: the layer, k, then its k ids in router order */
    /* No-op nodes (the user open's filled optional tensors): an in-place MUL by a tensor of 1.0 or
       ADD of a tensor of 0.0, reached through data moves only, is muted at its ask, with the
       REPEAT / GET_ROWS chain that feeds it. Sorted addresses; Python sets skip per decode. */
    const uint64_t * ones;
    const uint64_t * zeros;
    int32_t n_ones, n_zeros, skip, op_mul, op_add, op_none, op_repeat, op_rows, op_reshape, op_view;
    int64_t skipped;     /* nodes muted so far (their chains not counted) */
    /* Unseen routing: while the cache holds every expert (Python sets ``unseen`` per decode), a
       one-token routing node whose layer is wholly resident is not asked for, so llama.cpp does
       not split the graph there; its k hits are counted, its routing is not looked at. */
    int32_t unseen;
    int32_t pad2;
    int64_t unseen_hits;
    /* A second name the narrowed filter lets through (0: none): asked "yes" here, its computed
       node handed to Python; no fast path. A batched prompt's router node, for prediction. */
    uint64_t also_mask;
    uint64_t also;
};

/* The struct's layout as this compiler laid it out, for Python to compare with its ctypes mirror
   before it writes a single field (``check_layout``): every field's name, offset and size, in
   order, written by hand beside the struct, and the struct's size. Returns the field count. */
#define BMOE_FIELD(m) {#m, offsetof(struct bmoe_node_filter, m), sizeof(((struct bmoe_node_filter *) 0)->m)}
static const struct { const char * name; int64_t offset, size; } bmoe_fields[] = {
    BMOE_FIELD(inner), BMOE_FIELD(prefix), BMOE_FIELD(tail_mask), BMOE_FIELD(tail), BMOE_FIELD(resident),
    BMOE_FIELD(n_layers), BMOE_FIELD(n_expert), BMOE_FIELD(fast), BMOE_FIELD(log_len), BMOE_FIELD(log_cap),
    BMOE_FIELD(pad), BMOE_FIELD(log), BMOE_FIELD(ones), BMOE_FIELD(zeros), BMOE_FIELD(n_ones), BMOE_FIELD(n_zeros),
    BMOE_FIELD(skip), BMOE_FIELD(op_mul), BMOE_FIELD(op_add), BMOE_FIELD(op_none), BMOE_FIELD(op_repeat),
    BMOE_FIELD(op_rows), BMOE_FIELD(op_reshape), BMOE_FIELD(op_view), BMOE_FIELD(skipped), BMOE_FIELD(unseen),
    BMOE_FIELD(pad2), BMOE_FIELD(unseen_hits), BMOE_FIELD(also_mask), BMOE_FIELD(also),
};

int32_t bmoe_node_filter_layout(int32_t i, const char ** name, int64_t * offset, int64_t * size) {
    int32_t n = (int32_t) (sizeof bmoe_fields / sizeof *bmoe_fields);
    if (i < 0) {  /* the struct itself */
        *name = "struct bmoe_node_filter";
        *offset = 0;
        *size = (int64_t) sizeof(struct bmoe_node_filter);
    } else if (i < n) {
        *name = bmoe_fields[i].name;
        *offset = bmoe_fields[i].offset;
        *size = bmoe_fields[i].size;
    }
    return n;
}

static int bmoe_in(const uint64_t * set, int32_t n, uint64_t p) {
    int32_t lo = 0, hi = n - 1;
    while (lo <= hi) {
        int32_t mid = lo + (hi - lo) / 2;
        if (set[mid] == p) return 1;
        if (set[mid] < p) lo = mid + 1; else hi = mid - 1;
    }
    return 0;
}

#define BMOE_OP(t) (*(int32_t *) ((char *) (t) + BMOE_OP_OFFSET))
#define BMOE_SRC(t, i) (*(char **) ((char *) (t) + BMOE_SRC_OFFSET + 8 * (i)))
#define BMOE_DATA(t) (*(void **) ((char *) (t) + BMOE_DATA_OFFSET))

static void bmoe_skip_noop(struct bmoe_node_filter * f, char * node) {
    int32_t op = BMOE_OP(node);
    if (op != f->op_mul && op != f->op_add) {
        return;
    }
    char * a = BMOE_SRC(node, 0);
    char * b = BMOE_SRC(node, 1);
    if (!a || !b || BMOE_DATA(node) != BMOE_DATA(a) || memcmp(node + BMOE_NE_OFFSET, a + BMOE_NE_OFFSET, 32)) {
        return;  /* not in place over its input, or broadcast over it: the result is not the input */
    }
    const uint64_t * set = op == f->op_mul ? f->ones : f->zeros;
    int32_t n = op == f->op_mul ? f->n_ones : f->n_zeros;
    char * chain[6];
    int nc = 0;
    while (!bmoe_in(set, n, (uint64_t) (uintptr_t) b)) {
        int32_t bop = BMOE_OP(b);
        if (nc == 6 || (bop != f->op_repeat && bop != f->op_rows && bop != f->op_reshape && bop != f->op_view)) {
            return;
        }
        chain[nc++] = b;
        b = BMOE_SRC(b, 0);
        if (!b) return;
    }
    BMOE_OP(node) = f->op_none;
    for (int i = 0; i < nc; i++) {
        if (BMOE_OP(chain[i]) == f->op_repeat || BMOE_OP(chain[i]) == f->op_rows) {
            BMOE_OP(chain[i]) = f->op_none;
        }
    }
    f->skipped++;
}

/* The layer of a one-token routing node ("ffn_moe_topk-<il>") with a resident map, and its k;
   -1 for any other shape or layer. */
static int bmoe_one_token_layer(struct bmoe_node_filter * f, const char * node, const char * name, int64_t * k) {
    int64_t rows;
    int layer = atoi(name + 13);
    memcpy(k, node + BMOE_NE_OFFSET, sizeof *k);
    memcpy(&rows, node + BMOE_NE_OFFSET + 8, sizeof rows);
    if (rows != 1 || layer < 0 || layer >= f->n_layers || !f->resident[layer] || *k <= 0) {
        return -1;
    }
    return layer;
}

static bool bmoe_fast_route(struct bmoe_node_filter * f, const char * node, const char * name) {
    int64_t k;
    const int32_t * ids;
    int layer = bmoe_one_token_layer(f, node, name, &k);
    memcpy(&ids, node + BMOE_DATA_OFFSET, sizeof ids);
    if (layer < 0 || f->log_len + 2 + k > f->log_cap) {
        return false;
    }
    const uint8_t * res = f->resident[layer];
    for (int64_t i = 0; i < k; i++) {
        if (ids[i] < 0 || ids[i] >= f->n_expert || !res[ids[i]]) {
            return false;
        }
    }
    int32_t * out = f->log + f->log_len;
    out[0] = layer;
    out[1] = (int32_t) k;
    memcpy(out + 2, ids, (size_t) k * sizeof *ids);
    f->log_len += 2 + (int32_t) k;
    return true;
}

static bool bmoe_layer_whole(struct bmoe_node_filter * f, const char * node, const char * name) {
    int64_t k;
    int layer = bmoe_one_token_layer(f, node, name, &k);
    if (layer < 0 || memchr(f->resident[layer], 0, (size_t) f->n_expert) != NULL) {
        return false;
    }
    f->unseen_hits += k;
    return true;
}

bool bmoe_node_filter(void * node, bool ask, void * data) {
    struct bmoe_node_filter * f = (struct bmoe_node_filter *) data;
    if (ask && f->skip) {
        bmoe_skip_noop(f, (char *) node);
    }
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
            if (!f->also_mask || (tail & f->also_mask) != f->also) {
                return false;
            }
            return ask ? true : f->inner(node, ask, NULL);
        }
        if (ask) {
            return !(f->fast && f->unseen && bmoe_layer_whole(f, (const char *) node, name));
        }
        if (f->fast && bmoe_fast_route(f, (const char *) node, name)) {
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
                ("tail", ctypes.c_uint64), ("resident", ctypes.POINTER(ctypes.c_void_p)),
                ("n_layers", ctypes.c_int32), ("n_expert", ctypes.c_int32), ("fast", ctypes.c_int32),
                ("log_len", ctypes.c_int32), ("log_cap", ctypes.c_int32), ("pad", ctypes.c_int32),
                ("log", ctypes.POINTER(ctypes.c_int32)),
                ("ones", ctypes.POINTER(ctypes.c_uint64)), ("zeros", ctypes.POINTER(ctypes.c_uint64)),
                *((f, ctypes.c_int32) for f in ("n_ones", "n_zeros", "skip", "op_mul", "op_add", "op_none",
                                                  "op_repeat", "op_rows", "op_reshape", "op_view")),
                ("skipped", ctypes.c_int64), ("unseen", ctypes.c_int32), ("pad2", ctypes.c_int32),
                ("unseen_hits", ctypes.c_int64), ("also_mask", ctypes.c_uint64), ("also", ctypes.c_uint64)]


def check_layout(lib: ctypes.CDLL, mirror: type[ctypes.Structure] = _FilterData) -> None:
    """Refuse a ctypes mirror that does not lay the struct out as the compiled C does (a field
    added, moved or resized on one side only): one ``SeamMismatchError`` line, before any field
    is written, never a read of the wrong bytes on the compute thread."""
    fn = lib.bmoe_node_filter_layout
    fn.restype = ctypes.c_int32
    fn.argtypes = [ctypes.c_int32, ctypes.POINTER(ctypes.c_char_p), ctypes.POINTER(ctypes.c_int64),
                   ctypes.POINTER(ctypes.c_int64)]
    name, offset, size = ctypes.c_char_p(), ctypes.c_int64(), ctypes.c_int64()

    def entry(i: int) -> tuple[str, int, int]:
        fn(i, ctypes.byref(name), ctypes.byref(offset), ctypes.byref(size))
        return (name.value or b"").decode(), offset.value, size.value

    n = fn(-1, ctypes.byref(name), ctypes.byref(offset), ctypes.byref(size))
    c_side = [("the struct", 0, size.value), *(entry(i) for i in range(n))]
    ours = [("the struct", 0, ctypes.sizeof(mirror)),
            *((f, getattr(mirror, f).offset, getattr(mirror, f).size) for f, *_ in mirror._fields_)]
    for i in range(max(len(c_side), len(ours))):
        c, m = (side[i] if i < len(side) else None for side in (c_side, ours))
        if c != m:
            raise SeamMismatchError(f"the C node filter's struct and its ctypes mirror disagree: the C side has "
                                    f"{_field(c)}, the mirror {_field(m)}")


def _field(entry: tuple[str, int, int] | None) -> str:
    if entry is None:
        return "no field there"
    name, offset, size = entry
    return f"{name}: {size} bytes" + (f" at offset {offset}" if name != "the struct" else "")


class NodeFilter:
    """The C function and its data for one callback; keep it alive as long as the context."""

    def __init__(self, lib: ctypes.CDLL, inner: EvalFn) -> None:
        self._inner = inner  # the ctypes object must outlive every call through the pointer
        self._data = _FilterData(inner, PREFIX, 0, 0)
        self._log: np.ndarray | None = None
        self.fn = ctypes.cast(lib.bmoe_node_filter, EvalFn)
        self.data = ctypes.cast(ctypes.pointer(self._data), ctypes.c_void_p)

    def narrow(self, tail: bytes | None, also: bytes | None = None) -> None:
        """From now on only ``ffn_moe_<tail>...`` nodes (and ``ffn_moe_<also>...`` ones, if given)
        reach Python, and only once computed (the filter wants them all); None: every
        ``ffn_moe_*`` node again, asked and computed. Call it while no decode runs: the compute
        thread reads the fields."""
        d = self._data
        if tail is None:
            d.tail_mask = d.tail = d.also_mask = d.also = 0
            return
        d.tail, d.tail_mask = _name_tail(tail)
        d.also, d.also_mask = _name_tail(also) if also is not None else (0, 0)

    LOG_INTS = 1 << 16  # routings logged between two drains: ~150 one-token steps at 48 layers, k = 8

    def serve_routing(self, resident: list[np.ndarray], n_expert: int) -> None:
        """Let the filter serve a one-token routing whose experts are all marked in ``resident``
        (per layer, a bool per expert, read in place) whenever ``fast`` is on; such routings are
        logged for ``drain``. The arrays must live, unmoved, as long as this filter."""
        self._resident = resident
        table = (ctypes.c_void_p * len(resident))(*[m.ctypes.data for m in resident])
        self._table = table
        self._log = np.zeros(self.LOG_INTS, dtype=np.int32)
        self._data.resident = ctypes.cast(table, ctypes.POINTER(ctypes.c_void_p))
        self._data.n_layers = len(resident)
        self._data.n_expert = n_expert
        self._data.log = self._log.ctypes.data_as(ctypes.POINTER(ctypes.c_int32))
        self._data.log_cap = self.LOG_INTS
        self._data.log_len = 0

    def skip_noops(self, ones: Sequence[int], zeros: Sequence[int]) -> None:
        """Mute the nodes that apply these tensors as no-ops (``ones``: every value 1.0, applied by
        MUL; ``zeros``: 0.0, by ADD; in place, reached through REPEAT / GET_ROWS / views only),
        with the chain that feeds them, whenever ``set_skip`` is on. The user open fills the
        optional tensors a file lacks this way (``bmoe.llama.loader``): each would otherwise be
        a node and a thread barrier a token that the plain load's graph does not have."""
        self._ones = np.array(sorted(set(ones)), dtype=np.uint64)
        self._zeros = np.array(sorted(set(zeros)), dtype=np.uint64)
        d = self._data
        d.ones = self._ones.ctypes.data_as(ctypes.POINTER(ctypes.c_uint64))
        d.zeros = self._zeros.ctypes.data_as(ctypes.POINTER(ctypes.c_uint64))
        d.n_ones, d.n_zeros = len(self._ones), len(self._zeros)
        (d.op_mul, d.op_add, d.op_none, d.op_repeat, d.op_rows, d.op_reshape, d.op_view) = (
            op_code(n) for n in ("MUL", "ADD", "NONE", "REPEAT", "GET_ROWS", "RESHAPE", "VIEW"))

    def set_skip(self, on: bool) -> None:
        """Mute no-op nodes in the graphs computed from now on (call it while no decode runs). Off
        for a graph that expert-major reads: it matches the scale chain op by op."""
        self._data.skip = 1 if on and (self._data.n_ones or self._data.n_zeros) else 0

    @property
    def skipped(self) -> int:
        """No-op nodes muted so far (a reused graph keeps its muted nodes and counts none again)."""
        return int(self._data.skipped)

    def set_fast(self, on: bool) -> None:
        """Serve all-resident routings in C (True), or hand every routing to Python. Any thread:
        an abort turns it off so the next routing reaches Python, which stops the graph."""
        self._data.fast = 1 if on and self._data.log_cap else 0

    def set_unseen(self, on: bool) -> None:
        """While on, a one-token routing whose layer is wholly resident is not asked for (no graph
        split there, no log: ``drain`` reports its hits as ``UnseenHits``). For a cache that holds
        every expert, where no routing can change what is resident. Call it while no decode runs."""
        self._data.unseen = 1 if on else 0

    def drain(self) -> list[FastHit | UnseenHits]:
        """The routings served in C since the last drain, in order: (layer, experts sorted by
        id, each one's rank), as ``routed_set`` gives them, then the hits of the routings let
        pass unseen, if any. Call it when no decode runs, or on the compute thread itself."""
        out: list[FastHit | UnseenHits] = []
        unseen = self._data.unseen_hits
        if unseen:
            self._data.unseen_hits = 0
            out.append(UnseenHits(int(unseen)))
        n = self._data.log_len
        if not n:
            return out
        log = self._log[:n].copy()
        self._data.log_len = 0
        k = int(log[1])
        if n % (2 + k) == 0 and (log[1 :: 2 + k] == k).all():  # one k throughout (decode): one sort
            rows = log.reshape(-1, 2 + k)
            order = np.argsort(rows[:, 2:], axis=1, kind="stable")
            ids = np.take_along_axis(rows[:, 2:], order, axis=1)
            out.extend(zip(rows[:, 0].tolist(), ids, order))
            return out
        i = 0
        while i < n:
            layer, k = int(log[i]), int(log[i + 1])
            ids = log[i + 2 : i + 2 + k]
            order = np.argsort(ids, kind="stable")
            out.append((layer, ids[order], order))
            i += 2 + k
        return out


_loaded: ctypes.CDLL | None = None
_failed: str | None = None  # a build that failed in this process is not tried again at every open
unavailable: str | None = None  # why the C filter is not in use, once that is known


def _name_tail(tail: bytes) -> tuple[int, int]:
    """The 8 bytes after ``ffn_moe_`` that a name must start with, as (value, mask)."""
    if not 0 < len(tail) <= 8:
        raise ValueError(f"a name tail of 1 to 8 bytes, not {tail!r}")
    return int.from_bytes(tail, "little"), (1 << (8 * len(tail))) - 1


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
    check_layout(_loaded)
    unavailable = None
    return NodeFilter(_loaded, inner)


def _build() -> Path:
    """The shared library for this source and name offset, compiled once per cache directory."""
    source = (_SOURCE.replace("BMOE_NAME_OFFSET", str(NAME_OFFSET)).replace("BMOE_NE_OFFSET", str(NE_OFFSET))
              .replace("BMOE_DATA_OFFSET", str(DATA_OFFSET)).replace("BMOE_OP_OFFSET", str(OP_OFFSET))
              .replace("BMOE_SRC_OFFSET", str(SRC_OFFSET)))
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
