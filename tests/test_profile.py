"""Cache profiles (--cache-profile): the file round-trips, a bad one is one line, and a run seeded
from a profile gives the cold run's tokens (and the resident ones) while its cache starts warm."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import numpy as np
import pytest

from bmoe.engine.config import MiB, RunConfig
from bmoe.errors import ConfigError
from bmoe.pipeline.cache import ExpertCache
from bmoe.pipeline.policies import AdaptiveReusePolicy
from bmoe.pipeline.profile import load_profile, prewarm_order, save_profile
from bmoe.synth.tiny import TinySpec
from tests.helpers import generate_tokens

SPEC = TinySpec(n_embd=256, n_ff=256, n_layer=3)


@pytest.mark.pure
def test_profile_round_trips(tmp_path: Path) -> None:
    usage = {0: np.linspace(0, 1, 8), 2: np.zeros(8)}
    path = tmp_path / "m.profile.json"
    save_profile(path, usage, model="m.gguf", n_layer=3, n_expert=8, tokens=5, visits=7.25)
    loaded = load_profile(path, n_layer=3, n_expert=8)
    back = loaded.usage
    assert set(back) == {0, 2} and np.allclose(back[0], usage[0], atol=1e-5) and not back[2].any()
    assert loaded.visits == 7.2  # kept to a tenth
    doc = json.loads(path.read_text())
    assert (doc["format"], doc["version"], doc["tokens"]) == ("bmoe-cache-profile", 1, 5)
    older = {k: v for k, v in doc.items() if k != "visits"}  # written before "visits": its tokens
    path.write_text(json.dumps(older))
    assert load_profile(path, n_layer=3, n_expert=8).visits == 5
    with pytest.raises(ConfigError, match="3 layers x 8 experts, this model has 4 x 8"):
        load_profile(path, n_layer=4, n_expert=8)
    for bad in ("", "{}", "[1]", json.dumps(doc | {"layers": {"9": [0] * 8}}),
                json.dumps(doc | {"layers": {"0": [float("nan")] * 8}}), json.dumps(doc | {"layers": {"0": [2] * 8}}),
                json.dumps(doc | {"visits": -1}), json.dumps(doc | {"visits": "many"}), json.dumps(doc | {"visits": True})):
        path.write_text(bad)
        with pytest.raises(ConfigError):
            load_profile(path, n_layer=3, n_expert=8)


@pytest.mark.pure
def test_a_profile_to_a_device_is_written_in_place_never_renamed_over_it(full_device: str, tmp_path: Path) -> None:
    """The profile goes through a temporary file renamed over its name: over a device that rename
    would replace the device (run as root, /dev/null itself). A device is written where it is."""
    with pytest.raises(ConfigError, match="No space left on device"):
        save_profile(full_device, {0: np.zeros(8)}, model="m.gguf", n_layer=1, n_expert=8, tokens=1, visits=1)
    assert stat.S_ISCHR(os.stat(full_device).st_mode)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
    try:
        save_profile(fifo, {0: np.zeros(8)}, model="m.gguf", n_layer=1, n_expert=8, tokens=1, visits=1)
        assert json.loads(os.read(reader, 1 << 16))["format"] == "bmoe-cache-profile"
    finally:
        os.close(reader)
    assert stat.S_ISFIFO(os.stat(fifo).st_mode)


@pytest.mark.pure
def test_a_policy_seeded_from_its_own_usage_starts_warm() -> None:
    """Routing with a hot expert per layer: seeded, the policy keeps the hot ones from the start."""
    rng = np.random.default_rng(0)
    routing = [[(0, int(rng.integers(1, 64))) for _ in range(4)] for _ in range(40)]

    def run(policy: AdaptiveReusePolicy) -> int:
        cache = ExpertCache(300, {il: 100 for il in range(4)}, policy)
        hits = 0
        for token in routing:
            for il, experts in enumerate(token):
                hits += len(cache.plan(il, experts).hits)
            cache.trim()
        return hits

    cold = AdaptiveReusePolicy()
    cold_hits = run(cold)
    seeded = AdaptiveReusePolicy()
    seeded.seed(cold.usage(), visits=cold.evidence())
    assert run(seeded) >= cold_hits
    assert cold.steps == 40 and all(u.argmax() == 0 for u in cold.usage().values())


@pytest.mark.pure
def test_usage_is_a_per_token_chance_whatever_the_runs_length() -> None:
    """The slowest rate is a 1024-visit average started at zero: after 40 visits it holds 4 % of
    an always-routed expert's chance. ``usage`` corrects that (the hot expert is 1.0, a layer sums
    to its top-k), ``evidence`` says how many visits it rests on, and a run seeded from a profile
    adds its own visits to the profile's rather than starting the count again."""
    rng = np.random.default_rng(0)
    routing = [[(0, *map(int, rng.choice(np.arange(1, 16), 3, replace=False))) for _ in range(2)]
               for _ in range(40)]

    def run(policy: AdaptiveReusePolicy) -> AdaptiveReusePolicy:
        cache = ExpertCache(10**9, {0: 100, 1: 100}, policy)
        for token in routing:
            for il, experts in enumerate(token):
                cache.plan(il, experts)
            cache.trim()
        return policy

    cold = run(AdaptiveReusePolicy())
    usage = cold.usage()
    assert all(u[0] == pytest.approx(1.0) and u.sum() == pytest.approx(4.0) for u in usage.values())
    assert cold.evidence() == pytest.approx(40.0)
    again = AdaptiveReusePolicy()
    again.seed(usage, visits=cold.evidence())
    assert again.evidence() == pytest.approx(40.0)  # seeded, nothing routed yet: the profile's
    run(again)
    assert again.evidence() == pytest.approx(80.0)
    assert all(u[0] == pytest.approx(1.0) and u.sum() == pytest.approx(4.0) for u in again.usage().values())
    with pytest.raises(ValueError, match="visits"):
        AdaptiveReusePolicy().seed(usage, visits=float("nan"))


