"""The bench's child process: one configuration measured in a process of its own
(``python -m bmoe.bench.child SPEC.json RESULT.json``, started by ``bmoe.bench.side``).

A ``bmoe`` side opens a Session with the spec's RunConfig: a warm-up, the measured generation
(or the squeezed one: a second balloon started halfway), then the time to first token of the
``--ttft`` prompts, warm, cold (a fresh session each, the file dropped from the page cache) and
without the prompt's read-ahead. An ``mmap`` side is stock llama-cpp-python with greedy argmax.
The result is written whole or not at all (a temporary renamed over), also at checkpoints after
the measured generation, so a timeout in the prompts after it keeps what was measured."""

from __future__ import annotations

import dataclasses
import json
import resource
import sys
import time
from collections.abc import Callable
from contextlib import aclosing
from pathlib import Path
from typing import Any

from bmoe.bench.options import SQUEEZE_TOKENS_CAP
from bmoe.engine.aio import run as run_async
from bmoe.errors import BmoeError
from bmoe.io.pagecache import read_io_bytes
from bmoe.io.paths import replace_with_text
from bmoe.metrics.tokens import peak_rss_bytes

TTFT_TEXT = "the experts of this layer stream from the disk while the next token waits for them "


def _delta(a: int | None, b: int | None) -> int | None:
    return None if a is None or b is None else b - a


