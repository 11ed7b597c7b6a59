"""``GET /stats``: what the engine does, as one JSON object the page at ``/`` polls (Prometheus's
text at /metrics is for scrapers, not for a browser): the last generation's speed, cache hits
and bytes read per token, the cache budget and what the pressure guard did with it.

A figure that was not measured (a resident model reads no experts, no generation yet) is null,
never 0, as /metrics leaves it NaN.
"""

from __future__ import annotations

import math
from typing import Any

from bmoe.engine.session import Session

MIB = 1 << 20


def _mib(value: float | None) -> float | None:
    return None if value is None else round(value / MIB, 3)


def _num(value: float | None, digits: int = 3) -> float | None:
    return None if value is None or not math.isfinite(value) else round(value, digits)


def _last(s: Any) -> dict[str, Any] | None:
    if s is None:
        return None
    per_token = None if s.bytes_read is None or not s.generated_tokens else s.bytes_read / s.generated_tokens
    changes = s.budget_changes or []
    return {
        "prompt_tokens": s.prompt_tokens, "generated_tokens": s.generated_tokens,
        "tok_per_s": _num(s.tok_per_s), "prefill_s": _num(s.prefill_s), "decode_s": _num(s.decode_s),
        "cache_hit_pct": _num(s.cache_hit_pct, 1), "mib_read": _mib(s.bytes_read), "mib_read_per_token": _mib(per_token),
        "prefill": s.prefill_strategy, "budget_changes": len(changes),
        "last_budget_change": {k: changes[-1].get(k) for k in ("old", "new", "why")} if changes else None,
    }


def snapshot(session: Session | None, *, model: str | None, generating: bool, waiting: int,
             life_hit_pct: float | None, tokens: float, last: Any) -> dict[str, Any]:
    """``last``: the GenerationStats of the last generation that ended (the session's own
    ``last_stats`` is the running one's, its figures not filled in yet)."""
    if session is None or session.closed:
        return {"model": model, "open": False}
    guard = session.pressure_guard
    settings = guard.settings if guard is not None else None
    return {
        "model": model, "open": True, "mode": session.config.mode, "n_ctx": session.n_ctx,
        "generating": generating, "waiting": waiting, "tokens_generated": int(tokens),
        "cache_hit_pct_life": _num(life_hit_pct, 1),
        "cache": {"budget_mib": _mib(session.budget_bytes), "resident_mib": _mib(session.resident_cache_bytes),
                  "how": session.budget_how},
        "guard": None if guard is None else {
            "low_mib": _mib(settings.low), "high_mib": _mib(settings.high), "floor_mib": _mib(guard.floor),
            "ceiling_mib": _mib(guard.ceiling), "samples": guard.samples},
        "last": _last(last),
    }
