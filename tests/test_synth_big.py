"""``bmoe synth``: files with a real model's shapes load, decode non-degenerately and stream like
any other model, hold exactly the shape table's tensors, and are reproducible from their seed."""

from __future__ import annotations

import argparse
import asyncio
import hashlib
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from bmoe.engine.config import RunConfig
from bmoe.engine.session import Session
from bmoe.errors import ConfigError
from bmoe.io.layout import read_index
from bmoe.synth.big import (
    SynthSpec,
    add_synth_command,
    padded_vocab,
    planned,
    write_synth,
)
from bmoe.synth.families import FAMILIES
from bmoe.synth.shapes import SHAPES, MoeShape, get_shape
from bmoe.synth.vocab import CONTROL_IDS

PROMPT = "It is the sea."  # 8 tokens with BOS: a short prefill
N_TOKENS = 8
GGML_TYPE = {"f32": 0, "q4_0": 2, "q8_0": 8}


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Iterator:
    """``--like qwen3-30b-a3b --layers 2`` per type, written once (1.3-1.9 GB each), deleted after."""
    folder = tmp_path_factory.mktemp("synth")
    paths: dict[str, Path] = {}

    def get(wtype: str) -> Path:
        if wtype not in paths:
            paths[wtype] = write_synth(folder / f"{wtype}.gguf",
                                       SynthSpec(like="qwen3-30b-a3b", n_layer=2, wtype=wtype))
        return paths[wtype]

    yield get
    for p in paths.values():
        p.unlink(missing_ok=True)


def generate(path: Path, mode: str) -> list[int]:
    async def go() -> list[int]:
        with Session.open(path, RunConfig(mode=mode, n_ctx=256)) as s:
            return (await s.generate(PROMPT, N_TOKENS, stop_at_end=False)).tokens

    return asyncio.run(go())


@pytest.mark.parametrize("wtype", ["q8_0", "q4_0"])
def test_loads_decodes_and_streams_like_resident(model, wtype: str) -> None:
    path = model(wtype)
    resident = generate(path, "resident")
    assert len(resident) == N_TOKENS
    assert len(set(resident)) >= N_TOKENS - 3, resident
    assert len(set(resident[-6:])) > 2, f"ends in a loop of at most two tokens: {resident}"
    assert not set(resident) & set(CONTROL_IDS)
    assert generate(path, "stream") == resident


def expected_shapes(shape: MoeShape, n_layer: int, wtype: str) -> dict[str, tuple[tuple[int, ...], str]]:
    """From the table alone, in ggml order (ne[0] innermost): every tensor llama.cpp loads."""
    E, F, X = shape.n_embd, shape.n_ff_exp, shape.n_expert
    out = {
        "token_embd.weight": ((E, shape.n_vocab), "q8_0"),
        "output_norm.weight": ((E,), "f32"),
        "output.weight": ((E, shape.n_vocab), "q8_0"),
    }
    for il in range(n_layer):
        p = f"blk.{il}."
        out |= {
            p + "attn_norm.weight": ((E,), "f32"),
            p + "attn_q.weight": ((E, shape.n_head * shape.head_dim), "q8_0"),
            p + "attn_k.weight": ((E, shape.n_head_kv * shape.head_dim), "q8_0"),
            p + "attn_v.weight": ((E, shape.n_head_kv * shape.head_dim), "q8_0"),
            p + "attn_output.weight": ((shape.n_head * shape.head_dim, E), "q8_0"),
            p + "ffn_norm.weight": ((E,), "f32"),
            p + "ffn_gate_inp.weight": ((E, X), "f32"),
            p + "ffn_gate_exps.weight": ((E, F, X), wtype),
            p + "ffn_up_exps.weight": ((E, F, X), wtype),
            p + "ffn_down_exps.weight": ((F, E, X), wtype),
        }
        if shape.qkv_bias:
            out |= {p + f"attn_{x}.bias": ((n * shape.head_dim,), "f32")
                    for x, n in (("q", shape.n_head), ("k", shape.n_head_kv), ("v", shape.n_head_kv))}
        else:
            out |= {p + "attn_q_norm.weight": ((shape.head_dim,), "f32"),
                    p + "attn_k_norm.weight": ((shape.head_dim,), "f32")}
        if shape.n_ff_shexp:
            S = shape.n_ff_shexp
            out |= {p + "ffn_gate_inp_shexp.weight": ((E,), "f32"),
                    p + "ffn_gate_shexp.weight": ((E, S), "q8_0"),
                    p + "ffn_up_shexp.weight": ((E, S), "q8_0"),
                    p + "ffn_down_shexp.weight": ((S, E), "q8_0")}
    return out


