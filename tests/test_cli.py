"""The command line as a user meets it: JSON output, and bad input ending as one line and exit 1
(never a traceback, never a signal from inside llama.cpp)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bmoe.synth.tiny import TinySpec
from tests.helpers import PROMPT, bmoe


def test_run_json_has_the_documented_keys_and_matches_resident(tiny) -> None:
    path = tiny.path(TinySpec(wtype="q8_0"))
    out = {}
    for mode in ("--stream", "--resident"):
        proc = bmoe("run", "-m", str(path), "-p", PROMPT, "-n", "12", mode, "--json", "-c", "256")
        assert proc.returncode == 0, proc.stderr
        out[mode] = json.loads(proc.stdout)
    streamed = out["--stream"]
    for key in ("text", "tokens", "n_tokens", "tok_per_s", "experts_read", "bytes_read", "mode"):
        assert key in streamed
    assert streamed["mode"] == "stream" and streamed["experts_read"] > 0
    assert out["--resident"]["experts_read"] is None  # unmeasured, not zero
    assert streamed["tokens"] == out["--resident"]["tokens"]


def test_make_tiny_writes_a_loadable_split_set(tmp_path: Path) -> None:
    proc = bmoe("make-tiny", str(tmp_path / "m.gguf"), "--arch", "gemma4", "--shards", "2")
    assert proc.returncode == 0, proc.stderr
    first = Path(proc.stdout.strip())
    assert first.name == "m-00001-of-00002.gguf" and first.exists()
    run = bmoe("run", "-m", str(first), "-p", PROMPT, "-n", "4", "--json", "-c", "256")
    assert run.returncode == 0, run.stderr


def _without_key(src: Path, dst: Path, key: str) -> None:
    """Rewrite a GGUF with one metadata key dropped (one that makes llama.cpp abort when absent)."""
    from gguf import GGUFReader, GGUFValueType, GGUFWriter

    reader = GGUFReader(src)
    arch = str(reader.fields["general.architecture"].contents())
    writer = GGUFWriter(dst, arch)
    for name, field in reader.fields.items():
        if name == key or name.startswith("GGUF.") or name == "general.architecture":
            continue
        vtype = field.types[0]
        sub_type = field.types[-1] if vtype == GGUFValueType.ARRAY else None
        writer.add_key_value(name, field.contents(), vtype, sub_type=sub_type)
    for t in reader.tensors:
        writer.add_tensor(t.name, t.data, raw_shape=list(reversed(t.shape.tolist())), raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("case", ["missing", "not_gguf", "truncated", "no_expert_count", "later_shard"])
def test_bad_input_is_one_line_and_exit_1(tiny, tmp_path: Path, case: str) -> None:
    good = tiny.path(TinySpec())
    if case == "missing":
        target = tmp_path / "absent.gguf"
    elif case == "not_gguf":
        target = tmp_path / "text.gguf"
        target.write_text("hello, not a model\n" * 10)
    elif case == "truncated":
        target = tmp_path / "cut.gguf"
        target.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    elif case == "no_expert_count":
        target = tmp_path / "nokey.gguf"
        _without_key(good, target, "qwen3moe.expert_count")
    else:
        split = tiny.path(TinySpec(shards=3))
        target = split.with_name(split.name.replace("00001-of", "00002-of"))
    proc = bmoe("run", "-m", str(target), "-p", PROMPT, "-n", "4")
    assert proc.returncode == 1, (proc.returncode, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("bmoe: error: "), proc.stderr
    assert "Traceback" not in proc.stderr
