"""Small user-facing defects of the command line found by an audit, one test each: a flag out of
range refused before anything is written, flags that do nothing said so, errors in the command
line's words, numbers and budgets printed so they can be told apart."""

from __future__ import annotations

from pathlib import Path

import pytest

from bmoe.errors import ConfigError
from bmoe.synth.big import SynthSpec
from bmoe.synth.tiny import TinySpec
from tests.helpers import bmoe, cli, one_line


# --- 1: synth --layers above the real depth ------------------------------------------------------


@pytest.mark.pure
def test_synth_refuses_more_layers_than_the_real_model_before_writing(tmp_path: Path) -> None:
    # The flags are checked before the output path: a folder that does not exist means that a
    # regression is refused for the folder instead (this test fails) rather than writing 17 GB.
    out = tmp_path / "missing" / "s.gguf"
    line = one_line(cli("synth", str(out), "--like", "qwen3-30b-a3b", "--layers", "49"), 1)
    assert "--layers must be in [1, 48] for qwen3-30b-a3b" in line and "got 49" in line, line
    assert not list(tmp_path.iterdir())
    with pytest.raises(ConfigError, match=r"\[1, 48\]"):
        SynthSpec(like="qwen3-30b-a3b", n_layer=49).validate()
    SynthSpec(like="qwen3-30b-a3b", n_layer=48).validate()  # the real depth itself is fine


# --- 2: a ceiling below the budget, and cache flags with the cache off --------------------------


@pytest.mark.pure
def test_a_ceiling_below_the_budget_asked_is_refused() -> None:
    line = one_line(cli("run", "-m", "m.gguf", "-p", "hi", "-n", "1", "--cache-mb", "100", "--cache-ceil-mb", "50"), 1)
    assert "--cache-ceil-mb 50 is below --cache-mb 100" in line, line


@pytest.mark.parametrize("flags,warning", [
    (("--cache-mb", "0", "--cache-ceil-mb", "50"), "--cache-ceil-mb does nothing with the cache off"),
    (("--cache-mb", "1", "--cache-ceil-mb", "50"), "--cache-ceil-mb does nothing with a fixed --cache-mb"),
    (("--cache-mb", "0", "--cache-profile", "PROFILE"), "--cache-profile seeds no cache with the cache off"),
])
def test_cache_flags_that_do_nothing_are_warned_about(tiny, tmp_path: Path, flags: tuple[str, ...],
                                                      warning: str) -> None:
    flags = tuple(str(tmp_path / "p.json") if f == "PROFILE" else f for f in flags)
    base = ("run", "-m", str(tiny.path(TinySpec())), "-p", "hi", "-n", "1", "-c", "256", *flags)
    proc = bmoe(*base)
    assert proc.returncode == 0, proc.stderr
    warnings = [line for line in proc.stderr.splitlines() if line.startswith("bmoe: warning: ")]
    assert len(warnings) == 1 and warning in warnings[0], proc.stderr
    assert "bmoe: warning:" not in bmoe(*base, "-q").stderr


# --- 3: an output flag given '-' ---------------------------------------------------------------


@pytest.mark.pure
@pytest.mark.parametrize("command,flag", [("run", "--csv"), ("run", "--route-trace"), ("replay", "--csv")])
def test_an_output_named_dash_is_refused_not_written(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, command: str,
                                                      flag: str) -> None:
    monkeypatch.chdir(tmp_path)
    argv = (("run", "-m", "m.gguf", "-p", "hi", "-n", "1") if command == "run"
            else ("replay", str(tmp_path / "t.route.csv"), "--cache-mb", "1"))
    line = one_line(cli(*argv, flag, "-"), 2)
    assert line.startswith(f"bmoe: error: {flag} -: standard output"), line
    assert not (tmp_path / "-").exists()


# --- 4: errors past the parser name the flags, not RunConfig's fields ----------------------------


@pytest.mark.parametrize("argv,flag,field", [
    (("quality", "MODEL", "--lossy", "--drop-cold-experts 0.5", "-n", "2", "--max-prompts", "1"),
     "(--cache-mb)", "cache_bytes"),
    (("quality", "MODEL", "--lossy", "--n-expert-used 9", "-n", "2", "--max-prompts", "1"),
     "--n-expert-used must be", "n_expert_used"),
    (("run", "-m", "MODEL", "-p", "hi", "-n", "1", "--n-expert-used", "9"), "--n-expert-used must be", "n_expert_used"),
])
def test_errors_found_at_open_name_the_flag(tiny, argv: tuple[str, ...], flag: str, field: str) -> None:
    model = str(tiny.path(TinySpec()))
    line = one_line(bmoe(*(model if a == "MODEL" else a for a in argv)), 1)
    assert flag in line and field not in line, line


# --- 5: a subcommand's unknown words are its own usage error; bad flag values are status 2 --------


@pytest.mark.pure
@pytest.mark.parametrize("command", ["chat", "run"])
def test_unrecognized_arguments_name_the_subcommand(command: str) -> None:
    """Prefixed once (it read ``bmoe: error: bmoe run: ...``), naming the command's own help."""
    argv = ("-m", "m.gguf", *(("-p", "hi") if command == "run" else ()))
    extra = ("--bogus", "x") if command == "run" else ("-p", "hi")
    line = one_line(cli(command, *argv, *extra), 2)
    assert line == f"bmoe: error: unrecognized arguments: {' '.join(extra)} (bmoe {command} --help lists its flags)"