@pytest.mark.pure
def test_written_file_matches_the_shape_table(model) -> None:
    shape = get_shape("qwen3-30b-a3b")
    index = read_index(model("q4_0"))
    got = {t.name: (t.ne, t.ggml_type) for t in index.tensors}
    want = {k: (ne, GGML_TYPE[t]) for k, (ne, t) in expected_shapes(shape, 2, "q4_0").items()}
    assert got == want
    m, a = index.metadata, shape.arch
    assert m["general.architecture"] == a
    assert (m[f"{a}.embedding_length"], m[f"{a}.block_count"], m[f"{a}.expert_count"],
            m[f"{a}.expert_used_count"], m[f"{a}.expert_feed_forward_length"]) == (2048, 2, 128, 8, 768)
    assert (m[f"{a}.attention.head_count"], m[f"{a}.attention.head_count_kv"],
            m[f"{a}.attention.key_length"], m[f"{a}.rope.freq_base"]) == (32, 4, 128, 1e6)


@pytest.mark.pure
@pytest.mark.parametrize("name", sorted(n for n, s in SHAPES.items() if s.arch not in FAMILIES))
def test_plans_match_the_shape_table(name: str) -> None:
    shape = get_shape(name)
    _, vocab, tensors = planned(SynthSpec(like=name, n_layer=3, wtype="q8_0"))
    inv = {v: k for k, v in GGML_TYPE.items()}
    got = {t.name: (tuple(reversed(t.shape)), inv[int(t.qtype)]) for t in tensors}
    assert got == expected_shapes(shape, 3, "q8_0")
    assert len(vocab) == shape.n_vocab
    full = planned(SynthSpec(like=name))[2]
    assert sum(t.name.endswith("ffn_norm.weight") for t in full) == shape.n_layer


def _first_chunks(spec: SynthSpec) -> dict[str, str]:
    return {t.name: hashlib.blake2b(next(t.chunks()).tobytes(), digest_size=16).hexdigest()
            for t in planned(spec)[2]}


@pytest.mark.pure
def test_deterministic_per_seed(model) -> None:
    spec = SynthSpec(like="qwen3-30b-a3b", n_layer=2, wtype="q4_0")
    a = _first_chunks(spec)
    assert a == _first_chunks(spec)
    b = _first_chunks(SynthSpec(like="qwen3-30b-a3b", n_layer=2, wtype="q4_0", seed=1))
    random_tensors = [k for k in a if not k.endswith("norm.weight")]
    assert all(a[k] != b[k] for k in random_tensors)
    # The file holds exactly what the generators make, wherever a tensor sits in it.
    path = model("q4_0")
    spans = {t.name: t for t in read_index(path).tensors}
    tensors = {t.name: t for t in planned(spec)[2]}
    with open(path, "rb") as f:
        for name in ("token_embd.weight", "output.weight", "blk.0.attn_output.weight",
                     "blk.0.ffn_gate_inp.weight", "blk.1.ffn_down_exps.weight", "output_norm.weight"):
            first = next(tensors[name].chunks())
            f.seek(spans[name].offset)
            assert f.read(first.nbytes) == first.tobytes(), name
        f.seek(0, 2)
        end = f.tell()
    last = max(spans.values(), key=lambda t: t.offset)
    assert end == last.offset + last.nbytes + (-(last.offset + last.nbytes) % 32)


@pytest.mark.pure
def test_vocab_is_padded_to_the_real_size() -> None:
    vocab = padded_vocab(151936)
    assert len(vocab) == 151936 and len(set(vocab.tokens)) == 151936


