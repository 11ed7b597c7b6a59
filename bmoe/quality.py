"""``bmoe quality``: what a lossy lever costs in quality, beside what it gains in speed, in one run.

The exact configuration and the lossy one (the same configuration plus the lever flags) are opened
side by side and take turns prompt by prompt, so both see the same machine load. For each prompt of
the shipped set (``quality_prompts.txt``) both continue greedily (timed; which goes first
alternates from prompt to prompt); the lossy run is then fed the exact run's tokens (teacher
forcing, untimed), so that at every position both answer the same context and their scores can be
compared (after an untimed warm-up of both on the first prompt):

- next-token agreement: the share of positions where the lossy run's greedy choice is the exact one;
- KL divergence KL(exact || lossy) of the two softmax distributions, per position (mean and max),
  in nats;
- tok/s of both, free-running: decode steps over their summed wall time, beside bytes read per
  token when streaming.

On a model with random weights (``bmoe synth``) these figures measure how far the lever perturbs
the computation, not how much real text quality it costs.

The command itself (its flags, from the engine's vocabulary) is ``bmoe.cli.quality``.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from importlib import resources
from pathlib import Path

import numpy as np

from bmoe.engine.config import RunConfig
from bmoe.engine.lossy import lossy_label
from bmoe.engine.session import Session
from bmoe.errors import BmoeError, ConfigError, ModelFileError

HOW = (
    "exact and lossy sessions open side by side, alternating per prompt (which runs first alternates "
    "too); tok/s = free-running greedy decode steps after the first token over their summed wall "
    "time, all prompts together; agreement = lossy argmax == exact token per position and "
    "KL(exact || lossy) in nats per position, the lossy run teacher-forced on the exact tokens"
)


def shipped_prompts() -> list[str]:
    return _prompt_lines(resources.files("bmoe").joinpath("quality_prompts.txt").read_text("utf-8"))


def _prompt_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.strip() and not line.startswith("#")]


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def kl_divergence(exact_logits: np.ndarray, lossy_logits: np.ndarray) -> np.ndarray:
    """KL(P || Q) per row, in nats, P and Q the softmax of each row of the two logit arrays."""
    lp, lq = log_softmax(exact_logits), log_softmax(lossy_logits)
    return np.maximum((np.exp(lp) * (lp - lq)).sum(axis=-1), 0.0)


@dataclass
class _Side:
    """One configuration's measurements over all prompts."""

    steps: int = 0  # decode steps after each prompt's first token
    decode_s: float = 0.0
    tokens: int = 0
    bytes_read: int | None = None

    def add(self, stats) -> None:  # noqa: ANN001 - a GenerationStats
        self.steps += stats.decode_steps
        self.decode_s += stats.decode_s
        self.tokens += stats.generated_tokens
        if stats.bytes_read is not None:
            self.bytes_read = (self.bytes_read or 0) + stats.bytes_read

    def as_dict(self) -> dict[str, object]:
        return {
            "tok_per_s": self.steps / self.decode_s if self.steps and self.decode_s > 0 else None,
            "bytes_read_per_token": self.bytes_read / self.tokens if self.bytes_read is not None and self.tokens else None,
        }


@dataclass
class QualityReport:
    model: str
    exact: RunConfig
    lossy: RunConfig
    tokens_per_prompt: int
    agree: list[bool] = field(default_factory=list)
    kl: list[float] = field(default_factory=list)
    prompts: int = 0
    exact_side: _Side = field(default_factory=_Side)
    lossy_side: _Side = field(default_factory=_Side)

    def as_dict(self) -> dict[str, object]:
        n = len(self.agree)
        label = lossy_label(self.lossy)
        return {
            "model": self.model, "how": HOW, **label,
            "prompts": self.prompts, "tokens_per_prompt": self.tokens_per_prompt, "positions": n,
            "agreement_pct": 100.0 * sum(self.agree) / n if n else None,
            "kl_mean": float(np.mean(self.kl)) if n else None,
            "kl_max": float(np.max(self.kl)) if n else None,
            "exact": {"mode": self.exact.mode, **lossy_label(self.exact), **self.exact_side.as_dict()},
            "lossy_run": {"mode": self.lossy.mode, **label, **self.lossy_side.as_dict()},
        }