def test_seeded_run_gives_the_cold_runs_tokens(tiny, tmp_path: Path) -> None:  # noqa: ANN001
    path = tiny.path(SPEC)
    profile = tmp_path / "tiny.profile.json"
    config = RunConfig(n_ctx=256, cache_bytes=2 * MiB, cache_profile=str(profile))
    cold = generate_tokens(path, RunConfig(n_ctx=256, cache_bytes=2 * MiB))
    first = generate_tokens(path, config)  # no profile yet: cold, and it writes one
    assert profile.exists()
    saved = load_profile(profile, n_layer=SPEC.n_layer, n_expert=SPEC.n_expert).usage
    assert saved and all(v.sum() > 0 for v in saved.values())
    seeded = generate_tokens(path, config)
    assert first == cold == seeded == tiny.resident_tokens(path)
    # The negative control of these gates lives in tests/test_gates_stream.py (a skipped expert
    # changes the tokens); here the seeded policy must also have changed nothing about the cache's
    # contract: the same profile shape again.
    assert load_profile(profile, n_layer=SPEC.n_layer, n_expert=SPEC.n_expert).usage.keys() == saved.keys()


@pytest.mark.pure
def test_profile_at_the_models_path_is_refused(tiny) -> None:  # noqa: ANN001
    from bmoe.engine.session import Session
    from bmoe.errors import OutputPathError

    path = tiny.path(SPEC)
    before = path.read_bytes()
    with pytest.raises(OutputPathError):
        Session.open(path, RunConfig(n_ctx=256, cache_bytes=2 * MiB, cache_profile=str(path)))
    assert path.read_bytes() == before


