"""One flag vocabulary (issue 36, item 4): every engine flag of ``run``, ``chat`` and ``serve`` is
an option of ``bmoe.cli.options``, declared once, and the config is filled from those options
alone; the defaults are the fastest safe ones and ``--help`` says each (issue 38, item 6)."""

from __future__ import annotations

import argparse
import ast
import dataclasses
from pathlib import Path

import pytest

import bmoe
import bmoe.cli.options as options
from bmoe.cli import build_parser
from bmoe.cli.flags import _config, _sampling
from bmoe.engine.config import MiB, RunConfig
from bmoe.engine.sampling import SamplingParams
from tests.helpers import cli, one_line

pytestmark = pytest.mark.pure

ENGINE_FIELDS = {f.name for f in dataclasses.fields(RunConfig)} | {f.name for f in dataclasses.fields(SamplingParams)}
VOCABULARY_FLAGS = {flag for o in options.VOCABULARY for flag in (*o.flags, *(c[0] for c in o.consts))}
ARGV = {"run": ["run", "-m", "m.gguf", "-p", "hi"], "chat": ["chat", "-m", "m.gguf"], "serve": ["serve", "-m", "m.gguf"]}


def command_parser(command: str) -> argparse.ArgumentParser:
    top = build_parser(ARGV[command])
    sub = next(a for a in top._actions if isinstance(a, argparse._SubParsersAction))  # noqa: SLF001
    return sub.choices[command]


def stray_engine_flags(parser: argparse.ArgumentParser) -> list[str]:
    """The flags of ``parser`` that fill an engine field or spell a vocabulary flag but were not
    added from the vocabulary: a second declaration of an engine option."""
    stray = []
    for action in parser._actions:  # noqa: SLF001
        if options.declared(action) is not None or not action.option_strings:
            continue
        if action.dest in ENGINE_FIELDS or VOCABULARY_FLAGS & set(action.option_strings):
            stray.append("/".join(action.option_strings))
    return stray


@pytest.mark.parametrize("command", ["run", "chat", "serve"])
def test_every_engine_flag_comes_from_the_vocabulary(command: str) -> None:
    parser = command_parser(command)
    assert stray_engine_flags(parser) == []
    declared = {options.declared(a) for a in parser._actions} - {None}  # noqa: SLF001
    assert set(options.ENGINE) <= declared, "run, chat and serve take every engine option"
    # The config is filled from the declared options alone: each one reaches its field.
    args = parser.parse_args(ARGV[command][1:] + ["--parallel", "2", "--draft-max", "4", "--io-threads", "3",
                                                  "--no-warm-pool", "-c", "512", "--cache-mb", "64"])
    args.command = command
    config = _config(args)
    assert (config.parallel, config.draft_max, config.io_threads, config.warm_pool, config.n_ctx, config.cache_bytes) \
        == (2, 4, 3, False, 512, 64 * MiB)


def test_a_flag_declared_beside_the_vocabulary_fails_the_check() -> None:
    """Negative control: an engine option added by hand (as --io-threads was, in five places)."""
    parser = command_parser("serve")
    assert stray_engine_flags(parser) == []
    parser.add_argument("--n-ctx", type=int, dest="n_ctx")  # a field's name
    parser.add_argument("--stream-lanes", dest="io_threads")  # another spelling of a field
    with_group = argparse.ArgumentParser()
    with_group.add_argument("--draft-max", type=int)  # a vocabulary flag spelt again
    assert stray_engine_flags(parser) == ["--n-ctx", "--stream-lanes"]
    assert stray_engine_flags(with_group) == ["--draft-max"]


ROOT = Path(bmoe.__file__).parent
# Flags of the same spelling whose meaning differs: replay sweeps lists of budgets and overlap
# modes; the model writers' --seed seeds the weights and their --force replaces a file. bmoe/bench
# keeps its own flags until its parser moves up beside the others.
OWN_MEANING = {("cli/replay.py", "--cache-mb"), ("cli/replay.py", "--overlap"), ("cli/demo.py", "--seed"),
               ("cli/demo.py", "--force"), ("synth/big.py", "--seed"), ("synth/big.py", "--force")}


