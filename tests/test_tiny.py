"""The synthetic models every other gate builds on: they must load, decode non-degenerately, and
be exactly reproducible across writes, shard layouts and gemma4's two expert layouts."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFReader

from bmoe.llama.callback import EvalCallback
from bmoe.llama.loader import open_model
from bmoe.llama.seam import LlamaModel
from bmoe.errors import ConfigError
from bmoe.io.layout import read_layout
from bmoe.pipeline.gate import RoutingGate
from bmoe.synth.tiny import CORE_ARCHS as ARCHS  # the families: test_arch_gates
from bmoe.synth.tiny import TinySpec, write_tiny
from bmoe.synth.vocab import BOS_ID, CONTROL_IDS, EOS_ID, byte_vocab

llama_cpp = pytest.importorskip("llama_cpp")

WTYPES = ("f32", "f16", "q8_0")
PROMPT = "Hello world, this is a tiny test."  # 20 tokens + BOS with the byte vocabulary


def greedy(path: Path, n: int = 32, prompt: str = PROMPT) -> list[int]:
    """Argmax decoding (EOS masked) through plain llama.cpp: mmap load, no repacking, no bmoe
    callback installed; the reference every gate compares to.

    Not ``llama_cpp.Llama``: its default load repacks Q8_0 into the CPU's extra buffer types, and
    on AMX machines the pinned build's AMX path crashes (SIGSEGV) on these tiny shapes."""
    opened = open_model(read_layout(path), streaming=False)
    model = LlamaModel(opened, n_ctx=256, n_threads=2, callback=EvalCallback(RoutingGate()), install=False)
    try:
        model.decode(model.tokenize(prompt))
        out: list[int] = []
        for _ in range(n):
            logits = model.logits().copy()
            assert np.isfinite(logits).all()
            logits[EOS_ID] = -np.inf
            out.append(int(np.argmax(logits)))
            model.decode([out[-1]])
        return out
    finally:
        model.close()


def assert_not_degenerate(tokens: list[int]) -> None:
    assert len(set(tokens)) >= 6, tokens
    assert len(set(tokens[-12:])) > 2, f"ends in a loop of at most two tokens: {tokens}"


def field(reader: GGUFReader, key: str):
    return reader.fields[key].contents()


def tensor_bytes(paths: list[Path]) -> dict[str, bytes]:
    return {t.name: bytes(t.data.tobytes()) for p in paths for t in GGUFReader(p).tensors}


@pytest.mark.parametrize("wtype", WTYPES)
@pytest.mark.parametrize("arch", ARCHS)
def test_loads_and_decodes_non_degenerate(tmp_path: Path, arch: str, wtype: str) -> None:
    (path,) = write_tiny(tmp_path / "m.gguf", TinySpec(arch=arch, wtype=wtype))
    assert path.stat().st_size < 10 * 2**20
    assert_not_degenerate(greedy(path))


@pytest.mark.parametrize("spec", [
    TinySpec(),
    TinySpec(arch="gemma4", wtype="q8_0", shards=2, seed=3),
])
def test_same_spec_writes_identical_bytes(tmp_path: Path, spec: TinySpec) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    a = write_tiny(tmp_path / "a" / "m.gguf", spec)
    b = write_tiny(tmp_path / "b" / "m.gguf", spec)
    assert [p.name for p in a] == [p.name for p in b]
    assert all(x.read_bytes() == y.read_bytes() for x, y in zip(a, b))
    (c,) = write_tiny(tmp_path / "c.gguf", dataclasses.replace(spec, seed=spec.seed + 1, shards=1))
    assert tensor_bytes([c]) != tensor_bytes(a)


@pytest.mark.parametrize("arch", ARCHS)
def test_layout_and_keys(tmp_path: Path, arch: str) -> None:
    spec = TinySpec(arch=arch, n_embd=64, n_ff=32, n_expert=4, n_expert_used=2)
    (path,) = write_tiny(tmp_path / "m.gguf", spec)
    r = GGUFReader(path)
    assert field(r, "general.architecture") == arch
    assert field(r, f"{arch}.expert_count") == 4
    assert field(r, f"{arch}.expert_used_count") == 2
    ne = {t.name: [int(x) for x in t.shape] for t in r.tensors}
    for il in range(spec.n_layer):
        p = f"blk.{il}."
        if spec.fused:
            assert ne[p + "ffn_gate_up_exps.weight"] == [64, 64, 4]
            assert p + "ffn_gate_exps.weight" not in ne
        else:
            assert ne[p + "ffn_gate_exps.weight"] == [64, 32, 4]
            assert ne[p + "ffn_up_exps.weight"] == [64, 32, 4]
        assert ne[p + "ffn_down_exps.weight"] == [32, 64, 4]
    out = next(t for t in r.tensors if t.name == "output.weight").data
    assert not out[list(CONTROL_IDS)].any() and out[3:].any()