@pytest.mark.pure
def test_prewarm_order_takes_the_most_used_that_fit() -> None:
    usage = {0: np.array([0.1, 0.0, 0.9, 0.5]), 1: np.array([0.8, 0.2, 0.0, 0.0]), 5: np.array([1.0, 1.0])}
    order = prewarm_order(usage, {0: 100, 1: 100}, 350)  # layer 5 has no experts here: skipped
    assert order == [(0, 2), (1, 0), (0, 3)]
    assert prewarm_order(usage, {0: 100, 1: 100}, 10_000) == [(0, 2), (1, 0), (0, 3), (1, 1), (0, 0)]
    assert prewarm_order(usage, {0: 100, 1: 100}, 99) == []


@pytest.mark.pure
def test_fill_admits_into_free_room_only() -> None:
    cache = ExpertCache(250, {0: 100}, AdaptiveReusePolicy())
    cache.plan(0, (1,))
    assert cache.fill((0, 2)) and not cache.fill((0, 2)), "resident already"
    assert not cache.fill((0, 3)), "no free room: nothing is evicted for a guess"
    assert cache.is_resident(0, 1) and cache.resident_bytes == 200


def test_prewarm_reads_the_profile_and_gives_the_resident_tokens(tiny, tmp_path: Path) -> None:  # noqa: ANN001
    """A prewarmed run reads the profile's experts ahead (counted) and gives the resident tokens,
    whole cache or evicting; the control, prewarm reads that land nothing, changes the tokens: the
    gate would catch a prewarmed expert used before its bytes are in place."""
    from bmoe.pipeline.hooks import Hooks

    path = tiny.path(SPEC)
    profile = tmp_path / "tiny.profile.json"
    generate_tokens(path, RunConfig(n_ctx=256, cache_bytes=64 * MiB, cache_profile=str(profile)))
    assert profile.exists()
    with pytest.raises(ConfigError, match="prewarm"):
        RunConfig(n_ctx=256, cache_bytes=64 * MiB, prewarm=True)  # no profile to read

    def counting(skip: bool):  # noqa: ANN202
        seen: list[object] = []

        def before_read(request) -> bool:  # noqa: ANN001
            if request.speculative:
                seen.append(request.key)
                return not skip
            return True

        return Hooks(before_read=before_read), seen

    for mib in (64, 2):
        hooks, seen = counting(skip=False)
        config = RunConfig(n_ctx=256, cache_bytes=mib * MiB, cache_profile=str(profile), prewarm=True)
        assert generate_tokens(path, config, hooks=hooks) == tiny.resident_tokens(path), mib
        assert seen, f"{mib} MiB: nothing was prewarmed"
    hooks, seen = counting(skip=True)
    config = RunConfig(n_ctx=256, cache_bytes=64 * MiB, cache_profile=str(profile), prewarm=True)
    assert generate_tokens(path, config, hooks=hooks) != tiny.resident_tokens(path)
    assert seen


@pytest.mark.pure
@pytest.mark.parametrize("edit", [
    lambda d: d["layers"].update({"\u00b2": [0.1] * 8}),  # isdigit() but not int(): an internal error
    lambda d: d["layers"].update({"00": [0.1] * 8}),  # layer 0 a second time, the last one winning
    lambda d: d["layers"].update({"1": [True] * 8}),  # booleans are not rates
])
def test_hand_edited_profiles_are_one_clear_line(tmp_path: Path, edit) -> None:  # noqa: ANN001
    path = tmp_path / "p.json"
    save_profile(path, {0: np.full(8, 0.25)}, model="m", n_layer=3, n_expert=8, tokens=4, visits=4)
    doc = json.loads(path.read_text())
    edit(doc)
    path.write_text(json.dumps(doc))
    with pytest.raises(ConfigError, match="p.json: layer"):
        load_profile(path, n_layer=3, n_expert=8)
    path.write_text("[" * 100_000 + "]" * 100_000)  # a RecursionError, not caught
    with pytest.raises(ConfigError, match="not a cache profile"):
        load_profile(path, n_layer=3, n_expert=8)