async def _run_prompt(session: Session, prompt: str, n: int, forced: list[int] | None = None):  # noqa: ANN202
    """Greedy (or ``forced``): the tokens, the scores each was chosen from, the generation's stats."""
    tokens, logits = [], []
    async for piece in session.stream(prompt, n, stop_at_end=False, forced=forced):
        if piece.token is not None:
            tokens.append(piece.token)
            logits.append(session.logits().copy())
    assert session.last_stats is not None
    return tokens, np.stack(logits), session.last_stats


async def compare(model: Path, exact: RunConfig, lossy: RunConfig, prompts: list[str], n: int) -> QualityReport:
    """Measure ``lossy`` against ``exact`` on ``prompts``, ``n`` tokens each (see the module doc)."""
    if not prompts:
        raise ConfigError("the prompt set is empty")
    if n < 2:
        raise ConfigError(f"quality needs at least 2 tokens per prompt, got {n}")
    # Every prompt evaluated from its first token by both, in the same batches: a reused prefix, or
    # the ``auto`` prefill choosing its chunks from each session's own timings, would compute the
    # prompt in other batches than the exact run did, and the scores would differ in their last bits
    # (measured at full depth under a RAM limit: K = k gave KL 5e-5 with ``auto``). One batch it is,
    # unless a strategy was forced.
    pin = {"reuse_prompt": False, **({"prefill": "batch"} if exact.prefill == "auto" else {})}
    exact, lossy = replace(exact, **pin), replace(lossy, **pin)
    report = QualityReport(str(model), exact, lossy, n)
    with Session.open(model, exact) as s_exact, Session.open(model, lossy) as s_lossy:
        for session in (s_exact, s_lossy):  # untimed warm-up: the first prompt's bytes met once by both
            await _run_prompt(session, prompts[0], n)
        for i, prompt in enumerate(prompts):
            # Timed: both free-running, the first to run alternating, since whichever runs first
            # on a prompt meets its experts' bytes cold in every cache below ours (the device's,
            # a VM host's) and the second rereads many of the same slices.
            if i % 2:
                lossy_stats = (await _run_prompt(s_lossy, prompt, n))[2]
            tokens, exact_logits, exact_stats = await _run_prompt(s_exact, prompt, n)
            if not i % 2:
                lossy_stats = (await _run_prompt(s_lossy, prompt, n))[2]
            report.exact_side.add(exact_stats)
            report.lossy_side.add(lossy_stats)
            # Untimed: the lossy run forced along the exact tokens, for the scores.
            lossy_logits = (await _run_prompt(s_lossy, prompt, n, tokens))[1]
            _check_finite(exact_logits, "exact", i)
            _check_finite(lossy_logits, "lossy", i)
            report.agree += (lossy_logits.argmax(axis=-1) == np.asarray(tokens)).tolist()
            report.kl += kl_divergence(exact_logits, lossy_logits).tolist()
            report.prompts += 1
    return report


def _check_finite(logits: np.ndarray, side: str, prompt: int) -> None:
    """Scores with a NaN or an infinity come from a broken computation (bytes that were not the
    model's), not from a lever: they are an error, never averaged into a figure."""
    bad = np.flatnonzero(~np.isfinite(logits).all(axis=-1))
    if bad.size:
        raise BmoeError(
            f"the {side} run produced non-finite scores at prompt {prompt}, position {int(bad[0])} "
            f"({bad.size} of {len(logits)} positions): not a quality figure, a broken computation"
        )


def read_prompts(path: Path) -> list[str]:
    try:
        return _prompt_lines(path.read_text("utf-8"))
    except (OSError, UnicodeDecodeError) as e:
        raise ModelFileError(f"{path}: cannot read the prompts: {e}") from None


def table(r: dict) -> str:
    """The report as the command prints it (``as_dict``'s figures)."""
    def num(v: float | None, fmt: str) -> str:
        return "unmeasured" if v is None else format(v, fmt)

    e, lo = r["exact"], r["lossy_run"]
    return "\n".join([
        f"{r['model']}: {r['prompts']} prompt{'' if r['prompts'] == 1 else 's'} x {r['tokens_per_prompt']} tokens "
        f"({r['positions']} positions)",
        f"  exact                     {num(e['tok_per_s'], '8.2f')} tok/s",
        f"  LOSSY {r['lossy_flags']:<20}{num(lo['tok_per_s'], '8.2f')} tok/s   "
        f"agreement {num(r['agreement_pct'], '.1f')}%   KL mean {num(r['kl_mean'], '.4f')} max {num(r['kl_max'], '.4f')} nats",
        f"  ({HOW})",
    ])
