"""``bmoe quality``: its measures (KL, agreement) on known inputs, a zero-cost lever measured as
zero, a real one measured as non-zero, and every figure labelled lossy with its flags."""

from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest

from bmoe.engine.config import RunConfig
from bmoe.cli.options import parse_lossy
from bmoe.engine.lossy import lossy_label
from bmoe.errors import ConfigError
from bmoe.quality import compare, kl_divergence, shipped_prompts
from bmoe.synth.tiny import TinySpec
from tests.helpers import bmoe, cli, one_line
from tests.test_lossy_topk import SPEC


@pytest.mark.pure
def test_kl_is_zero_for_equal_logits_and_matches_the_definition() -> None:
    a = np.array([[1.0, 2.0, 3.0], [0.0, 0.0, 0.0]], np.float32)
    assert kl_divergence(a, a + 7.0).tolist() == pytest.approx([0.0, 0.0], abs=1e-12)  # shift-invariant
    b = np.array([[3.0, 2.0, 1.0], [0.0, 0.0, 0.0]], np.float32)
    p, q = np.exp(a[0]) / np.exp(a[0]).sum(), np.exp(b[0]) / np.exp(b[0]).sum()
    assert kl_divergence(a, b)[0] == pytest.approx(float((p * np.log(p / q)).sum()))


@pytest.mark.pure
def test_shipped_prompts_are_several_nonempty_lines() -> None:
    prompts = shipped_prompts()
    assert len(prompts) >= 4 and all(p.strip() and not p.startswith("#") for p in prompts)


@pytest.mark.pure
def test_parse_lossy_reads_the_run_flags_and_refuses_the_rest() -> None:
    assert parse_lossy("--n-expert-used 3")["n_expert_used"] == 3
    fields = parse_lossy("--drop-cold-experts 0.75 --drop-no-renorm --route-ahead 2")
    assert (fields["drop_cold_experts"], fields["drop_renorm"], fields["route_ahead"]) == (0.75, False, 2)
    with pytest.raises(ConfigError, match="--lossy"):
        parse_lossy("--n-expert-used three")
    with pytest.raises(ConfigError, match="turns no lossy lever on"):
        parse_lossy("")
    with pytest.raises(ConfigError, match="No closing quotation"):  # was an internal error (shlex's ValueError)
        parse_lossy('"unbalanced')


@pytest.mark.pure
def test_labels() -> None:
    assert lossy_label(RunConfig()) == {"lossy": False, "lossy_flags": None}
    assert lossy_label(RunConfig(n_expert_used=2)) == {"lossy": True, "lossy_flags": "--n-expert-used 2"}
    both = RunConfig(mode="stream", cache_bytes=1 << 20, drop_cold_experts=0.5, drop_renorm=False, drop_prefill=True)
    assert lossy_label(both)["lossy_flags"] == "--drop-cold-experts 0.5 --drop-no-renorm --drop-prefill"
    # the label reads back as the same levers
    assert RunConfig(mode="stream", cache_bytes=1 << 20, **parse_lossy(lossy_label(both)["lossy_flags"])) == both


def _compare(tiny, k: int):  # noqa: ANN001, ANN202
    exact = RunConfig(mode="stream", n_ctx=256)
    lossy = RunConfig(mode="stream", n_ctx=256, n_expert_used=k)
    return asyncio.run(compare(tiny.path(SPEC), exact, lossy, shipped_prompts()[:2], 6)).as_dict()


def test_the_files_own_k_measures_as_no_loss(tiny) -> None:
    r = _compare(tiny, 4)
    assert r["positions"] == 12 and r["agreement_pct"] == 100.0 and r["kl_max"] == 0.0
    assert r["lossy"] is True and r["lossy_flags"] == "--n-expert-used 4"


def test_top1_measures_as_a_loss(tiny) -> None:
    r = _compare(tiny, 1)
    assert r["kl_mean"] > 0.0 and r["kl_max"] >= r["kl_mean"]
    assert 0.0 <= r["agreement_pct"] <= 100.0
    assert r["exact"]["lossy"] is False and r["lossy_run"]["lossy"] is True
    assert r["exact"]["bytes_read_per_token"] > r["lossy_run"]["bytes_read_per_token"]


def test_cli_quality_json_and_run_json_carry_the_label(tiny) -> None:
    path = str(tiny.path(SPEC))
    proc = bmoe("quality", path, "--lossy", "--n-expert-used 2", "-n", "3", "--max-prompts", "1", "--json")
    assert proc.returncode == 0, proc.stderr
    r = json.loads(proc.stdout)
    assert r["lossy"] is True and r["lossy_flags"] == "--n-expert-used 2" and r["positions"] == 3
    proc = bmoe("run", "-m", path, "-p", "Hello", "-n", "3", "--json", "-c", "64", "--n-expert-used", "2")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["lossy_flags"] == "--n-expert-used 2"


@pytest.mark.parametrize("flags", ["--n-expert-used 9", "--bogus 1"])
def test_cli_bad_lever_is_one_line(tiny, flags: str) -> None:
    path = str(tiny.path(TinySpec(n_expert_used=4)))
    proc = bmoe("quality", path, "--lossy", flags, "-n", "3", "--max-prompts", "1")
    assert proc.returncode == 1
    assert proc.stderr.startswith("bmoe: error: ") and proc.stderr.count("\n") == 1


@pytest.mark.pure
@pytest.mark.parametrize("flags,msg", [
    (["--cache-mb", "0", "--drop-cold-experts", "0.5"], "stream with a cache budget"),
    (["--route-ahead", "1", "--cache-mb", "8", "--predict-prefetch"], "already reads ahead"),
    (["--drop-no-renorm"], "set it too"),
])
def test_cli_run_refuses_nonsense_levers_in_one_line(flags: list[str], msg: str) -> None:
    """Refused from the flags alone, before a model is opened (in process: no model needed)."""
    line = one_line(cli("run", "-m", "m.gguf", "-p", "Hello", "-n", "2", *flags), 1)
    assert msg in line, line


def test_cli_run_json_reports_drops(tiny) -> None:
    proc = bmoe("run", "-m", str(tiny.path(SPEC)), "-p", "Hello", "-n", "4", "--json", "-c", "64",
                "--cache-mb", "1", "--drop-cold-experts", "4")
    assert proc.returncode == 0, proc.stderr
    r = json.loads(proc.stdout)
    assert r["lossy"] is True and r["lossy_flags"] == "--drop-cold-experts 4"
    assert r["drop_tokens"] == 3 and r["drop_dropped_experts"] > 0 and r["drop_bytes_saved"] > 0


@pytest.mark.pure
def test_non_finite_scores_are_an_error_never_a_figure() -> None:
    from bmoe.errors import BmoeError
    from bmoe.quality import _check_finite

    _check_finite(np.zeros((3, 4), np.float32), "lossy", 0)
    scores = np.zeros((3, 4), np.float32)
    scores[1, 2] = np.nan
    with pytest.raises(BmoeError, match="lossy run produced non-finite scores at prompt 2, position 1"):
        _check_finite(scores, "lossy", 2)
