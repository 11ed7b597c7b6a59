"""The step scheduler: many generations in one context, one ``llama_decode`` per step.

With ``RunConfig(parallel=N)`` (or a draft mode) a session's generations no longer take turns: each
becomes a sequence of one llama.cpp context (``n_seq_max = N``, every sequence its own
``n_ctx / N`` cells), and one task on the session's loop, the step loop, owns the context:

- a **decode step** holds the next token of every decoding sequence (and, with drafts, each
  sequence's draft to verify), so each MoE layer's routing event is the union over the step's
  tokens and a missing expert is read once for every token routed to it; the cache policy still
  sees each token's routing;
- a **prompt step** holds one chunk of one waiting prompt (the prefill planner's chunks: one batch
  or expert-major, as a lone generation would run it). Prompt and decode steps alternate, so a
  long prompt delays the others' next token by one chunk, never by the whole prompt.

Requests join and leave at step boundaries (continuous batching). A new request takes the free
sequence slot whose cells share the longest prefix with its prompt (as llama-server's slots do)
and evaluates only the rest. Everything per request lives in its ``_Seq``: its sampler chain,
stop strings, logprobs, forced tokens, finish reason and usage. Sampling happens in the step loop
right after each step, so which sequences share which step depends only on when requests arrive,
never on how fast their consumers read: the schedule is reproducible, and streamed equals resident
for the same schedule. Whether a sequence's tokens are the same alone and in a batch is llama.cpp's
own property (``docs/scheduler.md`` has what this pin does).

A consumer that stops reading (``break``, a cancelled task, a client gone) marks its sequence
cancelled; it leaves at the next step boundary and the others never notice. ``Session.cancel`` and
``close`` end every sequence.
"""

from __future__ import annotations

import asyncio
import codecs
import time
from collections import deque
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

from bmoe.engine.config import RunConfig
from bmoe.engine.drafts import NgramDrafter
from bmoe.engine.pieces import Piece, Usage
from bmoe.engine.prefill import PrefillPlanner
from bmoe.engine.sampling import Sampler, SamplingParams, logprobs_of
from bmoe.engine.stops import StopStrings
from bmoe.errors import DecodeAbortedError, GenerationCancelled, SessionClosedError
from bmoe.llama.seam import LlamaModel, Step
from bmoe.metrics.stats import GenerationStats
from bmoe.pipeline.events import PHASE_DECODE, PHASE_PREFILL


class StepHost(Protocol):
    """What the step loop uses of its session (``bmoe.engine.session.Session``, which makes the
    scheduler and imports this module, never the reverse): the model and its callback, the
    measured decode, the prompt planner, the per-generation figures, and the session's state."""

    config: RunConfig
    _model: LlamaModel
    _callback: Any  # a bmoe.llama.callback.EvalCallback: its gate and expert-major
    _streaming: Any  # a bmoe.engine.streaming.Streamer, or None when resident
    _watch: Any  # a bmoe.io.watch.FileWatch, or None
    _planner: PrefillPlanner  # how a prompt runs: its chunks, one batch or expert-major
    last_stats: GenerationStats | None
    last_usage: Usage | None

    @property
    def closed(self) -> bool: ...

    async def _measured_step(self, step: Step, n: int, phase: int) -> Any: ...

    @property
    def prefill_choice(self) -> Any: ...

    def _new_stats(self, prompt_tokens: int) -> GenerationStats: ...

    def _finish_stats(self, stats: GenerationStats, start: Any) -> None: ...

    def _counters(self) -> Any: ...

    def _token_metrics(self, index: int, token: int, m: Any, start: Any) -> Any: ...


@dataclass
class Slot:
    """One sequence id of the context and the tokens its cells hold (what a prompt may reuse)."""

    seq_id: int
    kv: list[int] = field(default_factory=list)
    last_used: int = -1  # the step loop's admission count when a request last took it