async def _bmoe_child(spec: dict[str, Any], checkpoint: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
    from bmoe.engine.config import RunConfig
    from bmoe.engine.session import Session

    config = RunConfig(**spec["config"])
    t0 = time.perf_counter()
    with Session.open(spec["model"], config) as s:
        open_s = time.perf_counter() - t0
        warm = None
        if spec["warmup"] == "same":
            warm = await s.generate(spec["prompt"], spec["tokens"], stop_at_end=False)
        elif spec["warmup_tokens"] > 0:
            warm = await s.generate(spec["warmup_prompt"], spec["warmup_tokens"], stop_at_end=False)
        io0, faults0 = read_io_bytes(), resource.getrusage(resource.RUSAGE_SELF).ru_majflt
        squeeze = None
        if spec.get("squeeze_bytes"):
            tokens, squeeze = await squeezed_generation(s, spec)
            stats = s.last_stats
        else:
            g = await s.generate(spec["prompt"], spec["tokens"], stop_at_end=False)
            tokens, stats = g.tokens, g.stats
        io1, faults1 = read_io_bytes(), resource.getrusage(resource.RUSAGE_SELF).ru_majflt
        assert stats is not None
        out = {
            "tokens": tokens, "stats": stats.as_dict(), "open_s": open_s,
            "open_mode": s.open_mode, "open_reason": s.open_reason, "io_mode": s.io_mode,
            "io_fallback_reason": s.io_fallback_reason, "warnings": s.warnings, "budget_how": s.budget_how,
            "warmup_stats": warm.stats.as_dict() if warm is not None and warm.stats is not None else None,
            "disk_read_bytes": _delta(io0, io1), "major_faults": faults1 - faults0,
            "ttft_s": None, "ttft_detail": None, "ttft_cold_s": None, "ttft_cold_detail": None,
            "squeeze": squeeze, "map_count": _map_count(),
        }
        lengths = spec.get("ttft_lengths") or ()
        if lengths:  # a timeout in the prompts below keeps the measured generation
            checkpoint(out | {"partial": "during the time-to-first-token prompts: those are missing",
                              "peak_rss_bytes": peak_rss_bytes()})
        out["ttft_s"], out["ttft_detail"] = await _ttft(s, lengths)
    if lengths:  # cold: a fresh session per prompt (empty cache), the file dropped from the page cache
        checkpoint(out | {"partial": "during the cold time-to-first-token prompts: those are missing",
                          "peak_rss_bytes": peak_rss_bytes()})
        out["ttft_cold_s"], out["ttft_cold_detail"] = await _ttft_cold(spec, config, lengths)
    if lengths and config.predicts_prompts:
        # The same prompts with the prompt's read-ahead off, side by side: its reads and compute
        # run in turn, so wall less wait is the compute the floors take (with read-ahead on, the
        # wall less the wait also holds the reads the compute hid).
        serial = dataclasses.replace(config, predict_prompt=False)
        checkpoint(out | {"partial": "during the prompts without read-ahead: those are missing",
                          "peak_rss_bytes": peak_rss_bytes()})
        out["ttft_no_predict_s"], out["ttft_no_predict_detail"] = await _ttft_replayed(spec, serial, lengths)
        out["ttft_cold_no_predict_s"], out["ttft_cold_no_predict_detail"] = await _ttft_cold(spec, serial, lengths)
    return out


async def _ttft_replayed(spec: dict[str, Any], config: Any, lengths: Any) -> tuple[Any, Any]:
    """The warm prompts again in a fresh session of ``config`` with the same history as the
    measured run's (its warm-up, then its measured generation), so the cache starts alike."""
    from bmoe.engine.session import Session

    with Session.open(spec["model"], config) as s:
        if spec["warmup_tokens"] > 0:
            await s.generate(spec["warmup_prompt"], spec["warmup_tokens"], stop_at_end=False)
        await s.generate(spec["prompt"], spec["tokens"], stop_at_end=False)
        return await _ttft(s, lengths)


def _map_count() -> int | None:
    """Memory mappings this process holds (page moves split them; the kernel caps them)."""
    try:
        with open("/proc/self/maps") as f:
            return sum(1 for _ in f)
    except OSError:
        return None


async def _ttft(s: Any, lengths: Any) -> tuple[dict[str, float] | None, dict[str, dict[str, Any]] | None]:
    """Prefill seconds of prompts of about each length in tokens, keyed by their exact length (one
    generated token each, one after another: the cache warm from what ran before); and per length
    what the prefill read and waited for, which its physical floor is computed from."""
    if not lengths:
        return None, None
    out: dict[str, float] = {}
    detail: dict[str, dict[str, Any]] = {}
    for n in lengths:
        _first_token(await s.generate(_prompt_of(s, n), 1, stop_at_end=False), out, detail)
    return out, detail


async def _ttft_cold(spec: dict[str, Any], config: Any, lengths: Any) -> tuple[dict[str, float], dict[str, dict[str, Any]]]:
    """The same prompts, each the first of a fresh session (an empty cache) opened after the file
    was dropped from the page cache: a user's first request. The open is not counted."""
    from bmoe.engine.session import Session
    from bmoe.io.pagecache import evict_file_cache

    out: dict[str, float] = {}
    detail: dict[str, dict[str, Any]] = {}
    for n in lengths:
        evict_file_cache([spec["model"]])
        with Session.open(spec["model"], config) as s:
            _first_token(await s.generate(_prompt_of(s, n), 1, stop_at_end=False), out, detail)
    return out, detail


def _prompt_of(s: Any, n: int) -> str:
    """The longest start of the TTFT text that is at most ``n`` tokens."""
    text = TTFT_TEXT * (1 + n // 4)
    lo, hi = 1, len(text)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if len(s.tokenize(text[:mid])) <= n:
            lo = mid
        else:
            hi = mid - 1
    return text[:lo]


def _first_token(g: Any, out: dict[str, float], detail: dict[str, dict[str, Any]]) -> None:
    assert g.stats is not None
    key = str(g.stats.prompt_tokens)
    out[key] = g.stats.prefill_s
    detail[key] = {"prefill_s": g.stats.prefill_s, "bytes_read": g.stats.bytes_read,
                   "blocked_s": g.stats.blocked_s, "hit_pct": g.stats.cache_hit_pct,
                   "recycled_bytes": g.stats.recycled_bytes}


async def squeezed_generation(s: Any, spec: dict[str, Any], balloon: Any = None) -> tuple[list[int], dict[str, Any]]:
    """The measured generation with a second balloon started halfway: decode tok/s over the tokens
    before it started and over as many after it held all its memory (the generation runs on, up to
    four times --tokens, until there are that many), and the budget at each point. ``balloon``: a
    not yet started one (a test's stand-in); by default one of the spec's size, locked if allowed."""
    from bmoe.bench.balloon import Balloon, has_cap_ipc_lock

    n = spec["tokens"]
    half = max(2, n // 2)
    cap = SQUEEZE_TOKENS_CAP * n
    if balloon is None:
        balloon = Balloon(spec["squeeze_bytes"], lock=has_cap_ipc_lock())
    walls: list[float] = []
    tokens: list[int] = []
    started_at = held_at = None
    budget_before = budget_after_hold = None
    try:
        # Closed on the break below, so the generation's stats are final (budget at the end, changes,
        # reads, hits) before they are read: a generator left open finishes them only when collected.
        async with aclosing(s.stream(spec["prompt"], cap, stop_at_end=False)) as pieces:
            async for piece in pieces:
                if piece.token is None:
                    continue
                tokens.append(piece.token)
                if piece.metrics is not None:
                    walls.append(piece.metrics.wall_ms / 1e3)
                if started_at is not None and held_at is None and balloon.ready_nowait():
                    held_at, budget_after_hold = len(tokens), s.budget_bytes
                if len(tokens) == half:
                    budget_before = s.budget_bytes
                    balloon.start()
                    started_at = len(tokens)
                if held_at is not None and len(tokens) - held_at >= max(2, half - 1):
                    break
    finally:
        inflate_s = balloon.inflate_s
        balloon.release()
    n = len(tokens)

    def rate(first: int, last: int) -> float | None:
        """Decode tok/s of tokens [first, last) (index 0 is the prompt's: not decode)."""
        span = walls[max(first, 1):last]
        return len(span) / sum(span) if len(span) >= 1 and sum(span) > 0 else None

    after_from = held_at if held_at is not None else started_at
    stats = s.last_stats
    return tokens, {
        "tok_per_s_before": rate(1, half), "tok_per_s_after": rate(after_from or n, n),
        "budget_bytes_before": budget_before,
        "budget_bytes_after": stats.budget_bytes_end if stats is not None else None,
        "budget_bytes_when_held": budget_after_hold,
        "budget_changes": stats.budget_changes if stats is not None else None,
        "squeeze_bytes": spec["squeeze_bytes"], "locked": balloon.lock, "started_after_token": started_at,
        "held_after_token": held_at, "inflate_s": inflate_s,
        "tokens": n,
        "how": ("decode tok/s: tokens over the summed wall time of their decode calls; before = tokens 2.."
                f"{half}, after = those after the balloon said it held all its memory"
                + ("" if held_at is not None else f" (it never did within {cap} tokens: after its start instead)")),
    }


def _mmap_child(spec: dict[str, Any]) -> dict[str, Any]:
    import llama_cpp
    import numpy as np

    t0 = time.perf_counter()
    llm = llama_cpp.Llama(model_path=spec["model"], n_ctx=spec["n_ctx"], n_threads=spec["n_threads"],
                          n_threads_batch=spec["n_threads"], verbose=False)
    open_s = time.perf_counter() - t0
    n_vocab = llm.n_vocab()

    def generate(prompt: str, n: int) -> dict[str, Any]:
        llm.reset()  # the next eval drops every KV position from 0 on
        tokens = llm.tokenize(prompt.encode("utf-8"), add_bos=True, special=False)
        t = time.perf_counter()
        llm.eval(tokens)
        prefill_s, decode_s, out = time.perf_counter() - t, 0.0, []
        for i in range(n):
            logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(n_vocab,))
            token = int(np.argmax(logits))
            out.append(token)
            if i + 1 == n:
                break
            t = time.perf_counter()
            llm.eval([token])
            decode_s += time.perf_counter() - t
        return {
            "tokens": out, "prompt_tokens": len(tokens), "generated_tokens": len(out),
            "prefill_s": prefill_s, "decode_s": decode_s,
            "tok_per_s": (len(out) - 1) / decode_s if len(out) > 1 and decode_s > 0 else None,
        }

    warm = None
    if spec["warmup_tokens"] > 0:
        warm = generate(spec["warmup_prompt"], spec["warmup_tokens"])
    io0, faults0 = read_io_bytes(), resource.getrusage(resource.RUSAGE_SELF).ru_majflt
    g = generate(spec["prompt"], spec["tokens"])
    io1, faults1 = read_io_bytes(), resource.getrusage(resource.RUSAGE_SELF).ru_majflt
    tokens = g.pop("tokens")
    if warm is not None:
        warm.pop("tokens")
    llm.close()
    return {
        "tokens": tokens, "stats": {"mode": "mmap", **g}, "open_s": open_s, "open_mode": "mmap (stock)",
        "warmup_stats": warm, "disk_read_bytes": _delta(io0, io1), "major_faults": faults1 - faults0,
    }


Checkpoint = Callable[[dict[str, Any]], None]

# How each kind of side measures, by ``Run.kind``: a new kind of side (one generation per step
# over many sequences, a drafted one) is a function here and runs of that kind in ``plan_runs``.
SIDES: dict[str, Callable[[dict[str, Any], Checkpoint], dict[str, Any]]] = {
    "bmoe": lambda spec, checkpoint: run_async(_bmoe_child(spec, checkpoint)),
    "mmap": lambda spec, _checkpoint: _mmap_child(spec),
}


def child_main(spec_path: str, result_path: str) -> int:
    from bmoe.bench.balloon import die_with_parent, offer_to_oom_killer

    die_with_parent()
    offer_to_oom_killer()
    spec = json.loads(Path(spec_path).read_text())
    try:
        out = SIDES[spec["kind"]](spec, lambda partial: _write_json(Path(result_path), partial))
        out["peak_rss_bytes"] = peak_rss_bytes()  # VmHWM: ru_maxrss would carry the parent's peak
        code = 0
    except BmoeError as e:
        out, code = {"error": f"{type(e).__name__}: {e}"}, 1
    except Exception as e:  # noqa: BLE001 - a child reports any failure as its row's error
        out, code = {"error": f"{type(e).__name__}: {e}"}, 1
    _write_json(Path(result_path), out)
    return code


def _write_json(path: Path, data: dict[str, Any]) -> None:
    """Whole or not at all: the parent may read the file the moment it kills a child that timed out."""
    replace_with_text(path, json.dumps(data))



if __name__ == "__main__":
    if len(sys.argv) == 3:
        sys.exit(child_main(sys.argv[1], sys.argv[2]))
    print("usage: python -m bmoe.bench.child SPEC.json RESULT.json (run by `bmoe bench`)", file=sys.stderr)
    sys.exit(2)
