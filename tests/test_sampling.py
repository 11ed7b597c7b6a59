"""Sampling through llama.cpp's sampler chain, grammars, logprobs, stop conditions and prompt reuse.

Seeded sampling answers to the same gate as greedy decoding: streamed == resident token for token
(cache off, and a cache so small it evicts every token), with a negative control (a routed expert
skipped) that shows the gate can fail under sampling too.
"""

from __future__ import annotations

import asyncio
import json
import re

import numpy as np
import pytest

from bmoe.engine.config import MiB, RunConfig
from bmoe.engine.sampling import SamplingParams
from bmoe.engine.session import Generation, Session
from bmoe.engine.stops import StopStrings
from bmoe.errors import ConfigError
from bmoe.synth.tiny import TinySpec
from tests.helpers import PROMPT
from tests.test_gates_stream import skip_top_expert

RESIDENT = RunConfig(mode="resident", n_ctx=256)
STREAM = RunConfig(mode="stream", n_ctx=256)
EVICTING = RunConfig(mode="stream", n_ctx=256, cache_bytes=MiB)
SAMPLED = SamplingParams(temperature=0.9, top_k=40, top_p=0.95, min_p=0.02, repeat_penalty=1.1, seed=7)
N = 20


def run(path, config: RunConfig, calls: list[tuple[object, dict]], hooks=None) -> list[Generation]:  # noqa: ANN001
    """Each (prompt, generate kwargs) in turn on one session."""

    async def go() -> list[Generation]:
        with Session.open(path, config, hooks=hooks) as session:
            return [await session.generate(p, kw.pop("n", N), **kw) for p, kw in calls]

    return asyncio.run(go())


def sampled(path, config: RunConfig, params: SamplingParams = SAMPLED, hooks=None) -> list[int]:  # noqa: ANN001
    return run(path, config, [(PROMPT, {"sampling": params, "stop_at_end": False})], hooks)[0].tokens


@pytest.mark.pure
@pytest.mark.parametrize("bad", [
    {"temperature": -1}, {"temperature": float("nan")}, {"top_p": 1.5}, {"top_k": -1}, {"top_k": 2.5},
    {"min_p": -0.1}, {"repeat_penalty": 0}, {"seed": -3}, {"seed": True}, {"logprobs": 99},
    {"grammar": ""}, {"grammar": "root ::= x", "json_object": True}, {"json_schema": "{not json"},
])
def test_sampling_params_refuse_bad_values(bad: dict) -> None:
    with pytest.raises(ConfigError):
        SamplingParams(**bad)


def test_default_sampling_is_greedy() -> None:
    assert SamplingParams().greedy
    assert not SamplingParams(temperature=0.5).greedy
    assert not SamplingParams(json_object=True).greedy


def test_seeded_sampling_streamed_equals_resident_and_seeds_matter(tiny) -> None:
    path = tiny.path(TinySpec())
    resident = sampled(path, RESIDENT)
    assert len(set(resident)) >= 6, "a degenerate draw would prove little"
    assert sampled(path, STREAM) == resident
    assert sampled(path, EVICTING) == resident
    assert sampled(path, RESIDENT) == resident, "the same seed twice gives the same tokens"
    other = SamplingParams(temperature=0.9, top_k=40, top_p=0.95, min_p=0.02, repeat_penalty=1.1, seed=8)
    assert sampled(path, RESIDENT, other) != resident, "another seed draws other tokens"
    assert sampled(path, RESIDENT, SamplingParams()) == tiny.resident_tokens(path)[:N], "greedy stays argmax"


def test_negative_control_missing_expert_changes_sampled_output(tiny) -> None:
    path = tiny.path(TinySpec())
    assert sampled(path, STREAM, hooks=skip_top_expert()) != sampled(path, RESIDENT)


def test_json_schema_output_parses_and_ends_with_the_grammar(tiny) -> None:
    path = tiny.path(TinySpec())
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"},
                                              "color": {"enum": ["red", "green", "blue"]}},
              "required": ["ok", "color"]}
    for seed in (1, 2):
        g = run(path, STREAM, [(PROMPT, {"n": 60, "sampling": SamplingParams(temperature=1.0, seed=seed,
                                                                             json_schema=schema)})])[0]
        assert g.finish_reason == "stop", g.text
        value = json.loads(g.text)
        assert isinstance(value["ok"], bool) and value["color"] in ("red", "green", "blue")


