"""One generation for run and demo, with its metric sinks, and the summary line run, demo and
chat print: kept apart from the commands so the sinks' writers are owned (and drained) in one
place, whatever stops the generation."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

from bmoe.engine.config import MiB, RunConfig


async def _generate(model: Path, config: RunConfig, prompt: str, n: int, *, echo: bool,
                    progress: bool = False, csv_path: Path | None = None, sampling=None,  # noqa: ANN001
                    stop: list[str] | None = None, quiet: bool = False, partial: dict | None = None) -> dict:
    """Generate and return the run's figures; ``partial`` (if given) receives them too, also when a
    signal or an error ends the run early, for a caller that must still report what was made."""
    from bmoe.engine.lossy import lossy_label
    from bmoe.engine.session import Session
    from bmoe.metrics.sinks import CsvSink, ProgressSink
    from bmoe.metrics.tokens import peak_rss_bytes

    with Session.open(model, config) as session:
        for warning in () if quiet else session.warnings:
            print(f"bmoe: warning: {warning}", file=sys.stderr)
        sinks: list = []
        if progress:
            sinks.append(ProgressSink(None))
        if csv_path is not None:
            sinks.append(CsvSink(csv_path, config.as_dict() | {"budget_how": session.budget_how}, str(model)))
        bar = _token_bar(n) if echo and not progress and not sys.stdout.isatty() and sys.stderr.isatty() else None
        tokens: list[int] = []
        parts: list[str] = []
        # The writers are owned here, not by a task group: a signal or an error cancels the
        # generation, and the lines queued so far (and the summary) must still reach the files.
        writers = [asyncio.ensure_future(sink.run()) for sink in sinks]
        result: dict = {}
        finish = usage = None
        try:
            # Control-token text in the prompt becomes its token, as llama-cli and llama-cpp-python read it.
            async for piece in session.stream(prompt, n, sampling=sampling, stop=stop, special=True):
                if piece.finish_reason is not None:
                    finish, usage = piece.finish_reason, piece.usage
                if piece.token is not None:
                    tokens.append(piece.token)
                parts.append(piece.text)
                if piece.metrics is not None:
                    for sink in sinks:
                        sink.add(piece.metrics)
                if echo:
                    sys.stdout.write(piece.text)
                    sys.stdout.flush()
                if bar is not None:
                    bar.update(1)
        finally:
            if bar is not None:
                bar.close()
            stats = session.last_stats
            result = {
                "text": "".join(parts),
                "tokens": tokens,
                "n_tokens": len(tokens),
                "finish_reason": finish,
                "prompt_tokens_evaluated": usage.prompt_evaluated if usage is not None else None,
                "io_fallback_reason": session.io_fallback_reason,
                "budget_how": session.budget_how,
                "open_reason": session.open_reason,
                **lossy_label(config),
                **session.lossy_counters(),
                **(stats.as_dict() if stats is not None else {}),
                "peak_rss_bytes": peak_rss_bytes(),
            }
            if partial is not None:
                partial.update(result)
            for sink in sinks:
                if isinstance(sink, CsvSink):
                    sink.summary({k: v for k, v in result.items() if k not in ("text", "tokens")})
                sink.close()
            await _drain(writers)
        return result


async def _drain(writers: list[asyncio.Future]) -> None:
    """Wait for the sink writers to write what was queued, even while being cancelled; a write
    error (a full disk) is raised once they have all stopped."""
    if not writers:
        return
    done = asyncio.gather(*writers, return_exceptions=True)
    cancelled = False
    while not done.done():
        try:
            await asyncio.shield(done)
        except asyncio.CancelledError:
            cancelled = True
    errors = [r for r in done.result() if isinstance(r, BaseException)]
    if errors:
        raise errors[0]
    if cancelled:
        raise asyncio.CancelledError


def _token_bar(total: int):  # noqa: ANN202 - a tqdm bar for long runs whose text goes to a file
    from tqdm import tqdm

    return tqdm(total=total, unit="tok", desc="generating", file=sys.stderr)


def _summary(r: dict) -> str:
    from bmoe.pipeline.budget import mib_text

    def num(v: float | None, fmt: str) -> str:
        return "unmeasured" if v is None else format(v, fmt)

    lossy = f" LOSSY {r['lossy_flags']}" if r.get("lossy") else ""
    line = f"[{r['mode']}{lossy}] {r['n_tokens']} tokens, {num(r['tok_per_s'], '.2f')} tok/s"
    if r["mode"] == "stream":
        line += (
            f", experts read {r['experts_read']}, {r['bytes_read'] / MiB:.1f} MiB read"
            f", read {num(r['read_mib_per_s'], '.0f')} MiB/s ({r['io_mode']})"
            f", cache {mib_text(r['budget_bytes'])} MiB hit {num(r['cache_hit_pct'], '.1f')}%"
        )
        if r.get("drop_dropped_experts"):  # dropped misses leave the count: the rate is not the cache's alone
            line += f" of the experts not dropped ({r['drop_dropped_experts']} dropped)"
    if r.get("draft_tokens") is not None:
        kept = r["draft_accepted"] or 0
        line += (f", drafts {kept}/{r['draft_tokens']} tokens kept"
                 f" ({100.0 * kept / r['draft_tokens']:.0f}%)" if r["draft_tokens"] else ", drafts: nothing to copy")
    return line