@pytest.mark.pure
@pytest.mark.parametrize("argv", [
    ("run", "-m", "m.gguf", "-p", "hi", "--io-threads", "0"),  # argparse's own errors
    ("run", "-m", "m.gguf"),
    ("chat", "-m", "m.gguf", "-q", "--verbose"),
    ("run", "-m", "m.gguf", "-p", ""),  # bmoe's usage errors past the parser
])
def test_no_error_repeats_the_prefix(argv: tuple[str, ...]) -> None:
    line = one_line(cli(*argv), 2)
    assert line.count("bmoe") == 1, line


@pytest.mark.parametrize("argv,flag", [
    (("inspect", "MODEL", "--ram", "-3"), "--ram"),
    (("quality", "MODEL", "--lossy", "--n-expert-used 1", "--cache-mb", "nan"), "--cache-mb"),
    (("quality", "MODEL", "--lossy", "--n-expert-used 1", "--max-prompts", "0"), "--max-prompts"),
    (("quality", "MODEL", "--lossy", "--n-expert-used 1", "-n", "1"), "--tokens"),
    (("replay", "TRACE", "--cache-mb", "1", "--policy", "lru,bogus"), "--policy"),
    (("replay", "TRACE", "--cache-mb", "1", "--overlap", "bogus"), "--overlap"),
])
@pytest.mark.pure
def test_bad_flag_values_are_usage_errors(tmp_path: Path, argv: tuple[str, ...], flag: str) -> None:
    model, trace = str(tmp_path / "m.gguf"), str(tmp_path / "t.route.csv")
    line = one_line(cli(*({"MODEL": model, "TRACE": trace}.get(a, a) for a in argv)), 2)
    assert line.startswith("bmoe: error: argument ") and flag in line, line


# --- 9: inspect --ram is in GiB, and says so ----------------------------------------------------


@pytest.mark.pure
def test_inspect_ram_says_gib() -> None:
    proc = cli("inspect", "--help")
    assert proc.returncode == 0 and "--ram GiB" in proc.stdout and "--ram GB" not in proc.stdout, proc.stdout


# --- 6: range errors print their bounds as plain numbers ----------------------------------------


@pytest.mark.parametrize("argv,bounds", [
    (("run", "-m", "MODEL", "-p", "hi", "-n", "-1"), "from 1 to 1048576"),
    (("run", "-m", "MODEL", "-p", "hi", "--cache-mb", "1e20"), "0 (off) or 1 MiB to 1073741824"),
    (("run", "-m", "MODEL", "-p", "hi", "--cache-ceil-mb", "-1"), "from 0 to 1073741824"),
    (("replay", "MODEL", "--cache-mb", "1,x"), "(0 to 1073741824)"),
    (("replay", "MODEL", "--cache-mb", "1", "--compute-ms-per-layer", "-1"), "from 0 to 1000000"),
])
@pytest.mark.pure
def test_range_errors_print_plain_numbers(argv: tuple[str, ...], bounds: str) -> None:
    line = one_line(cli(*("m.gguf" if a == "MODEL" else a for a in argv)), 2)
    assert bounds in line and "e+" not in line, line


# --- 8: inspect's forecast shows sub-MiB budgets with a decimal ----------------------------------


def test_inspect_forecast_budgets_below_a_mib_are_not_zero(tiny) -> None:
    proc = bmoe("inspect", str(tiny.path(TinySpec())), "--ram", "4")  # a 1.5 MiB expert bank
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    rows = lines[[i for i, line in enumerate(lines) if "forecast" in line][0] + 1:]
    budgets = {" ".join(r.split()[:-8]): r.split()[-8] for r in rows}
    assert budgets["cache off"] == "0", rows
    assert budgets["quarter bank"] == "0.4" and budgets["whole bank"] == "1.5", rows


# --- 10: chat's /stats counts in the singular and the plural -------------------------------------


@pytest.mark.pure
def test_chat_stats_says_one_reply_not_one_replies() -> None:
    from types import SimpleNamespace

    from bmoe.cli.chat import _chat_stats

    usage = SimpleNamespace(prompt_tokens=1, prompt_evaluated=1, prompt_reused=0)
    session = SimpleNamespace(last_stats=None, last_usage=usage)
    one = _chat_stats(session, {"replies": 1, "tokens": 1, "prompt": 1, "reused": 0})
    assert one.splitlines() == ["last prompt: 1 token, 1 evaluated, 0 reused from the context",
                                "session: 1 reply, 1 token generated, 0 of 1 prompt token reused"], one
    two = _chat_stats(session, {"replies": 2, "tokens": 9, "prompt": 30, "reused": 12})
    assert two.splitlines()[-1] == "session: 2 replies, 9 tokens generated, 12 of 30 prompt tokens reused", two


# --- 11: the README sends no one to a file the repository does not hold --------------------------

README = Path(__file__).resolve().parent.parent / "README.md"


@pytest.mark.pure
def test_readme_points_inside_the_repository_and_names_the_shards_make_tiny_writes() -> None:
    text = README.read_text()
    assert "../" not in text  # a clone holds nothing beside itself
    shard_lines = [line for line in text.splitlines() if line.startswith("bmoe make-tiny") and "--shards" in line]
    assert shard_lines
    for line in shard_lines:  # make-tiny OUT --shards N writes OUT-00001-of-0000N.gguf, never OUT itself
        out, n = line.split()[2], int(line.split("--shards")[1].split()[0])
        assert f"{out.removesuffix('.gguf')}-00001-of-{n:05d}.gguf" in line, line
