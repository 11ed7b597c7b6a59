"""``bmoe bench --streams``: batched decoding and drafts measured side by side, in issue 35's JSON
shape. Only the shape and the equalities are asserted: the figures are timings."""

from __future__ import annotations

import argparse
import json

import pytest

from bmoe.bench import harness
from bmoe.errors import ConfigError
from bmoe.synth.tiny import TinySpec


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="bmoe")
    sub = parser.add_subparsers(dest="command", required=True)
    harness.add_bench_command(sub)
    return parser.parse_args(["bench", *argv])


def test_streams_study_json(tiny, capsys: pytest.CaptureFixture[str]) -> None:
    path = tiny.path(TinySpec())
    args = parse([str(path), "--streams", "1,2", "--tokens", "6", "--draft", "ngram", "--json", "-t", "1"])
    assert harness.run_bench_command(args) == 0
    result = json.loads(capsys.readouterr().out)
    rows = result["streams"]
    assert [r["streams"] for r in rows] == [1, 2]
    for r in rows:
        assert r["tokens_equal_resident"] is True  # the tiny model fits: resident ran beside
        assert r["aggregate_tok_s"] > 0 and r["per_stream_tok_s"] == pytest.approx(r["aggregate_tok_s"] / r["streams"])
        assert r["mib_read_per_token"] is not None  # streamed with a cache: reads were counted
        assert r["ttft_p50_s"] is None  # not measured here: null, never 0
    assert rows[1]["mean_batch"] > 1
    assert set(result["draft"]) == {"copy", "plain"}
    for d in result["draft"].values():
        assert d["tokens_equal_plain"] is True and d["tok_s_draft"] > 0 and d["tok_s_plain"] > 0


def test_streams_options_refused(tiny) -> None:
    path = str(tiny.path(TinySpec()))
    with pytest.raises(SystemExit):  # argparse's one line: "stream counts must be 1..64, got '0,2'"
        parse([path, "--streams", "0,2"])
    with pytest.raises(ConfigError, match="give --streams too"):
        harness.BenchOptions.from_args(parse([path, "--draft", "ngram"])).validate()