def test_gbnf_grammar_and_json_mode(tiny) -> None:
    path = tiny.path(TinySpec())
    gbnf = 'root ::= "answer: " [a-z]{3,6} "."'
    g, j = run(path, RESIDENT, [
        (PROMPT, {"n": 30, "sampling": SamplingParams(temperature=0.7, seed=3, grammar=gbnf)}),
        (PROMPT, {"n": 40, "sampling": SamplingParams(json_object=True)}),
    ])
    assert re.fullmatch(r"answer: [a-z]{3,6}\.", g.text), g.text
    if j.finish_reason == "stop":
        assert isinstance(json.loads(j.text), dict)
    else:  # greedy JSON can run to max_tokens inside a string: still a valid prefix of an object
        assert j.text.startswith("{")


def test_bad_grammar_is_one_clear_error(tiny) -> None:
    path = tiny.path(TinySpec())
    with pytest.raises(ConfigError, match="grammar"):
        run(path, RESIDENT, [(PROMPT, {"sampling": SamplingParams(grammar="root ::= (")})])


DEAD_END = """
import sys
from bmoe import RunConfig, SamplingParams, SyncSession
from bmoe.errors import ConfigError
with SyncSession.open(sys.argv[1], RunConfig(mode="resident", n_ctx=256)) as s:
    for grammar, temp in (('root ::= "\\\\x00"', 0.0), ('root ::= [a-z] "\\\\x00"', 0.8)):
        try:
            s.generate("Once upon a time", 8, sampling=SamplingParams(grammar=grammar, temperature=temp, seed=1))
        except ConfigError as e:
            print(getattr(e, "param", None), e)
    print(s.generate("Once upon a time", 3).finish_reason)
"""