@pytest.mark.pure
def test_unknown_like_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"unknown model 'qwen9-moe'.*qwen1\.5-moe-a2\.7b.*qwen3-30b-a3b"):
        write_synth(tmp_path / "x.gguf", SynthSpec(like="qwen9-moe"))
    assert not list(tmp_path.iterdir())
    parser = argparse.ArgumentParser()
    add_synth_command(parser.add_subparsers())
    args = parser.parse_args(["synth", str(tmp_path / "x.gguf"), "--like", "qwen9-moe"])
    with pytest.raises(ConfigError, match="unknown model"):
        args.func(args)
    for bad in ({"n_layer": 0}, {"wtype": "f16"}, {"seed": -1}, {"n_expert_used": 129},
                {"route_drift": -0.1}, {"route_drift": float("nan")}, {"route_drift": 0.3, "skew": False}):
        with pytest.raises(ConfigError):
            SynthSpec(like="qwen3-30b-a3b", **bad).validate()
    with pytest.raises(ConfigError, match="residual stream's measured RMS"):
        SynthSpec(like="qwen1.5-moe-a2.7b", route_drift=0.3).validate()
    with pytest.raises(ConfigError, match="leading dense block"):  # wrote 0.5 GiB with no experts in it
        SynthSpec(like="deepseek-v2-lite", n_layer=1, skew=False).validate()
    SynthSpec(like="deepseek-v2-lite", n_layer=2, skew=False).validate()
    with pytest.raises(ConfigError, match="at least 4"):  # wrote 3 GB that bmoe refused: no block attends
        SynthSpec(like="qwen3.5-35b-a3b", n_layer=3, skew=False).validate()
    SynthSpec(like="qwen3.5-35b-a3b", n_layer=4, skew=False).validate()


def predicted(path: Path) -> tuple[list[int], dict[int, float]]:
    """Greedy tokens streamed with the decode's read-ahead, and its per-layer scores."""
    async def go() -> tuple[list[int], dict[int, float]]:
        config = RunConfig(mode="stream", n_ctx=256, cache_bytes=1 << 30, predict_prefetch=True,
                           predict_prompt=False)
        with Session.open(path, config) as s:
            g = await s.generate(PROMPT, N_TOKENS, stop_at_end=False)
            return g.tokens, g.stats.predict_accuracy_pct

    return asyncio.run(go())


def test_route_drift_makes_the_one_layer_early_guess_fallible(tmp_path: Path) -> None:
    """With no drift (gamma 0) nothing between two routers changes what they read, so each
    layer's routing is predicted from the previous layer's input without a miss; with drift the
    guess misses some experts, and the tokens stay the resident run's."""
    def spec(gamma: float) -> SynthSpec:
        return SynthSpec(like="qwen3-30b-a3b", n_layer=3, wtype="q4_0", route_drift=gamma)

    exact = write_synth(tmp_path / "exact.gguf", spec(0.0))
    assert predicted(exact)[1] == {1: 100.0, 2: 100.0}
    exact.unlink()
    path = write_synth(tmp_path / "drift.gguf", spec(0.5))
    tokens, drift = predicted(path)
    assert set(drift) == {1, 2}
    assert all(30.0 < pct < 95.0 for pct in drift.values()), drift
    assert tokens == generate(path, "resident")


@pytest.mark.pure
def test_quant_blocks_have_the_intended_scale() -> None:
    from gguf.quants import dequantize

    from bmoe.synth.big import Q4_0, Q8_0, random_blocks

    for qtype in (Q8_0, Q4_0):
        raw = random_blocks(np.random.SFC64(0), 4096, qtype, 0.02)
        w = dequantize(raw, qtype)
        assert np.isfinite(w).all()
        assert abs(w.std() / 0.02 - 1) < 0.02
        assert abs(w.mean()) < 0.02 * 0.02


@pytest.mark.pure
@pytest.mark.parametrize("direct", [True, False])
def test_sink_appends_exactly_what_it_is_given(tmp_path: Path, direct: bool) -> None:
    from bmoe.synth.big import _Sink

    path = tmp_path / "f.bin"
    path.write_bytes(b"header" * 1001)  # an unaligned tail to rewrite under O_DIRECT
    rng = np.random.default_rng(0)
    parts = [rng.integers(0, 256, n, dtype=np.uint8) for n in (1, 5000, (16 << 20) + 3, 40000)]
    with _Sink(path, direct=direct) as sink:
        for part in parts:
            sink.write(part)
        sink.write(bytes(13))
    assert path.read_bytes() == b"header" * 1001 + b"".join(p.tobytes() for p in parts) + bytes(13)


