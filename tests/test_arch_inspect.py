"""``bmoe inspect``: what it reports from the index agrees with what the engine streams, on every
fixture; bad files are one line and exit 1; ``--list-archs`` names every recipe."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import pytest

from bmoe.engine.config import RunConfig
from bmoe.engine.session import Session
from bmoe.inspect import hit_prior, inspect_model
from bmoe.io.recipes import RECIPES
from bmoe.pipeline.hooks import Hooks
from bmoe.synth.tiny import TinySpec
from tests.helpers import PROMPT
from tests.test_arch_gates import SPECS

FIXTURES = {**SPECS, "qwen3moe": TinySpec(), "qwen2moe": TinySpec(arch="qwen2moe"), "gemma4": TinySpec(arch="gemma4")}
GiB = 1 << 30


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "bmoe.cli", *args], capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("arch", list(FIXTURES))
def test_inspect_agrees_with_the_engine(tiny, arch: str) -> None:
    path = tiny.path(FIXTURES[arch])
    report = inspect_model(path, ram_bytes=8 * GiB)
    routed: set[int] = set()

    async def go() -> dict[int, int]:
        hooks = Hooks(on_plan=lambda event, plan: routed.add(event.layer))
        with Session.open(path, RunConfig(mode="stream", n_ctx=256), hooks=hooks) as s:
            await s.generate(PROMPT, 3, stop_at_end=False)
            return s._streaming.residency.entry_bytes()

    engine_entry = asyncio.run(go())
    assert report.expert_bytes_per_layer == engine_entry, "same bytes per expert per layer"
    assert report.moe_layers == sorted(routed), "the layers llama.cpp routes are inspect's MoE layers"
    assert report.layers["moe"] + report.layers["dense"] + report.layers["mtp"] == report.blocks
    assert report.bytes_per_token_cache_off == report.experts_used * sum(engine_entry.values())
    assert report.verdict == "resident"  # tiny files, 8 GiB


def test_inspect_counts_layer_kinds(tiny) -> None:
    r = inspect_model(tiny.path(SPECS["qwen35moe"]), ram_bytes=8 * GiB)
    assert r.layers == {"moe": 2, "dense": 0, "recurrent": 1, "mtp": 1} and r.shared_experts == 1
    assert r.mtp_bytes > 0 and "MXFP4" in inspect_model(tiny.path(SPECS["gpt-oss"]), ram_bytes=GiB).expert_types
    lfm = inspect_model(tiny.path(SPECS["lfm2moe"]), ram_bytes=8 * GiB)
    assert lfm.layers == {"moe": 2, "dense": 1, "recurrent": 2, "mtp": 0}


def test_verdicts_follow_the_ram(tiny) -> None:
    path = tiny.path(SPECS["glm4moe"])
    r = inspect_model(path, ram_bytes=8 * GiB)
    dense, ws, bank = r.dense_bytes, r.bytes_per_token_cache_off, r.expert_bank_bytes
    floor = r.floor_bytes  # the budget model's needs besides dense and experts
    assert inspect_model(path, ram_bytes=dense + ws + floor + 1).verdict == "streamed"
    assert inspect_model(path, ram_bytes=dense + ws + floor - 1).verdict == "cannot run"
    assert inspect_model(path, ram_bytes=dense + bank + r.mtp_bytes + floor).verdict == "resident"


def test_cannot_run_says_whether_the_token_or_the_prompt_union_is_too_big(tiny) -> None:
    """A prompt layer's expert union bigger than one token's experts (few layers, a 512-token
    batch routes every expert) made "cannot run" say the token's working set did not fit, when it
    did; and the auto budget line showed what was left as 0."""
    path = tiny.path(SPECS["glm4moe"])
    r = inspect_model(path, ram_bytes=8 * GiB)
    dense, ws = r.dense_bytes, r.bytes_per_token_cache_off
    union_beyond = r.experts * max(r.expert_bytes_per_layer.values()) - ws
    assert union_beyond > 0, "this model's prompt union is bigger than one token's experts"
    ram = dense + ws + r.floor_bytes - union_beyond // 2  # the token fits, the union does not
    tight = inspect_model(path, ram_bytes=ram)
    assert tight.verdict == "cannot run" and "prompt layer's expert union" in tight.verdict_why, tight.verdict_why
    assert "one token's working set would fit" in tight.verdict_why
    assert "less than the" in tight.auto_budget_how and "prefill union: 0 MiB" in tight.auto_budget_how
    starved = inspect_model(path, ram_bytes=dense + ws // 2)
    assert starved.verdict == "cannot run" and "one token's working set exceed" in starved.verdict_why


def test_forecast_shows_its_inputs_and_null_when_unmeasured(tiny, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # no cached probe
    r = inspect_model(tiny.path(SPECS["minimax-m2"]), ram_bytes=8 * GiB)
    assert r.read_mib_s is None and all(f.tok_s is not None for f in r.forecasts)  # a prior rate, labelled
    assert "--probe" in r.read_how and "prior" in r.read_how and "prior" in r.hit_how and "prior" in r.compute_how
    off = r.forecasts[0]
    assert off.label == "cache off" and off.read_bytes_per_token == r.bytes_per_token_cache_off


def test_hit_prior() -> None:
    bank, ws = 1000, 50
    assert hit_prior(0, bank, ws) == hit_prior(40, bank, ws) == 0.0
    values = [hit_prior(b, bank, ws) for b in range(50, 1001, 50)]
    assert values == sorted(values) and 0 < values[0] < values[-1] <= 100


def test_inspect_cli_json_and_malformed(tiny, tmp_path: Path) -> None:
    path = tiny.path(SPECS["deepseek2"])
    done = cli("inspect", str(path), "--ram", "4", "--json")
    assert done.returncode == 0, done.stderr
    data = json.loads(done.stdout)
    assert data["arch"] == "deepseek2" and data["moe_layers"] == [1, 2] and data["ram_bytes"] == 4 * GiB
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(path.read_bytes()[:4096])
    done = cli("inspect", str(bad))
    assert done.returncode == 1 and done.stderr.count("\n") == 1 and done.stderr.startswith("bmoe: error: ")


def test_list_archs_names_every_recipe() -> None:
    done = cli("--list-archs")
    assert done.returncode == 0
    assert [line.split()[0] for line in done.stdout.splitlines()] == sorted(RECIPES)


def test_inspect_names_an_unsupported_architecture(tmp_path: Path) -> None:
    from bmoe.synth.tiny import write_tiny
    from tests.test_arch_validate import rename_arch

    (path,) = write_tiny(tmp_path / "grove.gguf", TinySpec(), edit_metadata=rename_arch("qwen3moe", "grovemoe"))
    done = cli("inspect", str(path))
    assert done.returncode == 1 and done.stderr.count("\n") == 1
    assert "'grovemoe' has no bmoe recipe" in done.stderr and "gpt-oss" in done.stderr


def test_inspect_says_how_a_streamed_run_opens(tiny) -> None:
    mtp = inspect_model(tiny.path(SPECS["glm4moe"]), ram_bytes=8 * GiB)
    assert mtp.open_mode == "mmap-drop" and "MTP" in mtp.open_reason
    assert mtp.open_read_bytes == sum(p.stat().st_size for p in [tiny.path(SPECS["glm4moe"])])
    cheap = inspect_model(tiny.path(SPECS["gpt-oss"]), ram_bytes=8 * GiB)
    assert cheap.open_mode == "user" and cheap.open_read_bytes == cheap.dense_bytes


def test_inspect_reads_the_index_without_llama_cpp(tiny) -> None:
    """``inspect`` is the index alone: the CLI command never imports llama.cpp's binding."""
    path = tiny.path(SPECS["glm4moe"])
    code = ("import sys; from bmoe.cli import main; code = main(['inspect', sys.argv[1], '--ram', '4']); "
            "assert 'llama_cpp' not in sys.modules, 'inspect imported llama_cpp'; sys.exit(code)")
    done = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "glm4moe" in done.stdout


def test_the_open_line_follows_the_ram_given(tiny) -> None:
    """``--ram`` moved the verdict and the budget but not the open: a 2 GiB machine was told its
    user allocation fits against this machine's MemTotal + SwapTotal."""
    path = tiny.path(TinySpec(arch="qwen3moe", wtype="f16", n_layer=4, n_embd=256, n_expert=32, n_ff=256))
    here = inspect_model(path)
    small = inspect_model(path, ram_bytes=(256 + 20) << 20)  # the margin's floor + a little: experts do not fit
    assert here.open_mode == "user"
    assert small.open_mode == "reserved" and "for the RAM given" in small.open_reason, small.open_reason
    assert small.open_read_bytes == here.open_read_bytes, "the reserved open reads the dense bytes only, as user"
