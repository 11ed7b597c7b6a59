"""Route traces: every routing decision of a run, as a file that cache policies can be replayed on.

Format ``route_trace v1`` (the one in ``../shared/traces/``, written by BigMoeOnEdge's
``--route-trace``): a CSV preceded by ``#`` lines::

    # route_trace v1
    # model=<file> arch=<arch> n_layer=<n> n_expert=<n> n_expert_used=<k>
    # layer=<il> expert_bytes=<one expert, all projections> dense_bytes=<the layer's dense bytes>
    ...                                                  (one line per MoE layer)
    turn,phase,step,layer,slot,expert,weight,residency,expert_bytes
    0,0,0,0,0,49,0.221297,0,3059712

One row per routed slot: ``phase`` 0 = prefill, 1 = decode; ``step`` the token index; ``slot``
the rank within the top-k (0 = the highest router weight: llama.cpp's top-k rows are in
descending weight order, and BigMoeOnEdge's traces too); ``weight`` the router weight (``nan`` if the recorder had none);
``residency`` 1 if the expert was already cached in the recorded run, and then ``expert_bytes``
(the bytes read for it) is 0 (a prompt token's expert that an earlier token of the same call
already read also reads 0).
Rows are in execution order: a prefill ubatch runs layer by layer, so its rows are layer-major
(layer 0 for every prompt token, then layer 1, ...); decode rows are token-major. llama.cpp computes
only the output rows at the last layer, so prefill's last layer usually holds only the last token.

``route_trace v2`` is v1 plus ``#`` lines a v1 reader skips (any ``#`` line is a comment to it),
carrying what a timed replay needs. The rows and the v1 header lines are unchanged::

    # route_trace v2
    # model=... (as v1)
    # layer=... (as v1)
    # run key=value ...          optional, once, after the layer lines: how the run was made
                                 (e.g. cache_bytes=4194304000 policy=lru io_threads=4); free-form
    turn,phase,...               (as v1)
    <the rows of one (turn, phase, step, layer)>
    # timing turn=<t> phase=<p> step=<s> layer=<il> compute_us=<float> [read_us=<float>]
                                 optional, after the rows it times, one per layer per llama_decode
                                 call (``step`` = the call's first token): the layer's compute time
                                 (its expert matmuls and everything up to the next layer's routing)
                                 and optionally the wall time spent waiting for its reads; a replay
                                 models the overlap of reads and compute from these
    # summary key=value ...      optional, last: run totals (free-form)

Readers here accept both versions, ignore ``#`` lines they do not know (so later extensions stay
readable), and raise ``TraceFormatError`` naming the file and line for anything malformed. The
reader streams the file a bounded line at a time and checks the header's numbers against bounds
before anything is sized from them, so ``/dev/zero``, a binary file or a header claiming two
billion layers ends in one line within a fraction of a second and bounded memory (``MAX_*``).
"""

from __future__ import annotations

import io
import math
import os
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple, TextIO

import numpy as np

from bmoe.errors import TraceFormatError

COLUMNS = ("turn", "phase", "step", "layer", "slot", "expert", "weight", "residency", "expert_bytes")
# Each column's type in RouteTrace: a row's values are checked against it before the cast, which
# wrapped them round (layer=65536 was replayed as layer 0, phase=257 as decode).
_DTYPES = (np.int32, np.int8, np.int32, np.int16, np.int16, np.int32, np.float32, np.int8, np.int64)
HEADER_V1 = "# route_trace v1"
HEADER_V2 = "# route_trace v2"
_MODEL_KEYS = ("model", "arch", "n_layer", "n_expert", "n_expert_used")
# Bounds checked before anything is allocated from a trace's own numbers. Generous against every
# published model (llama.cpp's LLAMA_MAX_LAYERS is 512; the most experts any has is 512; a
# gpt-oss-120b expert is 12.6 MiB) while keeping a hostile file's cost small.
MAX_LINE_BYTES = 4096
MAX_ROWS = 1 << 24  # routed slots: 16.7 M, e.g. 94 layers x top-10 over 17 000 tokens
MAX_LAYERS = 512
MAX_EXPERTS = 1 << 14
MAX_EXPERT_BYTES = 1 << 34  # 16 GiB for one expert
MAX_DENSE_BYTES = 1 << 40