@dataclass
class StepFigures:
    """What the step loop did, for a server's metrics and a benchmark's decomposition."""

    decode_steps: int = 0
    prompt_steps: int = 0
    decode_tokens: int = 0  # tokens that went through decode steps (drafts included)
    emitted_tokens: int = 0  # tokens handed to the sequences (what drafts add counts here)
    batch_sizes: list[int] = field(default_factory=list)  # sequences per decode step (last 4096)
    batch_counts: dict[int, int] = field(default_factory=dict)  # sequences per decode step -> steps, ever
    decode_wall_s: float = 0.0
    prompt_wall_s: float = 0.0
    # Streamed runs: expert bytes read and time the compute thread waited for reads, decode steps
    # only (None when resident: nothing is read).
    decode_bytes_read: int | None = None
    decode_wait_s: float | None = None

    def note_decode(self, n_seqs: int, n_tokens: int, emitted: int, wall_s: float, delta=None) -> None:  # noqa: ANN001
        """One decode step; ``delta``: the pipeline counters' change over it (streamed)."""
        if delta is not None:
            self.decode_bytes_read = (self.decode_bytes_read or 0) + delta.bytes_read
            self.decode_wait_s = (self.decode_wait_s or 0.0) + delta.blocked_s
        self.decode_steps += 1
        self.decode_tokens += n_tokens
        self.emitted_tokens += emitted
        self.decode_wall_s += wall_s
        self.batch_sizes.append(n_seqs)
        self.batch_counts[n_seqs] = self.batch_counts.get(n_seqs, 0) + 1
        if len(self.batch_sizes) > 4096:
            del self.batch_sizes[:2048]


class _Seq:
    """One generation inside the scheduler: its request, its sampler and its progress."""

    def __init__(self, sched: Scheduler, prompt: list[int], max_tokens: int, sampling: SamplingParams,
                 stops: StopStrings, stop_at_end: bool, forced: list[int] | None, reuse: bool) -> None:
        host = sched.host
        model = host._model
        self.sched = sched
        self.prompt = prompt
        self.max_tokens = max_tokens
        self.sampling = sampling
        self.stops = stops
        self.stop_at_end = stop_at_end
        self.forced = forced
        self.reuse = reuse  # may start from a slot's cells that hold its prompt's beginning
        self.sampler = Sampler(model.vocab, model.n_vocab, sampling, prompt)
        self.queue: asyncio.Queue[object] = asyncio.Queue()
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.context = list(prompt)  # prompt + emitted tokens: what drafts are looked up in
        self.slot: Slot | None = None
        self.batches: Iterator[list[int]] | None = None  # prompt chunks still to evaluate
        self.todo = 0  # prompt tokens still to evaluate
        self.last: int | None = None  # the token drawn last, not yet in the cells
        self.reused = 0
        self.i = 0
        self.completion = 0
        self.done = False
        self.cancelled = False
        self.stats = host._new_stats(len(prompt))
        self.arrived = time.monotonic()
        self.start = None  # pipeline counters when it joined
        drafts = host.config.draft == "ngram" and forced is None
        self.drafter = NgramDrafter(host.config.draft_max) if drafts else None

    # --- the step loop's side ----------------------------------------------------------------

    def take(self, logits, m) -> int | None:  # noqa: ANN001 - numpy logits, the step's measure
        """Draw from ``logits`` and hand the piece over: the token kept, or None once finished."""
        host = self.sched.host
        model = host._model
        token = self.sampler.sample(logits) if self.forced is None else self.forced[self.i]
        if self.stop_at_end and model.is_end(token):
            self.end("stop")
            return None
        self.sampler.accept(token)
        self.completion += 1
        self.stats.generated_tokens += 1
        lp = logprobs_of(logits, token, self.sampling.logprobs) if self.sampling.logprobs is not None else None
        metrics = host._token_metrics(self.i, token, m, self.start)
        self.i += 1
        text = self.stops.feed(self.decoder.decode(model.piece(token), final=self.i == self.max_tokens))
        if self.stops.hit is None and self.i < self.max_tokens:
            self.queue.put_nowait(Piece(token, text, metrics, lp))
            self.context.append(token)
            return token
        finish = "stop" if self.stops.hit is not None else "length"
        self.queue.put_nowait(Piece(token, text + self.stops.flush(), metrics, lp, finish, self._usage()))
        self._close()
        return None

    def end(self, finish: str) -> None:
        """Finish with no token to carry the end (end of generation, cancelled): one last piece."""
        if self.done:
            return
        tail = self.stops.feed(self.decoder.decode(b"", final=True)) + self.stops.flush()
        self.queue.put_nowait(Piece(None, tail, finish_reason=finish, usage=self._usage()))
        self._close()

    def fail(self, exc: BaseException) -> None:
        if self.done:
            return
        self.queue.put_nowait(exc)
        self._close()

    def _usage(self) -> Usage:
        usage = Usage(len(self.prompt), self.completion, len(self.prompt) - self.reused)
        self.sched.host.last_usage = usage
        return usage

    def _close(self) -> None:
        self.done = True
        self.sampler.close()
        if self.batches is not None:  # a prompt left part-way: the planner's iterator ends
            self.batches.close()  # type: ignore[attr-defined]
            self.batches = None
        host = self.sched.host
        if self.drafter is not None:
            self.stats.draft_tokens = self.drafter.stats.drafted
            self.stats.draft_accepted = self.drafter.stats.accepted
        host._finish_stats(self.stats, self.start)
        host.last_stats = self.stats
        self.sched._release(self)


