"""Gates of ``--n-expert-used K``: K equal to the file's own k is byte-identical to the exact run;
a smaller K is deterministic and differs from it (the override reached llama.cpp); a K outside
1..k is one clear error before llama.cpp is asked."""

from __future__ import annotations

import pytest

from bmoe.engine.config import RunConfig
from bmoe.engine.session import Session
from bmoe.errors import ConfigError
from bmoe.synth.tiny import TinySpec
from tests.helpers import generate_tokens

SPEC = TinySpec(arch="qwen3moe", wtype="f32", n_expert=8, n_expert_used=4)


def _stream(**kw: object) -> RunConfig:
    return RunConfig(mode="stream", n_ctx=256, **kw)


@pytest.mark.parametrize("open_mode", ["user", "mmap-drop"])
def test_file_k_is_exact_and_smaller_k_differs_deterministically(tiny, open_mode: str) -> None:
    path = tiny.path(SPEC)
    exact = tiny.resident_tokens(path)
    assert len(set(exact)) >= 6, "fixture is degenerate; the gate would prove little"
    assert generate_tokens(path, _stream(open_mode=open_mode, n_expert_used=4)) == exact
    fewer = generate_tokens(path, _stream(open_mode=open_mode, n_expert_used=1))
    assert fewer != exact, "top-1 gave the top-4 tokens: the override never reached llama.cpp"
    assert generate_tokens(path, _stream(open_mode=open_mode, n_expert_used=1)) == fewer


def test_resident_and_streamed_agree_under_the_same_k(tiny) -> None:
    """The lever changes the model, not the streaming: streamed top-2 == resident top-2."""
    path = tiny.path(SPEC)
    resident = generate_tokens(path, RunConfig(mode="resident", n_ctx=256, n_expert_used=2))
    assert resident != tiny.resident_tokens(path)
    assert generate_tokens(path, _stream(n_expert_used=2)) == resident


def test_layout_follows_k(tiny) -> None:
    with Session.open(tiny.path(SPEC), _stream(n_expert_used=2, cache_bytes=None)) as s:
        assert s.layout.n_expert_used == 2


@pytest.mark.pure
@pytest.mark.parametrize("k", [5, 9])
def test_k_above_the_file_is_one_clear_error(tiny, k: int) -> None:
    with pytest.raises(ConfigError, match=r"n_expert_used must be 1\.\.4 \(the file's qwen3moe.expert_used_count\)"):
        Session.open(tiny.path(SPEC), _stream(n_expert_used=k))


@pytest.mark.pure
@pytest.mark.parametrize("k", [0, -1])
def test_k_below_one_is_refused_by_the_config(k: int) -> None:
    with pytest.raises(ConfigError, match="n_expert_used must be at least 1"):
        RunConfig(n_expert_used=k)
