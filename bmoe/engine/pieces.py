"""What a generation hands back: one ``Piece`` per token, the ``Usage`` it ends with, and a whole
``Generation`` gathered. Plain values, shared by the session's turn-by-turn path and the step
scheduler (``bmoe.engine.scheduler``), which both make them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from bmoe.engine.sampling import TokenLogprob
from bmoe.metrics.stats import GenerationStats
from bmoe.metrics.tokens import TokenMetrics

FinishReason = Literal["stop", "length", "cancelled"]


@dataclass(frozen=True)
class Usage:
    """Tokens of one generation: the prompt's, those generated, and how many of the prompt's were
    evaluated (the others were already in the context from an earlier call)."""

    prompt_tokens: int
    completion_tokens: int
    prompt_evaluated: int

    @property
    def prompt_reused(self) -> int:
        return self.prompt_tokens - self.prompt_evaluated

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(frozen=True)
class Piece:
    """One generated token and the text it lets through (empty while a possible stop string is
    held back). The last piece of a generation carries ``finish_reason`` and ``usage`` and any
    text still held back: "stop" (an end-of-generation token or a stop string), "length"
    (max_tokens reached) or "cancelled" (``cancel()`` / ``close()``). It is the last token's piece,
    or, when no token ended the generation (end of generation, cancel), a piece whose ``token`` is
    None."""

    token: int | None
    text: str
    metrics: TokenMetrics | None = None
    logprob: TokenLogprob | None = None
    finish_reason: FinishReason | None = None
    usage: Usage | None = None


@dataclass
class Generation:
    tokens: list[int] = field(default_factory=list)
    text: str = ""
    stats: GenerationStats | None = None
    finish_reason: FinishReason | None = None
    usage: Usage | None = None
    logprobs: list[TokenLogprob] | None = None  # one per token, when sampling asked for them


__all__ = ["FinishReason", "Generation", "Piece", "Usage"]
