"""A seeded, bounded mutation fuzzer over valid tiny models' headers and metadata (bench/fuzz.py):
300 cases, each run by bmoe's own CLI in a worker process, must each end as a normal run or one
``bmoe: error:`` line with status 1: zero signals, zero tracebacks, zero hangs, zero leaked
llama.cpp log lines. Workers run without the first-open child for speed; a case that kills or hangs
one is re-run through the CLI with isolation on, which is what a user meets."""

from __future__ import annotations

from pathlib import Path

from bench.fuzz import BAD, OK, ONE_LINE, campaign

SEED = 20261203
CASES = 300


def test_the_seeded_fuzz_set_ends_only_in_runs_or_one_line(tmp_path: Path) -> None:
    report = campaign(CASES, SEED, 2, ("qwen3moe", "gemma4"), tmp_path, isolate=False)
    counts = report["counts"]
    assert sum(counts.values()) == CASES
    assert {k: counts[k] for k in BAD} == dict.fromkeys(BAD, 0), report["failures"]
    # The set exercises both outcomes, or it would prove nothing.
    assert counts[OK] > 0 and counts[ONE_LINE] > 0, counts
