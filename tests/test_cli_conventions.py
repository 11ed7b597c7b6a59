"""CLI conventions: --version, prompts from stdin and files, sampling and grammar flags, | head,
-q, a flag that does nothing in the chosen mode, and bad sampling values as one line."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from bmoe.synth.tiny import TinySpec
from tests.helpers import CLI_TIMEOUT_S as GUARD_S
from tests.helpers import bmoe, cli, one_line

BMOE = [sys.executable, "-m", "bmoe.cli"]


@pytest.mark.pure
def test_version() -> None:
    r = bmoe("--version")
    assert r.returncode == 0 and r.stdout.startswith("bmoe ") and "llama-cpp-python" in r.stdout
    m = subprocess.run([sys.executable, "-m", "bmoe", "--version"], capture_output=True, text=True, timeout=GUARD_S)
    assert (m.returncode, m.stdout) == (0, r.stdout), "python -m bmoe is the same command line"


def test_prompt_from_stdin_and_file_give_the_same_run(tiny, tmp_path) -> None:
    path = tiny.path(TinySpec())
    (tmp_path / "p.txt").write_text("The same prompt")
    a = bmoe("run", "-m", str(path), "-p", "-", "-n", "6", "--json", stdin="The same prompt")
    b = bmoe("run", "-m", str(path), "-f", str(tmp_path / "p.txt"), "-n", "6", "--json")
    c = bmoe("run", "-m", str(path), "-p", "The same prompt", "-n", "6", "--json")
    ra, rb, rc = (json.loads(x.stdout) for x in (a, b, c))
    assert ra["tokens"] == rb["tokens"] == rc["tokens"]
    assert ra["finish_reason"] == "length" and ra["prompt_tokens_evaluated"] == ra["prompt_tokens"]


def test_seeded_sampling_flags_and_json_schema(tiny, tmp_path) -> None:
    path = tiny.path(TinySpec())
    flags = ["run", "-m", str(path), "-p", "x", "-n", "12", "-q", "--temp", "0.9", "--top-k", "30", "--top-p", "0.9",
             "--min-p", "0.05", "--repeat-penalty", "1.1"]
    one, two, other = bmoe(*flags, "--seed", "3"), bmoe(*flags, "--seed", "3"), bmoe(*flags, "--seed", "4")
    assert one.returncode == 0 and one.stdout == two.stdout != other.stdout
    assert one.stderr == "", "-q leaves only the text and errors"
    schema = '{"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}'
    r = bmoe("run", "-m", str(path), "-p", "x", "-n", "40", "-q", "--json-schema", schema, "--temp", "1", "--seed", "1")
    assert isinstance(json.loads(r.stdout)["ok"], bool)
    (tmp_path / "g.gbnf").write_text('root ::= "yes" | "no"')
    r = bmoe("run", "-m", str(path), "-p", "x", "-n", "10", "-q", "--grammar-file", str(tmp_path / "g.gbnf"))
    assert r.stdout.strip() in ("yes", "no")


def test_bad_sampling_values_are_one_line(tiny, tmp_path) -> None:
    path = tiny.path(TinySpec())
    for extra in (["--temp", "nan"], ["--top-p", "2"], ["--json-schema", "{oops"],
                  ["--grammar-file", str(tmp_path / "missing.gbnf")], ["--stop", ""], ["--temp", "1", "--seed", "-5"]):
        # Refused from the flags before the model opens: in process, but the empty stop string
        # (checked by the run) in a child.
        r = (bmoe if extra == ["--stop", ""] else cli)("run", "-m", str(path), "-p", "x", *extra)
        assert r.returncode == 1 and r.stderr.startswith("bmoe: error:"), (extra, r.stderr)
        assert len(r.stderr.splitlines()) == 1, (extra, r.stderr)
        assert extra[-2] in r.stderr or extra[0] == "--grammar-file", ("the flag is named", extra, r.stderr)
    r = bmoe("run", "-m", str(path), "-p", "x", "-n", "2", "--temp", "1", "--seed", "-1")
    assert r.returncode == 0, ("-1 is a fresh seed, as the server and llama.cpp read it", r.stderr)


def test_a_closed_stdout_ends_quietly(tiny) -> None:
    path = tiny.path(TinySpec())
    proc = subprocess.Popen([*BMOE, "run", "-m", str(path), "-p", "x", "-n", "200", "-c", "256"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.read(1)
    proc.stdout.close()  # what `| head -c 1` does
    err = proc.stderr.read().decode()
    assert proc.wait(GUARD_S) == 141 and "Traceback" not in err and "BrokenPipe" not in err


@pytest.mark.pure
@pytest.mark.parametrize("command", ["run", "chat", "serve"])
def test_a_flag_that_does_nothing_with_resident_is_refused(command: str) -> None:
    """``--resident --cache-mb N`` ran with no cache, said only as a warning that -q hid (issue 39):
    now one line and status 2, -q or not. The default budget (auto) given by no one is no conflict."""
    argv = (command, "-m", "m.gguf", *(("-p", "x") if command == "run" else ()), "--resident", "-q")
    line = one_line(cli(*argv, "--cache-mb", "64"), 2)
    assert line == "bmoe: error: --cache-mb does nothing with --resident (nothing is streamed): drop it, or stream"
    both = one_line(cli(*argv, "--io-threads", "4", "--cache-mb", "auto"), 2)
    assert "--io-threads, --cache-mb do nothing with --resident" in both, both
    from bmoe.cli import build_parser
    from bmoe.cli.flags import _config

    args = build_parser(list(argv)).parse_args(list(argv))  # the default budget is not "given"
    assert _config(args).mode == "resident"


def test_verbose_shows_llama_cpp_log_and_the_default_does_not(tiny) -> None:
    path = tiny.path(TinySpec())
    loud = bmoe("run", "-m", str(path), "-p", "x", "-n", "2", "-v")
    plain = bmoe("run", "-m", str(path), "-p", "x", "-n", "2")
    before = bmoe("-v", "run", "-m", str(path), "-p", "x", "-n", "2")  # -v before the command too
    assert loud.returncode == plain.returncode == before.returncode == 0, (loud.stderr, plain.stderr)
    assert "llama_model_loader" in loud.stderr and "llama_model_loader" in before.stderr
    assert "llama_" not in plain.stderr and plain.stdout == loud.stdout


def test_control_token_text_in_a_prompt_is_its_token(tiny) -> None:
    """A raw chat-formatted prompt reached the model as plain characters (``</s>`` as four tokens)
    from ``bmoe run``, ``create_completion`` and /v1/completions; llama-cli, llama-server and
    llama-cpp-python all read control-token text as the token."""
    from bmoe.engine.config import RunConfig
    from bmoe.engine.sync import SyncSession

    path = tiny.path(TinySpec())
    with SyncSession.open(path, RunConfig(mode="stream", n_ctx=256)) as s:
        prompt = "Hi</s>Hello world"  # the tiny vocabulary's EOS text
        parsed, plain = s.tokenize(prompt, special=True), s.tokenize(prompt)
        assert len(parsed) < len(plain), "the tiny vocabulary's EOS text is one control token"
        assert s.create_completion(prompt, max_tokens=2)["usage"]["prompt_tokens"] == len(parsed)
    r = bmoe("run", "-m", str(path), "-p", prompt, "-n", "2", "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["prompt_tokens"] == len(parsed)


def test_cache_sizes_under_1_mib_are_refused_by_either_flag(tiny) -> None:
    """``--cache-mb 1e-9`` ran with the cache quietly off and ``--cache-ceil-mb 0.5`` gave a 0.5 MiB
    cache, where ``--cache-mb 0.5`` was refused as a units mistake."""
    path = str(tiny.path(TinySpec()))
    for flags in (["--cache-mb", "1e-9"], ["--cache-mb", "0.5"], ["--cache-mb", "auto", "--cache-ceil-mb", "0.5"]):
        r = bmoe("run", "-m", path, "-p", "x", "-n", "1", *flags)
        assert r.returncode == 2 and "1 MiB" in r.stderr and len(r.stderr.splitlines()) == 1, (flags, r.stderr)
    assert bmoe("run", "-m", path, "-p", "x", "-n", "1", "--cache-mb", "0").returncode == 0
