"""``bmoe inspect`` as a pip user reads it (issue 38, item 7): a tok/s forecast without ``--probe``
(from a prior read rate, labelled so), none under a "CANNOT RUN" verdict, the parameter count and
the trained context, and no file of the repository named."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bmoe.inspect import READ_PRIOR_MIB_S, inspect_model, render
from bmoe.synth.tiny import TinySpec
from tests.helpers import cli

pytestmark = pytest.mark.pure  # the index alone: llama.cpp is never loaded

GiB = 1 << 30


@pytest.fixture
def no_probe(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # no stored probe of this device


def test_a_forecast_without_probe_uses_a_labelled_prior(tiny, no_probe: None) -> None:
    r = inspect_model(tiny.path(TinySpec()), ram_bytes=8 * GiB)
    assert r.read_mib_s is None, "the measured rate stays unmeasured"
    assert r.forecasts and all(f.tok_s is not None and f.tok_s > 0 for f in r.forecasts)
    assert r.read_how.startswith("prior") and "--probe" in r.read_how
    text = render(r)
    assert f"read rate      {READ_PRIOR_MIB_S:,.0f} MiB/s (prior, not measured here" in text, text
    tok_column = [line.split()[-1] for line in text.splitlines()[-len(r.forecasts):]]
    assert "-" not in tok_column, text


def test_no_forecast_for_a_model_that_cannot_run(tiny, no_probe: None) -> None:
    path = tiny.path(TinySpec())
    r = inspect_model(path, ram_bytes=int(0.3 * GiB))
    assert r.verdict == "cannot run" and r.forecasts == []
    assert render(r).splitlines()[-1].split() == ["forecast", "none:", "the", "model", "cannot", "run", "with",
                                                  "this", "RAM"]
    runs = inspect_model(path, ram_bytes=8 * GiB)
    assert runs.verdict != "cannot run" and runs.forecasts, "negative control: a model that runs is forecast"


def test_parameters_and_context_length(tiny) -> None:
    from bmoe.io.validate import open_layout

    path = tiny.path(TinySpec())
    layout = open_layout(path)
    want = sum(int(__import__("math").prod(s.ne)) for s in layout.tensors.values())
    r = inspect_model(path, ram_bytes=8 * GiB)
    assert r.parameters == want > 0
    assert r.context_length == layout.metadata["qwen3moe.context_length"]
    line = render(r).splitlines()[1]
    assert "parameters" in line and f"trained context {r.context_length:,} tokens" in line, line
    data = json.loads(cli("inspect", str(path), "--ram", "8", "--json").stdout)
    assert data["parameters"] == want and data["context_length"] == r.context_length


def test_no_repository_file_is_named(tiny) -> None:
    """The hit-rate prior named shared/traces/..., a file a pip user does not have."""
    out = cli("inspect", str(tiny.path(TinySpec())), "--ram", "8")
    assert out.returncode == 0, out.stderr
    assert "shared/" not in out.stdout and ".route.csv" not in out.stdout and "prior" in out.stdout