def test_a_grammar_no_token_can_follow_is_an_error_not_an_abort(tiny) -> None:
    """Every logit -inf after the grammar: the chain still picked a token, and llama.cpp's grammar,
    accepting it, threw a C++ exception that terminated the process (status 134, a server with it)."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", DEAD_END, str(tiny.path(TinySpec()))],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.splitlines()
    assert lines[0] == "grammar the grammar allows no token of this model's vocabulary here (after 0 generated tokens)"
    assert lines[1].endswith("(after 1 generated tokens)") and lines[2] == "length", lines


def test_logprobs_are_the_models_distribution(tiny) -> None:
    path = tiny.path(TinySpec())
    g = run(path, RESIDENT, [(PROMPT, {"n": 5, "sampling": SamplingParams(logprobs=3), "stop_at_end": False})])[0]
    assert g.logprobs is not None and len(g.logprobs) == 5
    for tok, lp in zip(g.tokens, g.logprobs):
        assert lp.token == tok and len(lp.top) == 3
        assert lp.top[0][0] == tok and lp.top[0][1] == pytest.approx(lp.logprob), "greedy picks the top"
        assert lp.top[0][1] >= lp.top[1][1] >= lp.top[2][1] and lp.logprob <= 0
    assert g.tokens == tiny.resident_tokens(path)[:5]


@pytest.mark.pure
def test_stop_strings_unit() -> None:
    s = StopStrings(["\n\n", "END"])
    assert s.feed("ab\n") == "ab"  # "\n" might start "\n\n": held back
    assert s.feed("c E") == "\nc "
    assert s.feed("N") == ""
    assert s.feed("D and more") == "" and s.hit == "END"
    assert s.feed("x") == "" and s.flush() == ""
    t = StopStrings("xyz")
    assert t.feed("abx") == "ab" and t.flush() == "x"
    with pytest.raises(ConfigError):
        StopStrings([""])


def test_finish_reasons_and_a_stop_string_across_tokens(tiny) -> None:
    path = tiny.path(TinySpec())
    free = run(path, RESIDENT, [(PROMPT, {"n": N, "stop_at_end": False})])[0]
    assert free.finish_reason == "length" and free.usage.completion_tokens == N
    # A stop string that starts inside one token's text and ends inside a later one.
    pieces = []

    async def pieces_of() -> None:
        with Session.open(path, RESIDENT) as session:
            async for p in session.stream(PROMPT, N, stop_at_end=False):
                if p.token is not None:
                    pieces.append(session.detokenize([p.token]))

    asyncio.run(pieces_of())
    k = next(i for i in range(2, N - 2) if len(pieces[i]) >= 2 and len(pieces[i + 1]) >= 1)
    start = len("".join(pieces[:k])) + len(pieces[k]) - 1
    stop = free.text[start : start + 2]
    assert free.text.find(stop) == start, "pick a stop string whose first occurrence spans two tokens"
    g = run(path, STREAM, [(PROMPT, {"n": N, "stop": [stop], "stop_at_end": False})])[0]
    assert g.finish_reason == "stop"
    assert g.text == free.text[:start], "nothing at or past the stop string is emitted"
    assert g.usage.completion_tokens == k + 2
    # The end-of-generation token: a grammar that is complete after one word forces it.
    e = run(path, RESIDENT, [(PROMPT, {"n": N, "sampling": SamplingParams(grammar='root ::= "ok"')})])[0]
    assert (e.text, e.finish_reason) == ("ok", "stop")


def test_cancel_ends_with_finish_reason_cancelled(tiny) -> None:
    path = tiny.path(TinySpec())

    async def go() -> tuple[list[str | None], Generation]:
        with Session.open(path, STREAM) as session:
            reasons = []
            async for p in session.stream(PROMPT, 50, stop_at_end=False):
                if p.token is not None and len(reasons) == 2:
                    session.cancel()
                reasons.append(p.finish_reason)
            again = await session.generate(PROMPT, N, stop_at_end=False)
        return reasons, again

    reasons, again = asyncio.run(go())
    assert reasons[-1] == "cancelled" and len(reasons) == 4
    assert again.finish_reason == "length" and again.tokens == tiny.resident_tokens(path)[:N]


@pytest.mark.parametrize("config", [RESIDENT, STREAM, EVICTING], ids=["resident", "stream", "evicting"])
def test_prompt_reuse_evaluates_only_the_suffix_and_equals_a_fresh_session(tiny, config: RunConfig) -> None:
    path = tiny.path(TinySpec())
    follow = PROMPT + " And then the next turn asks for more of the same."
    first, second, third = run(path, config, [
        (PROMPT, {"stop_at_end": False}), (follow, {"stop_at_end": False}), (follow, {"stop_at_end": False}),
    ])
    fresh = run(path, config, [(follow, {"stop_at_end": False})])[0]
    off = run(path, RunConfig(mode=config.mode, n_ctx=256, cache_bytes=config.cache_bytes, reuse_prompt=False),
              [(PROMPT, {"stop_at_end": False}), (follow, {"stop_at_end": False})])[1]
    n_prompt = first.usage.prompt_tokens
    assert first.usage.prompt_evaluated == n_prompt
    # The context held the prompt and the generated tokens: the follow-up shares the prompt's
    # tokens but the last one (its last piece may merge with the new text) and evaluates the rest.
    assert second.usage.prompt_evaluated < second.usage.prompt_tokens - n_prompt + 3
    assert third.usage.prompt_evaluated == 1, "the same prompt again evaluates only its last token"
    assert fresh.usage.prompt_evaluated == fresh.usage.prompt_tokens
    assert off.usage.prompt_evaluated == off.usage.prompt_tokens
    assert second.tokens == third.tokens == fresh.tokens == off.tokens


def test_presence_and_frequency_penalties_change_the_draw_and_stream_like_resident(tiny) -> None:
    path = tiny.path(TinySpec())
    plain = SamplingParams(temperature=0.9, top_k=40, seed=7)
    penalised = SamplingParams(temperature=0.9, top_k=40, seed=7, presence_penalty=1.5, frequency_penalty=1.0)
    resident = sampled(path, RESIDENT, penalised)
    assert resident != sampled(path, RESIDENT, plain), "the penalties reach llama.cpp's sampler"
    assert sampled(path, EVICTING, penalised) == resident


@pytest.mark.pure
def test_stderr_held_on_two_threads_is_given_back_to_stderr() -> None:
    """A grammar's compile holds fd 2 in a temporary file. Two at once on two threads (two
    sessions) each restored the other's file as stderr, losing every later line; one at a time now.
    The second thread tries to enter while the first is inside: it waits (the first gives up
    waiting for it after a second), or, unlocked, it enters and leaves after the first."""
    import os
    import threading

    from bmoe.llama.seam import stderr_kept

    before = os.fstat(2)
    first_in, second_in, first_out = threading.Event(), threading.Event(), threading.Event()

    def first() -> None:
        with stderr_kept(lambda: True):
            first_in.set()
            second_in.wait(1.0)
        first_out.set()

    def second() -> None:  # unlocked, it would leave after the first, restoring the first's file
        assert first_in.wait(60)
        with stderr_kept(lambda: True):
            second_in.set()
            first_out.wait(60)

    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    after = os.fstat(2)
    assert (after.st_dev, after.st_ino) == (before.st_dev, before.st_ino), "stderr left on a temporary file"


def test_with_prompt_reuse_streamed_equals_resident_reuse_for_reuse(tiny) -> None:
    """Reuse evaluates a turn's new tokens as a batch of their own, which llama.cpp sums in
    another order than a fresh session's whole-prompt batch: on this model the third turn leaves
    a fresh session's tokens (an audit found it on 9 of 18 archs at q8_0). What bmoe promises is
    that streaming changes nothing: the same turns, reused the same way, give resident's tokens."""
    path = tiny.path(TinySpec(arch="olmoe", n_expert=32, n_ff=128, wtype="q8_0"))
    turns = [PROMPT, PROMPT + " And then", PROMPT + " And then the next turn asks for more of the same."]

    def tokens(config: RunConfig) -> list[list[int]]:
        return [g.tokens for g in run(path, config, [(t, {"n": 24, "stop_at_end": False}) for t in turns])]

    resident = tokens(RESIDENT)
    assert tokens(EVICTING) == resident == tokens(STREAM)