def test_no_vocabulary_flag_is_spelt_in_an_add_argument_elsewhere() -> None:
    found = []
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel == "cli/options.py" or rel.startswith("bench/"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "add_argument":
                flags = {a.value for a in node.args if isinstance(a, ast.Constant)}
                found += [(rel, f) for f in sorted(flags & VOCABULARY_FLAGS) if (rel, f) not in OWN_MEANING]
    assert found == []


def test_each_option_has_one_field_and_one_name() -> None:
    names = [flag for o in options.VOCABULARY for flag in o.flags]
    assert len(names) == len(set(names))
    fields = [(o.target, o.field) for o in options.VOCABULARY]
    assert len(fields) == len(set(fields))
    for o in options.VOCABULARY:
        owner = {"run": RunConfig, "sampling": SamplingParams}.get(o.target)
        assert owner is None or o.field in {f.name for f in dataclasses.fields(owner)}, o.name


@pytest.mark.parametrize("command", ["run", "chat", "serve"])
def test_the_cache_is_auto_by_default_and_off_on_request(command: str) -> None:
    argv = ARGV[command]
    default = _config(build_parser(argv).parse_args(argv))
    assert default.cache_bytes is None and default.mode == "stream", "auto: sized at open"
    off = _config(build_parser(argv).parse_args([*argv, "--cache-mb", "0"]))
    assert off.cache_bytes == 0
    assert RunConfig().cache_bytes == 0, "the Python API's default is unchanged"


@pytest.mark.parametrize("command", ["run", "chat", "serve"])
def test_help_says_every_engine_default(command: str) -> None:
    parser = command_parser(command)
    for action in parser._actions:  # noqa: SLF001
        option = options.declared(action)
        if option is None or isinstance(action, argparse._StoreTrueAction) or action.const is not None:  # noqa: SLF001
            continue
        text = parser.formatter_class("x")._get_help_string(action) % {"default": action.default}  # noqa: SLF001
        assert "default" in text, (command, option.name, text)
    assert "auto (the default)" in cli(command, "--help").stdout


def test_chat_help_is_true() -> None:
    """Chat's help says its cache stays warm between turns: true only with a cache, now the default."""
    text = " ".join(cli("--help").stdout.split())
    assert "chat interactive multi-turn chat; the expert cache stays warm" in text
    chat = build_parser(ARGV["chat"]).parse_args(ARGV["chat"])
    assert _config(chat).cache_bytes != 0


def test_new_step_flags_fill_their_fields_and_are_bounded() -> None:
    argv = ARGV["chat"]
    config = _config(build_parser(argv).parse_args([*argv, "--parallel", "4", "--draft", "ngram", "--draft-max", "3"]))
    assert (config.parallel, config.draft, config.draft_max) == (4, "ngram", 3)
    for bad in (["--parallel", "0"], ["--parallel", "65"], ["--draft", "eagle"], ["--draft-max", "17"]):
        line = one_line(cli(*argv, *bad), 2)
        assert bad[0] in line, line


def test_a_refused_combination_is_told_in_the_flags_words() -> None:
    line = one_line(cli("run", "-m", "m.gguf", "-p", "x", "--parallel", "64", "-c", "512"), 1)
    assert "-c 512 split between 64 sequences" in line and "n_ctx" not in line, line
    line = one_line(cli("run", "-m", "m.gguf", "-p", "x", "--parallel", "2", "--predict-prefetch"), 1)
    assert "--predict-prefetch assumes one sequence's token per decode step: not with --parallel > 1" in line, line


def test_sampling_flags_fill_sampling_params() -> None:
    argv = [*ARGV["run"], "--temp", "0.5", "--top-k", "7", "--seed", "-1", "--stop", "a\\nb"]
    args = build_parser(argv).parse_args(argv)
    params = _sampling(args)
    assert (params.temperature, params.top_k, params.seed) == (0.5, 7, None)
    assert args.stop == ["a\nb"]


def test_a_lever_string_reads_the_run_flags() -> None:
    assert options.parse_lossy("--n-expert-used 3 --route-ahead 1") == {
        "n_expert_used": 3, "drop_cold_experts": None, "drop_renorm": True, "drop_prefill": False, "route_ahead": 1}
