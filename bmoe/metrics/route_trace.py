"""Recording a live run's routing as a route trace (``--route-trace FILE``).

The routing gate taps every routed layer on the compute thread; this recorder only copies what it
is given into a queue there (the ids live in ggml's memory and are gone at the next node), and the
event loop writes the queue out between decode calls, so recording never does I/O on the decode
path. The trace is ``route_trace v2``: v1 rows (readable by any v1 reader, BigMoeOnEdge's
included) plus per-layer ``# timing`` lines for modelled replay: a layer's compute is the wall time
from the end of its wait for reads to the start of the next layer's routing (the first layer of a
call also carries the graph's head before it, the last one its tail up to the end of the call).
Router weights are the routed experts' router probabilities (``ffn_moe_weights``, before top-k
renormalisation).
"""

from __future__ import annotations

import os
import time
from collections import deque
from dataclasses import dataclass

import numpy as np

from bmoe.errors import OutputPathError
from bmoe.io.layout import ModelLayout
from bmoe.pipeline.trace import TraceWriter


@dataclass
class _Layer:
    step: int
    phase: int
    layer: int
    rows: np.ndarray  # routed ids, tokens x k
    experts: np.ndarray  # unique ids
    resident: np.ndarray  # per unique id: resident before this layer was served
    wait_s: float
    done: float  # perf_counter when the layer was released to compute
    weights: np.ndarray | None = None


class RouteRecorder:
    def __init__(self, path: str | os.PathLike[str], layout: ModelLayout, run: dict[str, object]) -> None:
        entry = self._entry = layout.entry_bytes()
        self._path = path
        self._failed: str | None = None  # why the trace cannot be written, once a write failed
        # The file is the recorder's own, so that the header and each call's rows are flushed at
        # once (a full disk fails the open or the call, not the session's teardown after the run)
        # and a failure names the file.
        self._f = open(path, "w", encoding="utf-8", newline="\n")
        try:
            self._writer = TraceWriter(
                self._f, model=layout.shards[0].name, arch=layout.arch, n_layer=layout.n_layer,
                n_expert=layout.n_expert, n_expert_used=layout.n_expert_used, expert_bytes=entry,
                dense_bytes={il: 0 for il in entry}, version=2, run=run,
            )
            self._f.flush()
        except BaseException as e:
            failure = self._failure(e) if isinstance(e, OSError) else None
            self._failed = self._failed or "the trace could not be started"
            self.close()
            if failure is not None:
                raise failure from e
            raise
        self._queue: deque[_Layer] = deque()
        self._call_start = 0.0
        self._position = 0
        self.turn = 0

    # --- compute thread ----------------------------------------------------------------------

    def begin_call(self, position: int) -> None:
        """A decode call starts; ``position`` is the trace's step of its first token (the prompt
        token index in prefill, the decode iteration in decode)."""
        self._position = position
        self._call_start = time.perf_counter()

    def tap(self, _step: int, phase: int, layer: int, rows: np.ndarray, experts: np.ndarray,
            resident: np.ndarray, wait_s: float) -> None:
        self._queue.append(
            _Layer(self._position, phase, layer, rows.copy(), experts, resident, wait_s, time.perf_counter())
        )

    def tap_weights(self, layer: int, weights: np.ndarray) -> None:
        if self._queue and self._queue[-1].layer == layer and self._queue[-1].weights is None:
            self._queue[-1].weights = weights.copy()

    # --- event loop, between decode calls --------------------------------------------------

    def end_call(self) -> None:
        """Write out one decode call's layers with their timings."""
        end = time.perf_counter()
        layers = list(self._queue)
        self._queue.clear()
        if self._failed is not None:
            raise OutputPathError(self._failed)
        try:
            for i, rec in enumerate(layers):
                nxt = layers[i + 1].done - layers[i + 1].wait_s if i + 1 < len(layers) else end
                compute = nxt - rec.done
                if i == 0:
                    compute += (rec.done - rec.wait_s) - self._call_start
                self._write(rec, compute)
            self._f.flush()
        except OSError as e:
            raise self._failure(e) from e

    def _write(self, rec: _Layer, compute_s: float) -> None:
        resident = dict(zip(rec.experts.tolist(), rec.resident.tolist()))
        counted: set[int] = set()
        for t, ids in enumerate(rec.rows.tolist()):
            weights = rec.weights[t].tolist() if rec.weights is not None else [float("nan")] * len(ids)
            read = []
            for e in ids:
                first = not resident[e] and e not in counted
                counted.add(e)
                read.append(self._entry[rec.layer] if first else 0)
            self._writer.add(self.turn, rec.phase, rec.step + (t if rec.phase == 0 else 0), rec.layer,
                             ids, weights, [resident[e] for e in ids], read)
        self._writer.timing(self.turn, rec.phase, rec.step, rec.layer, compute_us=compute_s * 1e6,
                            read_us=rec.wait_s * 1e6)

    def close(self) -> None:
        """Close the file; a write that fails here is one ``OutputPathError`` naming it. Once a
        failure was raised, closing is quiet, so that what closes the session goes on."""
        try:
            self._f.close()  # a failed flush still closes it
        except OSError as e:
            if self._failed is None:
                raise self._failure(e) from e

    def _failure(self, e: OSError) -> OutputPathError:
        self._failed = f"cannot write the route trace {self._path}: {e.strerror or e}"
        return OutputPathError(self._failed)