@pytest.mark.parametrize("narrow", [{"top_k": 1}, {"top_p": 1e-6}, {"min_p": 1.0}])
def test_filters_see_each_tokens_own_ids(tiny, narrow: dict) -> None:
    """llama.cpp's top-k, top-p and min-p reorder the candidate array in place. The ids were set
    once, so from the second token on the logits were drawn against the previous token's order:
    a filter that leaves only the best token returned some other one."""
    from bmoe.engine.sampling import Sampler

    rng = np.random.default_rng(0)
    with Session.open(tiny.path(TinySpec()), RESIDENT) as s:
        model = s._model
        sampler = Sampler(model.vocab, model.n_vocab, SamplingParams(temperature=1.0, seed=3, **narrow), [])
        wide = Sampler(model.vocab, model.n_vocab, SamplingParams(temperature=1.0, seed=3, top_k=8), [])
        try:
            for _ in range(6):
                logits = rng.normal(size=model.n_vocab).astype(np.float32)
                assert sampler.sample(logits) == int(np.argmax(logits))
                assert wide.sample(logits) in set(np.argsort(logits)[-8:].tolist())
        finally:
            sampler.close()
            wide.close()


@pytest.mark.pure
@pytest.mark.parametrize("kw,param", [
    ({"json_schema": {"type": "string", "maxLength": 50000}}, "json_schema"),  # SIGSEGV in llama.cpp's parser
    ({"json_schema": {"type": "string", "minLength": 10 ** 8}}, "json_schema"),  # gigabytes, the GIL held
    ({"json_schema": {"type": "array", "items": {"type": "object", "properties": {"a": {"maxItems": 99999}}}}},
     "json_schema"),
    ({"json_schema": {"type": "string", "pattern": "^a{20000}$"}}, "json_schema"),
    ({"grammar": "root ::= " + "(" * 20000 + '"a"' + ")" * 20000}, "grammar"),  # SIGSEGV
    ({"grammar": "root ::= " + '"a"' * 400_000}, "grammar"),
])
def test_grammars_llama_cpp_would_die_on_are_refused(kw: dict, param: str) -> None:
    with pytest.raises(ConfigError) as info:
        SamplingParams(**kw)
    assert info.value.param == param and len(str(info.value)) < 200, info.value


def test_grammar_bounds_leave_ordinary_grammars_alone(tiny) -> None:
    # brackets inside literals, classes and comments are not nesting
    deep_text = "root ::= \"" + "(" * 5000 + "\" [(]* # " + "(" * 5000 + "\n"
    params = [SamplingParams(grammar=deep_text, temperature=1.0, seed=1),
              SamplingParams(json_schema={"type": "string", "maxLength": 1000}, temperature=1.0, seed=1)]
    with Session.open(tiny.path(TinySpec()), RESIDENT) as s:
        for p in params:
            s.check_grammar(p)
        with pytest.raises(ConfigError, match="could not parse") as info:
            s.check_grammar(SamplingParams(json_schema={"enum": []}))
        assert info.value.param == "json_schema"