class Scheduler:
    """The step loop of one session (made by the session when ``RunConfig.stepped``)."""

    def __init__(self, host: StepHost) -> None:
        self.host = host
        model = host._model
        self.slots = [Slot(i) for i in range(model.n_seq_max)]
        self._free: list[Slot] = list(self.slots)
        self._waiting: deque[_Seq] = deque()
        self._active: list[_Seq] = []
        self._task: asyncio.Task[None] | None = None
        self._steps = 0
        self._admitted = 0
        self._in_step: list[_Seq] = []
        self.figures = StepFigures()

    @property
    def busy(self) -> bool:
        """A sequence is waiting or running."""
        return bool(self._waiting or self._active)

    def slot_view(self) -> list[dict[str, object]]:
        """Each sequence slot: what it does now (``/slots``)."""
        out = []
        for slot in self.slots:
            seq = next((s for s in self._active if s.slot is slot), None)
            state = "idle" if seq is None else ("prompt" if seq.todo else "decode")
            out.append({
                "id": slot.seq_id, "state": state, "n_cached": len(slot.kv),
                "n_prompt": len(seq.prompt) if seq else None, "n_decoded": seq.completion if seq else None,
            })
        return out

    async def stream(self, prompt: list[int], max_tokens: int, sampling: SamplingParams, stops: StopStrings,
                     stop_at_end: bool, forced: list[int] | None, reuse: bool = True) -> AsyncIterator[Piece]:
        """One generation's pieces, decoded in steps shared with every other sequence."""
        seq = _Seq(self, prompt, max_tokens, sampling, stops, stop_at_end, forced, reuse)
        self._waiting.append(seq)
        self._wake()
        try:
            while True:
                item = await seq.queue.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finish_reason is not None:  # type: ignore[attr-defined]
                    return
        finally:
            if not seq.done:
                seq.cancelled = True  # leaves at the next step boundary
                if seq in self._waiting:
                    self._waiting.remove(seq)
                    seq.sampler.close()
                    seq.done = True

    def cancel_all(self) -> None:
        """End every sequence (``Session.cancel``): a step in flight is aborted."""
        for seq in (*self._waiting, *self._active):
            seq.cancelled = True
        if self._in_step:
            self.host._callback.gate.abort(GenerationCancelled("generation cancelled"))

    def on_new_loop(self) -> None:
        """The session moved to a new event loop (the old one closed): nothing of the old runs."""
        for seq in (*self._waiting, *self._active):
            seq.done = True
            seq.sampler.close()
        self._waiting.clear()
        self._active.clear()
        self._free = [s for s in self.slots]
        self._task = None

    def _wake(self) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run(), name="bmoe-step-loop")

    def _release(self, seq: _Seq) -> None:
        if seq in self._active:
            self._active.remove(seq)
        if seq.slot is not None:
            self._free.append(seq.slot)
            self._free.sort(key=lambda s: s.seq_id)
            seq.slot = None

    # --- the loop ------------------------------------------------------------------------------

    async def _run(self) -> None:
        host = self.host
        streaming = host._streaming
        if streaming:
            streaming.pause_pool()  # generations run: the warm pool stays out of their way
        prompt_turn = True
        try:
            while True:
                self._admit()
                for seq in [s for s in self._active if s.cancelled or host.closed]:
                    seq.end("cancelled")
                if not self._active:
                    break
                prompting = next((s for s in self._active if s.todo), None)
                decoding = [s for s in self._active if s.last is not None]
                if prompting is not None and (prompt_turn or not decoding):
                    await self._guarded(self._prompt_step, prompting, [prompting])
                elif decoding:
                    await self._guarded(self._decode_step, decoding, decoding)
                prompt_turn = not prompt_turn
        except asyncio.CancelledError:  # the loop is shutting down: every sequence ends
            for seq in (*self._active, *self._waiting):
                seq.end("cancelled")
            self._waiting.clear()
            raise
        except Exception as exc:  # noqa: BLE001 - a step's failure is every running sequence's
            for seq in (*self._active, *self._waiting):
                seq.fail(exc)
            self._waiting.clear()
            for slot in self.slots:  # what the failed step left in the cells is unknown
                if not host.closed:
                    host._model.seq_clear(slot.seq_id)
                slot.kv = []
        finally:
            if streaming and not host.closed:
                streaming.resume_pool()

    def _admit(self) -> None:
        """Waiting requests take free slots: the one whose cells share the longest prefix."""
        model = self.host._model
        while self._waiting and self._free:
            seq = self._waiting.popleft()
            if seq.cancelled or seq.done:
                continue
            slot = self._pick(seq.prompt)
            self._free.remove(slot)
            self._admitted += 1
            slot.last_used = self._admitted
            reused = min(_common(slot.kv, seq.prompt), len(seq.prompt) - 1) if seq.reuse else 0
            if reused == 0 or not model.seq_keep_prefix(slot.seq_id, reused):
                model.seq_clear(slot.seq_id)
                reused = 0
            slot.kv = slot.kv[:reused]
            seq.slot, seq.reused = slot, reused
            seq.todo = len(seq.prompt) - reused
            seq.batches = self.host._planner.plan(seq.prompt[reused:], self.host.last_stats)
            choice = self.host.prefill_choice
            if choice is not None:
                seq.stats.prefill_strategy, seq.stats.prefill_reason = choice.strategy, choice.reason
            seq.start = self.host._counters()
            seq.stats.queue_s = time.monotonic() - seq.arrived
            self._active.append(seq)

    def _pick(self, prompt: list[int]) -> Slot:
        """The free slot whose cells share the most of ``prompt`` when that is at least half of it
        (llama-server's slot similarity), else the least recently used: a prompt that shares only
        its first token would otherwise evict a slot another prompt could reuse whole."""
        best = max(self._free, key=lambda s: (_common(s.kv, prompt), -s.last_used))
        if _common(best.kv, prompt) * 2 >= len(prompt):
            return best
        return min(self._free, key=lambda s: (s.last_used, s.seq_id))

    async def _guarded(self, fn, arg, members: list[_Seq]) -> None:  # noqa: ANN001
        """One step; an abort ends its sequences (cancelled, or with the error), not the loop, and
        their cells are cut back to what was evaluated before the step."""
        starts = {id(s): (s.slot, len(s.slot.kv)) for s in members if s.slot is not None}
        self._in_step = members
        try:
            await fn(arg)
        except (DecodeAbortedError, SessionClosedError) as exc:
            for seq in members:
                slot, n = starts.get(id(seq), (None, 0))
                if slot is not None and not self.host.closed:
                    self._cut(slot, n)
                if seq.cancelled or self.host.closed or isinstance(exc, GenerationCancelled):
                    seq.end("cancelled")
                else:
                    seq.fail(exc)
        finally:
            self._in_step = []

    def _cut(self, slot: Slot, n: int) -> None:
        """Keep a slot's first ``n`` cells (all of them gone where the memory cannot keep part)."""
        model = self.host._model
        if n < len(slot.kv) and not model.seq_drop_tail(slot.seq_id, n):
            model.seq_clear(slot.seq_id)
            n = 0
        del slot.kv[n:]

    def _take(self, seq: _Seq, logits, m) -> int | None:  # noqa: ANN001
        """``seq.take``, with a failure of this sequence's own (a grammar that allows no token)
        ending this sequence only."""
        try:
            return seq.take(logits, m)
        except Exception as exc:  # noqa: BLE001 - the sequence's own error, raised to its consumer
            seq.fail(exc)
            return None

    async def _prompt_step(self, seq: _Seq) -> None:
        """The next chunk of one prompt; after its last, the sequence's first token is drawn."""
        assert seq.slot is not None and seq.batches is not None
        chunk = next(seq.batches)
        n0 = len(seq.slot.kv)
        step = Step(tuple(chunk), tuple(range(n0, n0 + len(chunk))), (seq.slot.seq_id,) * len(chunk),
                    (False,) * (len(chunk) - 1) + (True,))
        m = await self._measured(step, PHASE_PREFILL)
        seq.slot.kv.extend(chunk)
        seq.todo -= len(chunk)
        seq.stats.prefill_s += m.wall_s
        self.figures.prompt_steps += 1
        self.figures.prompt_wall_s += m.wall_s
        if seq.todo > 0:
            return
        for _ in seq.batches:  # finish the planner's iterator: it records the prompt it ran
            raise AssertionError("the prefill planner gave more tokens than the prompt has")
        seq.batches = None
        self._watch()
        seq.last = self._take(seq, self.host._model.logits_at(len(chunk) - 1), m)

    async def _decode_step(self, seqs: list[_Seq]) -> None:
        """The next token of every decoding sequence (with its draft to verify), in one step."""
        model = self.host._model
        tokens: list[int] = []
        pos: list[int] = []
        seq_ids: list[int] = []
        drafts: list[list[int]] = []
        room = model.n_batch - len(seqs)  # draft tokens this step can still hold
        for seq in seqs:
            assert seq.slot is not None and seq.last is not None
            draft: list[int] = []
            if seq.drafter is not None and room > 0:
                # Never past max_tokens nor the sequence's cells: the draft's last position must fit.
                limit = min(seq.max_tokens - seq.i - 1, model.n_ctx_seq - len(seq.slot.kv) - 1, room)
                draft = seq.drafter.propose(seq.context, limit)
                room -= len(draft)
            n0 = len(seq.slot.kv)
            run = [seq.last, *draft]
            tokens += run
            pos += range(n0, n0 + len(run))
            seq_ids += [seq.slot.seq_id] * len(run)
            drafts.append(draft)
        step = Step(tuple(tokens), tuple(pos), tuple(seq_ids), (True,) * len(tokens))
        em = self.host._callback.expert_major
        held = em.enabled if em is not None else False
        if em is not None:
            em.enabled = False  # a prompt's expert-major run pauses while a decode step runs
        try:
            m = await self._measured(step, PHASE_DECODE)
        finally:
            if em is not None:
                em.enabled = held
        self._watch()
        index = 0
        emitted = 0
        for seq, draft in zip(seqs, drafts):
            slot = seq.slot
            assert slot is not None
            seq.stats.decode_s += m.wall_s
            seq.stats.decode_steps += 1
            run = [seq.last, *draft]
            before = seq.completion
            accepted = 0  # draft tokens the draws confirmed, in order
            token = None
            for j in range(len(run)):
                if seq.cancelled or seq.done:
                    break
                token = self._take(seq, model.logits_at(index + j), m)
                if token is None or j == len(draft) or token != draft[j]:
                    break
                accepted += 1
            emitted += seq.completion - before
            if seq.drafter is not None:
                seq.drafter.verified(len(draft), accepted)
            n0 = len(slot.kv)
            slot.kv.extend(run)  # the step wrote a cell for every input of the run
            self._cut(slot, n0 + accepted + 1)  # the inputs after the first wrong draft token go
            seq.last = None if seq.done else token
            index += len(run)
        self.figures.note_decode(len(seqs), len(tokens), emitted, m.wall_s, m.delta)

    async def _measured(self, step: Step, phase: int):  # noqa: ANN202 - a session._Measure
        if self.host.closed:
            raise SessionClosedError("the session is closed")
        m = await self.host._measured_step(step, self._steps, phase)
        self._steps += 1
        return m

    def _watch(self) -> None:
        watch = self.host._watch
        if watch is not None:
            watch.check()  # the weights just used are the file's, as loaded


def _common(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


__all__ = ["Scheduler", "Slot", "StepFigures"]