def test_vocab_tokenizes_any_utf8(tmp_path: Path) -> None:
    vocab = byte_vocab()
    assert len(set(vocab.tokens)) == len(vocab)
    (path,) = write_tiny(tmp_path / "m.gguf", TinySpec())
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=256, n_threads=2, verbose=False)
    try:
        assert (llm.token_bos(), llm.token_eos(), llm.n_vocab()) == (BOS_ID, EOS_ID, len(vocab))
        text = "héllo 世界 🙂\nnew\tline ÿ"
        tokens = llm.tokenize(text.encode())
        assert tokens[0] == BOS_ID
        assert llm.detokenize(tokens).decode() == text
    finally:
        llm.close()


@pytest.mark.parametrize("wtype", WTYPES)
def test_gemma4_fused_equals_unfused(tmp_path: Path, wtype: str) -> None:
    spec = TinySpec(arch="gemma4", wtype=wtype)
    (fused,) = write_tiny(tmp_path / "fused.gguf", spec)
    (split,) = write_tiny(tmp_path / "split.gguf", dataclasses.replace(spec, fuse_gate_up=False))
    f, s = tensor_bytes([fused]), tensor_bytes([split])
    # Same underlying weights: per expert, the gate rows then the up rows.
    for il in range(spec.n_layer):
        p = f"blk.{il}."
        gate_up = np.frombuffer(f.pop(p + "ffn_gate_up_exps.weight"), np.uint8).reshape(spec.n_expert, 2, -1)
        gate = np.frombuffer(s.pop(p + "ffn_gate_exps.weight"), np.uint8).reshape(spec.n_expert, -1)
        up = np.frombuffer(s.pop(p + "ffn_up_exps.weight"), np.uint8).reshape(spec.n_expert, -1)
        assert (gate_up[:, 0] == gate).all() and (gate_up[:, 1] == up).all()
    assert f == s
    assert greedy(fused) == greedy(split)


@pytest.mark.parametrize("arch", ARCHS)
def test_three_shards_equal_single_file(tmp_path: Path, arch: str) -> None:
    spec = TinySpec(arch=arch, wtype="q8_0")
    (single,) = write_tiny(tmp_path / "one.gguf", spec)
    shards = write_tiny(tmp_path / "set.gguf", dataclasses.replace(spec, shards=3))
    assert [p.name for p in shards] == [f"set-0000{i}-of-00003.gguf" for i in (1, 2, 3)]
    assert not (tmp_path / "set.gguf").exists()

    readers = [GGUFReader(p) for p in shards]
    n_tensors = sum(len(r.tensors) for r in readers)
    for i, r in enumerate(readers):
        assert (field(r, "split.no"), field(r, "split.count")) == (i, 3)
        assert field(r, "split.tensors.count") == n_tensors
        assert ("tokenizer.ggml.tokens" in r.fields) == (i == 0)
        assert any(t.name.endswith("_exps.weight") for t in r.tensors)
    assert tensor_bytes(shards) == tensor_bytes([single])
    assert greedy(shards[0]) == greedy(single)


def test_progress_counts_every_tensor(tmp_path: Path) -> None:
    calls: list[tuple[int, int]] = []
    files = write_tiny(tmp_path / "m.gguf", TinySpec(shards=2), lambda d, t: calls.append((d, t)))
    tensors = [t for p in files for t in GGUFReader(p).tensors]
    total = sum(int(t.n_bytes) for t in tensors)
    assert len(calls) == len(tensors)
    assert all(t == total for _, t in calls)
    done = [d for d, _ in calls]
    assert done == sorted(done) and done[-1] == total


@pytest.mark.parametrize("bad", [
    dict(arch="grovemoe"),  # no recipe
    dict(wtype="q4_0"),
    dict(n_layer=0),
    dict(arch="gemma4", n_layer=1),
    dict(n_embd=100),
    dict(n_ff=0),
    dict(n_expert=0),
    dict(n_expert_used=9),
    dict(n_expert_used=0),
    dict(seed=-1),
    dict(wtype="q8_0", n_ff=48),
    dict(wtype="q8_0", n_embd=80),
    dict(fuse_gate_up=True),
    dict(shards=0),
    dict(shards=7),  # 2 layers x 3 expert tensors
])
def test_invalid_spec_raises_config_error(tmp_path: Path, bad: dict) -> None:
    spec = TinySpec(**bad)
    with pytest.raises(ConfigError):
        spec.validate()
    with pytest.raises(ConfigError):
        write_tiny(tmp_path / "m.gguf", spec)
    assert not list(tmp_path.iterdir())
