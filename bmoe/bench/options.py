"""``bmoe bench``'s options: the values its flags parse to, checked once, and what they imply
(the context every run fits, the compute threads). No I/O: the command (``harness``) reads the
command line into a ``BenchOptions``; the plan, the sides and the summary read it."""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from bmoe.argtypes import checked, plain
from bmoe.bench.balloon import GiB
from bmoe.engine.config import MAX_CTX, MAX_PARALLEL
from bmoe.errors import ConfigError

MiB = 1 << 20
PROMPT = "The quick brown fox jumps over the lazy dog, and the experts stream from disk."
WARMUP_PROMPT = "Warm-up: a different prompt, so the measured routing is not pre-read."
TTFT_LENGTHS = (5, 50, 200, 1000)
SQUEEZE_TOKENS_CAP = 4  # a squeezed generation runs on to at most this many times --tokens
MAX_ROUNDS = 100
MAX_BUSY = 256
MAX_DISK_LIMIT = 1 << 20  # MiB/s: 1 TiB/s, past any disk


def _positive(hi: float, what: str) -> Callable[[str], float]:
    """A finite number above 0 and at most ``hi`` (nan, inf and 1e300 ended in an internal error)."""
    return checked(float, lambda v: math.isfinite(v) and 0 < v <= hi, what, f" above 0 and at most {plain(hi)}")


GIB_VALUE = _positive(1 << 20, "GiB")  # --ram-limit, --squeeze
SECONDS = _positive(1e7, "seconds")  # --timeout, --stock-timeout
MIB_S = _positive(MAX_DISK_LIMIT, "MiB/s")  # --disk-limit


def mib_list(text: str) -> tuple[float, ...]:
    try:
        values = tuple(float(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected MiB values separated by commas, got {text!r}") from None
    if not values or not all(math.isfinite(v) and 1 <= v <= 1 << 30 for v in values):
        raise argparse.ArgumentTypeError(f"budgets must be from 1 to {1 << 30} MiB each, got {text!r}")
    return values


def int_list(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected token counts separated by commas, got {text!r}") from None
    if any(v < 0 for v in values):
        raise argparse.ArgumentTypeError(f"token counts cannot be negative, got {text!r}")
    return tuple(v for v in values if v > 0)



def stream_list(text: str) -> tuple[int, ...]:
    """``--streams``: request counts, each 1..MAX_PARALLEL (0 is no count of requests)."""
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected stream counts separated by commas, got {text!r}") from None
    if not values or any(not 1 <= v <= MAX_PARALLEL for v in values):
        raise argparse.ArgumentTypeError(f"stream counts must be 1..{MAX_PARALLEL}, got {text!r}")
    return values


@dataclass(frozen=True)
class BenchOptions:
    model: Path
    tokens: int = 32
    warmup: int = 4
    prompt: str = PROMPT
    io_threads: int = 2
    threads: int | None = None
    ctx: int | None = None
    ram_limit_bytes: int | None = None
    timeout_s: float = 3600.0
    out: Path | None = None
    plot: Path | None = None
    stock_timeout_s: float | None = None
    squeeze_bytes: int | None = None
    budgets_mib: tuple[float, ...] = ()
    ttft_lengths: tuple[int, ...] = TTFT_LENGTHS
    rounds: int = 1  # every configuration this many times, interleaved (A B C A B C ...)
    busy: int = 0  # spinning processes beside the engine during the measured runs
    disk_limit_mib_s: float | None = None  # the streamed runs' read lanes land at most this many MiB/s
    # The streams study instead of the configurations (bmoe.bench.streams): stream counts, drafts.
    streams: tuple[int, ...] = ()
    draft: str = "none"

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> BenchOptions:
        return cls(
            model=args.model, tokens=args.tokens, warmup=args.warmup, prompt=args.prompt,
            io_threads=args.io_threads, threads=args.threads, ctx=args.ctx,
            ram_limit_bytes=None if args.ram_limit is None else int(args.ram_limit * GiB),
            timeout_s=args.timeout, out=args.out, plot=args.plot, stock_timeout_s=args.stock_timeout,
            squeeze_bytes=None if args.squeeze is None else int(args.squeeze * GiB),
            budgets_mib=tuple(args.budgets), ttft_lengths=tuple(args.ttft),
            rounds=args.rounds, busy=args.busy, disk_limit_mib_s=args.disk_limit,
            streams=tuple(args.streams), draft=args.draft,
        )

    def validate(self) -> BenchOptions:
        if self.tokens < 2:
            raise ConfigError(f"--tokens must be at least 2 (tok/s counts the tokens after the first), got {self.tokens}")
        if self.warmup < 0:
            raise ConfigError(f"--warmup must be >= 0, got {self.warmup}")
        if not self.prompt:
            raise ConfigError("--prompt is empty")
        if not 1 <= self.io_threads <= 64:
            raise ConfigError(f"--io-threads must be 1..64, got {self.io_threads}")
        if self.threads is not None and not 1 <= self.threads <= 512:
            raise ConfigError(f"--threads must be 1..512, got {self.threads}")
        if not 1 <= self.rounds <= MAX_ROUNDS:
            raise ConfigError(f"--rounds must be 1..{MAX_ROUNDS}, got {self.rounds}")
        if not 0 <= self.busy <= MAX_BUSY:
            raise ConfigError(f"--busy must be 0..{MAX_BUSY}, got {self.busy}")
        if self.disk_limit_mib_s is not None and not (math.isfinite(self.disk_limit_mib_s)
                                                      and 0 < self.disk_limit_mib_s <= MAX_DISK_LIMIT):
            raise ConfigError(f"--disk-limit must be above 0 and at most {MAX_DISK_LIMIT} MiB/s, "
                              f"got {self.disk_limit_mib_s}")
        if any(not 1 <= b <= MAX_PARALLEL for b in self.streams):
            raise ConfigError(f"--streams counts must be 1..{MAX_PARALLEL}, got {','.join(map(str, self.streams))}")
        if self.draft != "none" and not self.streams:
            raise ConfigError("--draft measures drafts beside --streams: give --streams too (e.g. --streams 1)")
        if not 16 <= self.n_ctx <= MAX_CTX:
            raise ConfigError(f"the runs need a context of {self.n_ctx} tokens (--ctx, or the longest --ttft prompt "
                              f"plus --tokens); at most {MAX_CTX}")
        return self

    @property
    def n_threads(self) -> int:
        return self.threads or max(1, len(os.sched_getaffinity(0)))

    @property
    def n_ctx(self) -> int:
        """A context every run fits: at most one token per prompt byte, plus BOS and the tokens."""
        if self.ctx is not None:
            return self.ctx
        gen = max(self.tokens * (SQUEEZE_TOKENS_CAP if self.squeeze_bytes else 1), self.warmup)
        need = max(len(self.prompt.encode()) + gen, max(self.ttft_lengths, default=0)) + 8
        return max(512, -(-need // 256) * 256)