# --- the families' real shapes (loaded and decoded on the pin at 2-4 layers when added; too big to
# --- write in the suite, so the plan itself is checked against the published counts and widths)



def _plan(like: str, layers: int | None = None) -> dict[str, tuple]:  # noqa: ANN001
    shape, _, tensors = planned(SynthSpec(like=like, n_layer=layers, skew=False))
    return {t.name: (t.shape, t.qtype.name) for t in tensors}


@pytest.mark.pure
def test_gpt_oss_120b_plan_has_mxfp4_experts_and_f32_biases() -> None:
    plan = _plan("gpt-oss-120b")
    assert plan["blk.35.ffn_gate_exps.weight"] == ((128, 2880, 2880), "MXFP4")
    assert plan["blk.35.ffn_down_exps.bias"] == ((128, 2880), "F32")
    assert plan["blk.0.attn_sinks.weight"] == ((64,), "F32")
    assert "blk.36.attn_norm.weight" not in plan
    assert _plan("gpt-oss-20b")["blk.23.ffn_up_exps.weight"] == ((32, 2880, 2880), "MXFP4")


@pytest.mark.pure
def test_glm_45_air_plan_has_a_dense_lead_and_an_mtp_block() -> None:
    plan = _plan("glm-4.5-air")
    assert plan["blk.0.ffn_gate.weight"][0] == (10944, 4096) and "blk.0.ffn_gate_exps.weight" not in plan
    assert plan["blk.45.ffn_down_exps.weight"][0] == (128, 4096, 1408)
    assert plan["blk.46.nextn.eh_proj.weight"][0] == (4096, 8192)  # the MTP block after 46 main ones
    assert plan["blk.46.ffn_gate_exps.weight"][0] == (128, 1408, 4096)


@pytest.mark.pure
def test_deepseek_v2_lite_and_qwen35_plans() -> None:
    ds = _plan("deepseek-v2-lite")
    assert ds["blk.1.attn_q.weight"][0] == (16 * 192, 2048) and "blk.1.attn_q_a.weight" not in ds
    assert ds["blk.26.ffn_up_exps.weight"][0] == (64, 1408, 2048)
    assert ds["blk.26.ffn_up_shexp.weight"][0] == (2816, 2048)
    q = _plan("qwen3.5-35b-a3b")
    assert q["blk.0.ssm_conv1d.weight"][0] == (2 * 128 * 16 + 128 * 32, 4)  # linear block
    assert q["blk.3.attn_q.weight"][0] == (2 * 16 * 256, 2048)  # every 4th block attends
    assert q["blk.39.ffn_gate_exps.weight"][0] == (256, 512, 2048)
    assert "blk.40.nextn.eh_proj.weight" in q


@pytest.mark.pure
def test_file_name_changes_with_what_the_bytes_depend_on() -> None:
    base = SynthSpec(like="qwen3-30b-a3b", n_layer=8, wtype="q4_0")
    names = {s.file_name() for s in (base, SynthSpec(like="qwen3-30b-a3b", n_layer=8, wtype="q4_0", seed=1),
                                     SynthSpec(like="qwen3-30b-a3b", n_layer=8, wtype="q4_0", route_drift=0.0),
                                     SynthSpec(like="qwen3-30b-a3b", n_layer=8, wtype="q8_0"),
                                     SynthSpec(like="qwen3-30b-a3b", n_layer=8, wtype="q4_0", skew=False))}
    assert len(names) == 5 and base.file_name() == "synth-qwen3-30b-a3b-l8-q4_0-drift0.2.gguf"


@pytest.mark.pure
def test_a_link_left_at_the_temporary_name_is_never_written_through(tmp_path) -> None:
    """``OUT.partial`` was opened as it was: a link there had its target truncated and replaced by
    the model, and the link itself renamed to OUT."""
    precious = tmp_path / "precious.gguf"
    precious.write_bytes(b"keep me")
    (tmp_path / "out.gguf.partial").symlink_to(precious)
    out = write_synth(tmp_path / "out.gguf", SynthSpec(like="qwen3-30b-a3b", n_layer=2, wtype="q4_0"))
    assert precious.read_bytes() == b"keep me"
    assert not out.is_symlink() and out.stat().st_size > 1 << 20