class Access(NamedTuple):
    """The routed experts of one layer for one token (in slot order), with their slots (ranks)
    and router weights."""

    turn: int
    phase: int
    step: int
    layer: int
    experts: tuple[int, ...]
    slots: tuple[int, ...] = ()
    weights: tuple[float, ...] = ()


class LayerEvent(NamedTuple):
    """What the engine's cache sees: one layer of one llama_decode call (a whole ubatch in prefill).

    ``experts`` are unique (sorted, as the eval callback hands them over, or in recorded order);
    ``ends_call`` marks the last layer of the call, after which the engine trims the cache;
    ``step`` is the first token of the call. ``ranks`` and ``weights``: per expert of
    ``experts``, its best router rank over the call's tokens (0 = the highest weight) and its
    largest router weight (nan where the recorder had none); None when not known.
    """

    turn: int
    phase: int
    step: int
    layer: int
    experts: tuple[int, ...]
    ends_call: bool
    ranks: tuple[int, ...] | None = None
    weights: tuple[float, ...] | None = None


@dataclass
class RouteTrace:
    """A parsed route trace: header fields, per-layer sizes and the rows as column arrays."""

    path: str
    version: int
    model: str
    arch: str
    n_layer: int
    n_expert: int
    n_expert_used: int
    expert_bytes: dict[int, int]  # layer -> bytes of one expert (all projections)
    dense_bytes: dict[int, int]  # layer -> the layer's dense bytes
    turn: np.ndarray  # int32, one value per row
    phase: np.ndarray  # int8
    step: np.ndarray  # int32
    layer: np.ndarray  # int16
    slot: np.ndarray  # int16
    expert: np.ndarray  # int32
    weight: np.ndarray  # float32
    residency: np.ndarray  # int8
    bytes_read: np.ndarray  # int64: the ``expert_bytes`` column (0 for a resident expert)
    run: dict[str, str] = field(default_factory=dict)  # v2 ``# run`` line
    summary: dict[str, str] = field(default_factory=dict)  # v2 ``# summary`` line
    # v2 timing: (turn, phase, step, layer) -> {"compute_us": ..., "read_us": ...}
    timing: dict[tuple[int, int, int, int], dict[str, float]] = field(default_factory=dict)

    def __len__(self) -> int:
        return int(self.turn.shape[0])

    @property
    def moe_layers(self) -> list[int]:
        return sorted(self.expert_bytes)

    def batched(self, streams: int) -> RouteTrace:
        """The decode of this trace as ``streams`` concurrent sequences would run it in the step
        scheduler: the decoded tokens cut into ``streams`` equal runs (independent requests), and
        step ``s`` of the result holds token ``s`` of every run, so each layer's routing event is
        the union over the streams (``layer_events`` merges a step's rows). Prefill rows are left
        out, and so is a remainder of fewer than ``streams`` tokens. Real routing of one request
        stands in for several: what it cannot show is how much more (or less) independent
        requests' experts differ than distant parts of one."""
        if streams < 1:
            raise ValueError(f"streams must be >= 1, got {streams}")
        dec = np.flatnonzero(self.phase == 1)
        keys = np.stack([self.turn[dec], self.step[dec]])
        _, token = np.unique(keys, axis=1, return_inverse=True)  # the decoded token of each row
        token = token.reshape(-1)
        n_tok = int(token.max()) + 1 if token.size else 0
        per = n_tok // streams
        if per == 0:
            raise ValueError(f"the trace decodes {n_tok} tokens: fewer than {streams} streams need")
        keep = token < per * streams
        rows, token = dec[keep], token[keep]
        stream, step = token // per, token % per
        order = np.lexsort((np.arange(rows.size), stream, self.layer[rows], step))
        rows, step = rows[order], step[order]

        def col(a: np.ndarray) -> np.ndarray:
            return a[rows].copy()

        return RouteTrace(
            path=self.path, version=self.version, model=self.model, arch=self.arch, n_layer=self.n_layer,
            n_expert=self.n_expert, n_expert_used=self.n_expert_used, expert_bytes=dict(self.expert_bytes),
            dense_bytes=dict(self.dense_bytes), turn=np.zeros(rows.size, dtype=self.turn.dtype),
            phase=col(self.phase), step=step.astype(self.step.dtype), layer=col(self.layer), slot=col(self.slot),
            expert=col(self.expert), weight=col(self.weight), residency=col(self.residency),
            bytes_read=col(self.bytes_read), run=dict(self.run), summary={},
        )

    def working_set_bytes(self) -> int:
        """One token's worst-case routed bytes: every layer's top-k (what LRU needs to hit at all)."""
        return self.n_expert_used * sum(self.expert_bytes.values())

    def tokens(self, phase: int, turn: int | None = None) -> int:
        """Distinct token steps recorded in a phase (optionally of one turn)."""
        mask = self.phase == phase
        if turn is not None:
            mask &= self.turn == turn
        keys = np.unique(np.stack([self.turn[mask], self.step[mask]]), axis=1)
        return int(keys.shape[1])

    def _group_bounds(self) -> np.ndarray:
        """Start indices of the runs of rows sharing (turn, phase, step, layer), plus the end."""
        n = len(self)
        if n == 0:
            return np.zeros(1, dtype=np.int64)
        change = np.zeros(n, dtype=bool)
        change[0] = True
        for col in (self.turn, self.phase, self.step, self.layer):
            change[1:] |= col[1:] != col[:-1]
        return np.append(np.flatnonzero(change), n)

    def accesses(self) -> Iterator[Access]:
        """Per (turn, phase, step, layer), in recorded (execution) order, the routed experts.

        Prefill is per token as recorded (layer-major within the ubatch, as it ran); decode is one
        access per layer per token.
        """
        bounds = self._group_bounds()
        experts = self.expert.tolist()
        slots = self.slot.tolist()
        weights = self.weight.tolist()
        turn, phase, step, layer = (a.tolist() for a in (self.turn, self.phase, self.step, self.layer))
        for i in range(len(bounds) - 1):
            a, b = int(bounds[i]), int(bounds[i + 1])
            yield Access(turn[a], phase[a], step[a], layer[a], tuple(experts[a:b]), tuple(slots[a:b]),
                         tuple(weights[a:b]))

    def layer_events(
        self, ubatch: int | None = None, prefill: str = "batch", order: str = "engine"
    ) -> list[LayerEvent]:
        """The cache's view of the run, as the engine produces it.

        ``prefill="batch"`` (the engine): each llama_decode call routes every layer once for all
        its tokens, so the cache sees one event per layer with the union of the experts, and is
        trimmed after the call. The calls of a prompt are read from the rows (a call's rows are
        layer-major, so the layer going back down starts the next call), or, with ``ubatch``, the
        prompt is re-cut into calls of that many tokens. ``prefill="tokens"``: one event per
        recorded (token, layer), in recorded order, and a trim after each call (a finer-grained
        view, for comparison). Decode: one call per token.
        ``order="engine"``: each event's experts sorted by id, as the eval callback hands them over
        (``np.unique``); ``order="recorded"``: slot order in decode, last use in prefill (what
        BigMoeOnEdge's ``route-replay.py`` does). Only the order in which a policy hears of the
        layer's hits and misses differs; LRU moves by a few hundredths of a point.
        """
        if prefill not in ("batch", "tokens"):
            raise ValueError(f"prefill must be 'batch' or 'tokens', got {prefill!r}")
        if order not in ("engine", "recorded"):
            raise ValueError(f"order must be 'engine' or 'recorded', got {order!r}")
        if ubatch is not None and ubatch < 1:
            raise ValueError(f"ubatch must be >= 1, got {ubatch}")
        calls: list[list[Access]] = []  # one list per llama_decode call
        prompt: list[Access] = []  # the current turn's prefill, cut into calls when it ends

        def flush_prompt() -> None:
            if not prompt:
                return
            if ubatch is None:
                calls.append([prompt[0]])
                for prev, a in zip(prompt, prompt[1:]):
                    if a.layer < prev.layer:
                        calls.append([])
                    calls[-1].append(a)
            else:
                start = prompt[0].step
                cut: dict[int, list[Access]] = {}
                for a in prompt:  # execution order kept within each call
                    cut.setdefault((a.step - start) // ubatch, []).append(a)
                calls.extend(cut[i] for i in sorted(cut))
            prompt.clear()

        call_key: tuple[int, int, int] | None = None
        for acc in self.accesses():
            if acc.phase == 0:
                if prompt and prompt[-1].turn != acc.turn:
                    flush_prompt()
                prompt.append(acc)
                call_key = None
                continue
            flush_prompt()
            key = (acc.turn, acc.phase, acc.step)
            if key != call_key:
                calls.append([])
                call_key = key
            calls[-1].append(acc)
        flush_prompt()
        events: list[LayerEvent] = []
        for call in calls:
            head = call[0]
            if head.phase == 0 and prefill == "batch":
                by_layer: dict[int, dict[int, None]] = {}
                best: dict[int, dict[int, tuple[int, float]]] = {}
                # Token-major within each layer, so "last use" follows the prompt's token order.
                for acc in sorted(call, key=lambda a: (a.layer, a.step)):
                    seen = by_layer.setdefault(acc.layer, {})
                    top = best.setdefault(acc.layer, {})
                    for e, r, w in zip(acc.experts, acc.slots, acc.weights):
                        seen.pop(e, None)
                        seen[e] = None
                        r0, w0 = top.get(e, (r, w))
                        top[e] = (min(r, r0), w if math.isnan(w0) else max(w, w0))
                step0 = min(a.step for a in call)
                group = [
                    LayerEvent(head.turn, head.phase, step0, il, tuple(seen), False,
                               tuple(best[il][e][0] for e in seen), tuple(best[il][e][1] for e in seen))
                    for il, seen in by_layer.items()  # layer order of first appearance
                ]
            else:
                group = []
                for a in call:
                    top = {}
                    for e, r, w in zip(a.experts, a.slots, a.weights):
                        top.setdefault(e, (r, w))
                    group.append(LayerEvent(a.turn, a.phase, a.step, a.layer, tuple(top), False,
                                            tuple(v[0] for v in top.values()), tuple(v[1] for v in top.values())))
            if order == "engine":
                group = [_sorted_event(g) for g in group]
            group[-1] = group[-1]._replace(ends_call=True)
            events.extend(group)
        return events


def _sorted_event(ev: LayerEvent) -> LayerEvent:
    """The event with its experts sorted by id (ranks and weights follow)."""
    order = sorted(range(len(ev.experts)), key=ev.experts.__getitem__)

    def pick(values: tuple | None) -> tuple | None:
        return None if values is None else tuple(values[i] for i in order)

    return ev._replace(experts=pick(ev.experts), ranks=pick(ev.ranks), weights=pick(ev.weights))


def _fail(path: str, lineno: int, what: str) -> TraceFormatError:
    return TraceFormatError(f"{path}:{lineno}: {what}")


def _pairs(path: str, lineno: int, text: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for token in text.split():
        key, sep, value = token.partition("=")
        if not sep or not key:
            raise _fail(path, lineno, f"expected key=value, got {token!r}")
        out[key] = value
    return out


def _int(path: str, lineno: int, pairs: Mapping[str, str], key: str) -> int:
    try:
        value = int(pairs[key])
    except KeyError:
        raise _fail(path, lineno, f"missing {key}=") from None
    except ValueError:
        raise _fail(path, lineno, f"{key}={pairs[key]!r} is not an integer") from None
    if value < 0:
        raise _fail(path, lineno, f"{key}={value} is negative")
    return value


def _float(path: str, lineno: int, pairs: Mapping[str, str], key: str) -> float:
    try:
        value = float(pairs[key])
    except ValueError:
        raise _fail(path, lineno, f"{key}={pairs[key]!r} is not a number") from None
    if not math.isfinite(value) or value < 0:
        raise _fail(path, lineno, f"{key}={value} must be finite and >= 0")
    return value


def read_trace(path: str | os.PathLike[str]) -> RouteTrace:
    """Read a route trace (v1 or v2). Raises TraceFormatError (file:line) on malformed input."""
    name = os.fspath(path)
    try:
        with open(name, "rb") as f:
            return _parse(name, _lines(name, f))
    except OSError as e:
        raise TraceFormatError(f"{name}: cannot read route trace: {e.strerror or e}") from e


def _lines(name: str, f: io.BufferedReader) -> Iterator[tuple[int, str]]:
    """(line number, text) of each line, each read with a bound: no line longer than
    ``MAX_LINE_BYTES``, UTF-8 only."""
    lineno = 0
    while True:
        raw = f.readline(MAX_LINE_BYTES + 1)
        if not raw:
            return
        lineno += 1
        if len(raw) > MAX_LINE_BYTES:
            raise _fail(name, lineno, f"a line longer than {MAX_LINE_BYTES} bytes: not a route trace")
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise _fail(name, lineno, f"not a text route trace ({e.reason})") from None
        yield lineno, text.rstrip("\r\n")


def _bounded(name: str, lineno: int, pairs: Mapping[str, str], key: str, lo: int, hi: int) -> int:
    value = _int(name, lineno, pairs, key)
    if not lo <= value <= hi:
        raise _fail(name, lineno, f"{key}={value} is out of range ({lo}..{hi})")
    return value


def _parse(name: str, numbered: Iterator[tuple[int, str]]) -> RouteTrace:
    first = next(numbered, None)
    head = first[1].strip() if first is not None else ""
    if head not in (HEADER_V1, HEADER_V2):
        got = head[:60] if first is not None else "an empty file"
        raise _fail(name, 1, f"expected '{HEADER_V1}' or '{HEADER_V2}', got {got!r}")
    version = 2 if head == HEADER_V2 else 1
    last_line = 1
    model: dict[str, str] | None = None
    expert_bytes: dict[int, int] = {}
    dense_bytes: dict[int, int] = {}
    run: dict[str, str] = {}
    summary: dict[str, str] = {}
    timing: dict[tuple[int, int, int, int], dict[str, float]] = {}
    body: list[str] = []
    body_lineno: list[int] = []
    columns_seen = False
    for lineno, raw in numbered:
        last_line = lineno
        line = raw.strip()
        if not line:
            continue
        if line.startswith("#"):
            text = line[1:].strip()
            kind = text.split("=", 1)[0].split(None, 1)[0] if text else ""
            if kind == "model" and model is None:
                model = _pairs(name, lineno, text)
                _bounded(name, lineno, model, "n_layer", 1, MAX_LAYERS)
                n_expert = _bounded(name, lineno, model, "n_expert", 1, MAX_EXPERTS)
                _bounded(name, lineno, model, "n_expert_used", 0, n_expert)
                if "arch" not in model:
                    raise _fail(name, lineno, "missing arch=")
                if expert_bytes and max(expert_bytes) >= int(model["n_layer"]):
                    raise _fail(name, lineno, f"a layer line describes layer {max(expert_bytes)} but "
                                f"n_layer={model['n_layer']}")
            elif kind == "layer" and "expert_bytes=" in text:
                pairs = _pairs(name, lineno, text)
                top = int(model["n_layer"]) - 1 if model is not None else MAX_LAYERS - 1
                il = _bounded(name, lineno, pairs, "layer", 0, top)
                if il in expert_bytes:
                    raise _fail(name, lineno, f"layer {il} described twice")
                expert_bytes[il] = _bounded(name, lineno, pairs, "expert_bytes", 1, MAX_EXPERT_BYTES)
                dense_bytes[il] = (_bounded(name, lineno, pairs, "dense_bytes", 0, MAX_DENSE_BYTES)
                                   if "dense_bytes" in pairs else 0)
            elif kind == "run" and text.startswith("run "):
                run.update(_pairs(name, lineno, text[4:]))
            elif kind == "summary" and text.startswith("summary"):
                summary.update(_pairs(name, lineno, text[7:]))
            elif kind == "timing" and text.startswith("timing "):
                pairs = _pairs(name, lineno, text[7:])
                key = tuple(_int(name, lineno, pairs, k) for k in ("turn", "phase", "step", "layer"))
                if len(timing) >= MAX_ROWS:
                    raise _fail(name, lineno, f"more than {MAX_ROWS} timing lines")
                timing[key] = {  # type: ignore[index]
                    k: _float(name, lineno, pairs, k) for k in ("compute_us", "read_us") if k in pairs
                }
            # Any other '#' line is a comment (or a later extension): ignored.
            continue
        if not columns_seen:
            if tuple(c.strip() for c in line.split(",")) != COLUMNS:
                raise _fail(name, lineno, f"expected the column row {','.join(COLUMNS)!r}")
            columns_seen = True
            continue
        if len(body) >= MAX_ROWS:
            raise _fail(name, lineno, f"more than {MAX_ROWS} rows: too large for a route trace")
        body.append(line)
        body_lineno.append(lineno)
    if model is None:
        raise _fail(name, 2, "no '# model=... arch=... n_layer=... n_expert=... n_expert_used=...' line")
    if not columns_seen:
        raise _fail(name, last_line, "no column row: the trace has no routing")
    if not expert_bytes:  # replays size everything by these (an internal error without them)
        raise _fail(name, last_line, "no '# layer=... expert_bytes=...' line: the trace names no MoE layer")
    n_layer = int(model["n_layer"])
    n_expert = int(model["n_expert"])
    n_used = int(model["n_expert_used"])
    cols = _parse_rows(name, body, body_lineno)
    trace = RouteTrace(
        path=name, version=version, model=model.get("model", ""), arch=model["arch"],
        n_layer=n_layer, n_expert=n_expert, n_expert_used=n_used,
        expert_bytes=expert_bytes, dense_bytes=dense_bytes,
        turn=cols[0].astype(_DTYPES[0]), phase=cols[1].astype(_DTYPES[1]), step=cols[2].astype(_DTYPES[2]),
        layer=cols[3].astype(_DTYPES[3]), slot=cols[4].astype(_DTYPES[4]), expert=cols[5].astype(_DTYPES[5]),
        weight=cols[6].astype(_DTYPES[6]), residency=cols[7].astype(_DTYPES[7]),
        bytes_read=cols[8].astype(_DTYPES[8]), run=run, summary=summary, timing=timing,
    )
    _check(trace, body_lineno)
    return trace


def _parse_rows(name: str, body: list[str], body_lineno: list[int]) -> list[np.ndarray]:
    if not body:
        return [np.zeros(0, dtype=np.float64) for _ in COLUMNS]
    try:
        table = np.loadtxt(io.StringIO("\n".join(body)), delimiter=",", dtype=np.float64, ndmin=2)
    except ValueError:
        table = None
    if table is None or table.shape[1] != len(COLUMNS):
        _locate_bad_row(name, body, body_lineno)
        raise TraceFormatError(f"{name}: malformed rows")  # _locate_bad_row found nothing
    cols = [table[:, c] for c in range(len(COLUMNS))]
    for c, col in enumerate(cols):
        if c != 6:
            frac = np.flatnonzero(col != np.floor(col))  # nan and inf fail here too
            if frac.size:
                i = int(frac[0])
                raise _fail(name, body_lineno[i], f"{COLUMNS[c]}={body[i].split(',')[c]!r} is not an integer")
            top = min(float(np.iinfo(_DTYPES[c]).max), 2.0 ** 53)  # exact in a float64
            out = np.flatnonzero((col < 0) | (col > top))
            if out.size:
                i = int(out[0])
                raise _fail(name, body_lineno[i], f"{COLUMNS[c]}={body[i].split(',')[c].strip()!r} is out of range "
                                                  f"(0 to {int(top)})")
    bad_w = np.flatnonzero(np.isinf(cols[6]))  # nan is allowed: "not recorded"
    if bad_w.size:
        raise _fail(name, body_lineno[int(bad_w[0])], "weight is infinite")
    return cols


def _locate_bad_row(name: str, body: list[str], body_lineno: list[int]) -> None:
    for i, line in enumerate(body):
        row = line.split(",")
        if len(row) != len(COLUMNS):
            raise _fail(name, body_lineno[i], f"expected {len(COLUMNS)} fields, got {len(row)}")
        for c, v in enumerate(row):
            try:
                float(v) if c == 6 else int(v)
            except ValueError:
                raise _fail(name, body_lineno[i], f"{COLUMNS[c]}={v.strip()!r} is not a number") from None


def _check(t: RouteTrace, body_lineno: list[int]) -> None:
    def bad(mask: np.ndarray, what: str) -> None:
        idx = np.flatnonzero(mask)
        if idx.size:
            i = int(idx[0])
            raise _fail(t.path, body_lineno[i], what.format(row=i))

    bad(t.layer >= t.n_layer, f"layer out of range (n_layer={t.n_layer})")
    bad(t.expert >= t.n_expert, f"expert out of range (n_expert={t.n_expert})")
    bad(t.slot >= max(t.n_expert_used, 1), f"slot out of range (n_expert_used={t.n_expert_used})")
    bad((t.turn < 0) | (t.step < 0) | (t.layer < 0) | (t.slot < 0) | (t.expert < 0), "negative field")
    bad((t.phase != 0) & (t.phase != 1), "phase must be 0 (prefill) or 1 (decode)")
    bad((t.residency != 0) & (t.residency != 1), "residency must be 0 or 1")
    bad(t.bytes_read < 0, "expert_bytes is negative")
    known = np.zeros(max(t.n_layer, 1), dtype=bool)
    for il in t.expert_bytes:
        if il >= t.n_layer:
            raise TraceFormatError(f"{t.path}: header describes layer {il} but n_layer={t.n_layer}")
        known[il] = True
    bad(~known[t.layer.astype(np.int64)], "no '# layer=' header line for this row's layer")


class TraceWriter:
    """Writes a route trace as rows arrive: v1, or v2 when asked for (timing, run, summary lines).

    ``add`` takes one layer's routing for one token; ``timing`` the layer's times (v2 only). Use as
    a context manager, or call ``close``. Not thread-safe: one writer.
    """

    def __init__(
        self,
        path: str | os.PathLike[str] | TextIO,
        *,
        model: str,
        arch: str,
        n_layer: int,
        n_expert: int,
        n_expert_used: int,
        expert_bytes: Mapping[int, int],
        dense_bytes: Mapping[int, int] | None = None,
        version: int = 1,
        run: Mapping[str, object] | None = None,
    ) -> None:
        if version not in (1, 2):
            raise ValueError(f"route_trace version must be 1 or 2, got {version}")
        if run and version < 2:
            raise ValueError("a '# run' line needs route_trace v2")
        for label, value in (("model", model), ("arch", arch)):
            if not value or any(c.isspace() for c in value):
                raise ValueError(f"{label} must be a non-empty word, got {value!r}")
        self.version = version
        self._owns = not hasattr(path, "write")
        if self._owns:
            self._f: TextIO = open(path, "w", encoding="utf-8", newline="\n")  # type: ignore[arg-type]
        else:
            self._f = path  # type: ignore[assignment]
        dense = dense_bytes or {}
        head = [
            HEADER_V2 if version == 2 else HEADER_V1,
            f"# model={model} arch={arch} n_layer={n_layer} n_expert={n_expert}"
            f" n_expert_used={n_expert_used}",
        ]
        head += [
            f"# layer={il} expert_bytes={expert_bytes[il]} dense_bytes={dense.get(il, 0)}"
            for il in sorted(expert_bytes)
        ]
        if run:
            head.append("# run " + _kv(run))
        head.append(",".join(COLUMNS))
        self._f.write("\n".join(head) + "\n")
        self._expert_bytes = dict(expert_bytes)
        self.rows = 0

    def add(
        self,
        turn: int,
        phase: int,
        step: int,
        layer: int,
        experts: Sequence[int],
        weights: Sequence[float],
        resident: Sequence[bool | int],
        bytes_read: Sequence[int] | None = None,
    ) -> None:
        """One layer's routing for one token. ``bytes_read`` defaults to 0 for a resident expert
        and the layer's expert bytes otherwise."""
        if not (len(experts) == len(weights) == len(resident)):
            raise ValueError("experts, weights and resident must have one value per slot")
        if bytes_read is None:
            eb = self._expert_bytes[layer]
            bytes_read = [0 if r else eb for r in resident]
        out = [
            f"{turn},{phase},{step},{layer},{slot},{int(e)},{float(w):.6g},{int(bool(r))},{int(b)}"
            for slot, (e, w, r, b) in enumerate(zip(experts, weights, resident, bytes_read))
        ]
        self._f.write("\n".join(out) + "\n")
        self.rows += len(out)

    def timing(self, turn: int, phase: int, step: int, layer: int, compute_us: float,
               read_us: float | None = None) -> None:
        """The layer's compute time (and optionally its read wait), after its rows (v2 only)."""
        if self.version < 2:
            raise ValueError("timing lines need route_trace v2")
        extra = "" if read_us is None else f" read_us={read_us:.1f}"
        self._f.write(
            f"# timing turn={turn} phase={phase} step={step} layer={layer}"
            f" compute_us={compute_us:.1f}{extra}\n"
        )

    def summary(self, **values: object) -> None:
        if self.version < 2:
            raise ValueError("a '# summary' line needs route_trace v2")
        self._f.write("# summary " + _kv(values) + "\n")

    def close(self) -> None:
        if self._owns and not self._f.closed:
            self._f.close()
        elif not self._owns:
            self._f.flush()

    def __enter__(self) -> TraceWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _kv(values: Mapping[str, object]) -> str:
    """``key=value`` words; whitespace inside a value becomes ``_`` so the line stays parseable."""
    parts = []
    for k, v in values.items():
        if not k or any(c.isspace() or c == "=" for c in k):
            raise ValueError(f"{k!r}: a key must be one word without '='")
        parts.append(f"{k}={'_'.join(str(v).split()) or '_'}")
    return " ".join(parts)


def default_trace_path() -> Path:
    """The shared trace: ``<repo>/../shared/traces/qwen3-30b-a3b.route.csv``."""
    repo = Path(__file__).resolve().parents[2]
    return repo.parent / "shared" / "traces" / "qwen3-30b-a3b.route.csv"
