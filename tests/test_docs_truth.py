"""What the README and docs/robustness.md say, held to what the code does: each test pins one
sentence that an audit found untrue."""

from __future__ import annotations

import json
import subprocess

import pytest

from bmoe.synth.tiny import TinySpec
from tests.helpers import bmoe as _bmoe

NOT_UTF8 = b"caf\xe9 \xff ok"
WARNING = b"bmoe: warning: the prompt is not valid UTF-8; invalid bytes replaced by U+FFFD"


def bmoe(*args: str | bytes, stdin: bytes | None = None) -> subprocess.CompletedProcess[bytes]:
    """The shared helper, in bytes: prompts here are not UTF-8."""
    return _bmoe(*args, stdin=stdin, binary=True)


@pytest.mark.parametrize("source", ["-p TEXT", "-p -", "-f FILE"])
def test_a_prompt_that_is_not_utf8_warns_whichever_way_it_comes(tiny, tmp_path, source: str) -> None:
    """docs/robustness.md: "a prompt that is not UTF-8 is accepted (invalid bytes become U+FFFD,
    with a warning)". Only -p TEXT warned; -f FILE and -p - replaced the bytes silently."""
    model = str(tiny.path(TinySpec()))
    stdin = None
    if source == "-p TEXT":
        prompt = ["-p", NOT_UTF8]
    elif source == "-p -":
        prompt, stdin = ["-p", "-"], NOT_UTF8
    else:
        (tmp_path / "prompt.txt").write_bytes(NOT_UTF8)
        prompt = ["-f", str(tmp_path / "prompt.txt")]
    runs = {}
    for quiet in ((), ("-q",)):
        proc = bmoe("run", "-m", model, *prompt, "-n", "3", "-c", "256", "--json", *quiet, stdin=stdin)
        assert proc.returncode == 0, proc.stderr
        runs[quiet] = proc
    warned = [line for line in runs[()].stderr.splitlines() if b"not valid UTF-8" in line]
    assert warned == [WARNING], runs[()].stderr
    assert b"not valid UTF-8" not in runs[("-q",)].stderr, "-q: only the text and errors"
    replaced = bmoe("run", "-m", model, "-p", NOT_UTF8.decode("utf-8", "replace"), "-n", "3", "-c", "256", "--json")
    assert replaced.returncode == 0 and b"UTF-8" not in replaced.stderr, replaced.stderr
    want = {k: json.loads(replaced.stdout)[k] for k in ("tokens", "prompt_tokens")}
    for proc in runs.values():  # the same prompt: invalid bytes became U+FFFD
        assert {k: json.loads(proc.stdout)[k] for k in want} == want


@pytest.mark.pure
def test_inspect_cannot_run_names_what_it_compares(tiny) -> None:
    """``bmoe inspect --ram 0.3`` said "the dense part + one token's working set exceed the RAM"
    when those two fit: the margin and the interpreter's allowance are what did not."""
    from bmoe.inspect import MiB, inspect_model
    from bmoe.pipeline.budget import INTERPRETER_GROWTH, margin_bytes

    path = tiny.path(TinySpec())
    ram = int(0.3 * (1 << 30))
    r = inspect_model(path, ram_bytes=ram)
    assert r.dense_bytes + r.bytes_per_token_cache_off < ram  # what the old line said did not fit
    assert r.verdict == "cannot run", r.verdict_why
    margin = margin_bytes(ram)
    assert margin == 256 * MiB  # 3 % of 0.3 GiB is below the floor
    why = r.verdict_why
    assert "margin (3 % of the RAM given, at least 256 MiB)" in why and "interpreter's allowance" in why, why
    assert f"+ {margin // MiB} + {INTERPRETER_GROWTH // MiB} +" in why, why
    assert why.endswith(f"> {ram // MiB} MiB"), why
    fits = inspect_model(path, ram_bytes=8 << 30)
    assert fits.verdict == "resident" and "<= 8192 MiB" in fits.verdict_why, fits.verdict_why


@pytest.mark.pure
def test_the_errors_the_docs_name_are_importable_from_bmoe() -> None:
    """The README names ``ComputeBusyError`` and ``ConfigError`` beside ``SessionClosedError``;
    only ``BmoeError`` and ``SessionClosedError`` were importable from ``bmoe``."""
    import re
    from pathlib import Path

    import bmoe
    import bmoe.errors

    root = Path(bmoe.__file__).parent.parent
    named = set()
    for doc in ("README.md", "docs/robustness.md"):
        named |= set(re.findall(r"`(\w+(?:Error|Cancelled))`", (root / doc).read_text()))
    assert {"ComputeBusyError", "ConfigError", "SessionClosedError", "BmoeError", "ReadError"} <= named
    for name in named:
        assert getattr(bmoe, name) is getattr(bmoe.errors, name), name
    every = {n for n, v in vars(bmoe.errors).items() if isinstance(v, type) and issubclass(v, bmoe.errors.BmoeError)}
    assert every <= set(bmoe.__all__) and every <= set(dir(bmoe))
    exec(f"from bmoe import {', '.join(sorted(every))}", {})


@pytest.mark.pure
def test_make_tiny_help_lists_the_archs_it_writes() -> None:
    """``make-tiny --help`` names its --arch choices from the recipes: the two lists must agree."""
    from bmoe.synth.tiny import ARCHS
    from tests.helpers import cli

    out = cli("make-tiny", "--help")
    assert out.returncode == 0, out.stderr
    text = " ".join(out.stdout.split())
    listed = text.split("--arch ARCH architecture, one of ", 1)[1].split(" (default:", 1)[0]
    import re

    listed = re.sub(r"(\w)- (\w)", r"\1-\2", listed)  # argparse wraps lines at a name's hyphen
    assert sorted(listed.split(", ")) == sorted(ARCHS), listed

