"""The server's edges: what a request may hold (surrogates, nesting, nulls, unsupported parameters),
refusals decided before the queue, metrics of refused requests, logprob offsets under a stop string,
schema grammars that keep JSON valid, the model routes and the API key, and shutdown while a
generation runs. A real uvicorn server in a thread, as in ``tests/test_server.py``."""

from __future__ import annotations

import contextlib
import json
import logging
import signal
import socket
import threading
from collections.abc import Iterator

import httpx
import numpy as np
import pytest
import uvicorn
from prometheus_client.parser import text_string_to_metric_families

from bmoe.engine.completions import ContextOverflow, prepare_completion
from bmoe.engine.config import MiB, RunConfig
from bmoe.engine.sampling import ParamError, Sampler, SamplingParams
from bmoe.engine.session import Session
from bmoe.pipeline.hooks import Hooks
from bmoe.server.app import create_app
from bmoe.server.run import Server
from bmoe.synth.tiny import TinySpec
from tests.test_server import CHAT, CONFIG, GUARD_S, client, running


@contextlib.contextmanager
def errors_logged() -> Iterator[list[logging.LogRecord]]:
    """Records at ERROR or above on the server's loggers (uvicorn's do not reach the root)."""
    seen: list[logging.LogRecord] = []
    handler = logging.Handler(logging.ERROR)
    handler.emit = seen.append  # type: ignore[method-assign]
    loggers = [logging.getLogger(n) for n in ("", "uvicorn", "uvicorn.error", "bmoe.server")]
    for lg in loggers:
        lg.addHandler(handler)
    try:
        yield seen
    finally:
        for lg in loggers:
            lg.removeHandler(handler)


@pytest.fixture(scope="module")
def served(tiny) -> Iterator[tuple[str, str]]:
    path = tiny.path(TinySpec())
    with Session.open(path, CONFIG) as session, running(create_app(session)) as url:
        yield url, session.model_name


@pytest.fixture
def tiny_path(tiny):  # noqa: ANN001, ANN201
    return tiny.path(TinySpec())


def post(url: str, path: str, body: bytes | dict, http: httpx.Client | None = None) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return (http or httpx).post(f"{url}{path}", content=content, headers={"content-type": "application/json"},
                                timeout=GUARD_S)


def until(done) -> None:  # noqa: ANN001
    """Wait for a state, not for a time: polls ``done()``; the guard only turns a hang into a failure."""
    for _ in range(GUARD_S * 100):
        if done():
            return
        threading.Event().wait(0.01)
    raise AssertionError("the state never came")


def metric(url: str, name: str, outcome: str | None = None) -> float:
    families = {f.name: f for f in text_string_to_metric_families(httpx.get(f"{url}/metrics").text)}
    return sum(s.value for s in families[name].samples
               if (outcome is None and not s.name.endswith("_created")) or s.labels.get("outcome") == outcome)


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", b'{"prompt": "a\\ud800b", "max_tokens": 2}'),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x\\udfffy"}], "max_tokens": 2}'),
    ("/v1/completions", b'{"prompt": "hi", "model": "m\\ud800", "max_tokens": 2}'),
    ("/v1/completions", b"[" * 100_000 + b"]" * 100_000),
])
def test_surrogates_and_deep_nesting_are_a_400_and_the_connection_stays_usable(served, path: str, body: bytes) -> None:
    url, _ = served
    with errors_logged() as seen, httpx.Client(timeout=GUARD_S) as http:
        r = post(url, path, body, http)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["type"] == "invalid_request_error"
        again = post(url, "/v1/completions", {"prompt": "hi", "max_tokens": 2}, http)
        assert again.status_code == 200 and again.json()["usage"]["completion_tokens"] == 2
    assert not seen, [rec.getMessage() for rec in seen]


BAD_WHILE_BUSY = [
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "n": 2}, "n"),
    ("/v1/completions", {"prompt": "word " * 3000, "max_tokens": 4}, "prompt"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 100000}, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "response_format": {"type": "yaml"}}, "response_format"),
    ("/v1/completions", {"prompt": "x", "temperature": -1}, "temperature"),
    ("/v1/completions", {"prompt": "x", "stop": [""]}, "stop"),
    ("/v1/chat/completions", {"messages": []}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "word " * 3000}]}, "messages"),
    ("/v1/chat/completions", {"messages": CHAT, "top_logprobs": 99, "logprobs": True}, "top_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user"}]}, "messages"),
]


class HeldReads:
    """A ``before_read`` hook that, once ``on``, blocks every expert read until ``release`` is set;
    ``entered`` is set when a read is blocked."""

    def __init__(self) -> None:
        self.release, self.entered, self.on = threading.Event(), threading.Event(), False

    def __call__(self, _request) -> bool:  # noqa: ANN001
        if self.on:
            self.entered.set()
            assert self.release.wait(GUARD_S)
        return True

    def free(self) -> None:
        self.on = False
        self.release.set()


@contextlib.contextmanager
def one_held_generation(tiny, **app_kw) -> Iterator[tuple[str, object, threading.Event, list]]:  # noqa: ANN001
    """A server with no waiting place whose only turn is held by a completion blocked in an expert
    read until the yielded event is set; yields (url, app, release, [the held request's response])."""
    path = tiny.path(TinySpec())
    held = HeldReads()

    with Session.open(path, CONFIG, hooks=Hooks(before_read=held)) as session:
        app = create_app(session, max_waiting=0, **app_kw)
        with running(app) as url:
            held.on = True
            done: list = []
            first = threading.Thread(target=lambda: done.append(
                post(url, "/v1/completions", {"prompt": "Hold the line", "max_tokens": 3})))
            first.start()
            assert held.entered.wait(GUARD_S)
            try:
                yield url, app, held.release, done
            finally:
                held.free()
                first.join(GUARD_S)


def test_bad_requests_are_refused_at_once_while_a_generation_holds_the_only_turn(tiny) -> None:
    with one_held_generation(tiny) as (url, _, release, done):
        for path, body, param in BAD_WHILE_BUSY:
            r = post(url, path, body)
            assert r.status_code == 400, (body, r.status_code, r.text)
            assert r.json()["error"]["param"] == param, r.text
        busy = post(url, "/v1/completions", {"prompt": "x", "max_tokens": 2})
        assert busy.status_code == 503, "a good request still finds the queue full"
        release.set()
    assert done[0].status_code == 200 and done[0].json()["usage"]["completion_tokens"] == 3


def test_a_request_refused_at_its_turn_does_not_count_the_last_generation_again(served) -> None:
    url, _ = served
    assert post(url, "/v1/completions", {"prompt": "Count me", "max_tokens": 4}).status_code == 200
    tokens, prompt = metric(url, "bmoe_completion_tokens"), metric(url, "bmoe_prompt_tokens")
    bad = post(url, "/v1/completions", {"prompt": "x", "temperature": 0.5, "grammar": "root ::= ("})
    assert bad.status_code == 400 and "grammar" in bad.json()["error"]["message"]
    assert (metric(url, "bmoe_completion_tokens"), metric(url, "bmoe_prompt_tokens")) == (tokens, prompt)


def test_a_generation_failing_mid_way_counts_its_own_tokens_and_its_outcome(served) -> None:
    """A grammar that reaches a dead end after one token: /metrics added the previous request's
    usage (5 tokens) instead of this one's, and a stream ending in the error counted as ``ok``,
    its error event typed ``server_error`` with no param."""
    url, _ = served
    dead_end = {"prompt": "x", "max_tokens": 6, "temperature": 0.8, "seed": 1, "grammar": 'root ::= [a-z] "\\x00"'}
    assert post(url, "/v1/completions", {"prompt": "Count me", "max_tokens": 5}).status_code == 200
    tokens = metric(url, "bmoe_completion_tokens")
    r = post(url, "/v1/completions", dead_end)
    assert r.status_code == 400 and r.json()["error"]["param"] == "grammar", r.text
    assert metric(url, "bmoe_completion_tokens") == tokens + 1, "the one token it made, not the last request's five"
    ok, bad = metric(url, "bmoe_requests", "ok"), metric(url, "bmoe_requests", "bad_request")
    with httpx.stream("POST", f"{url}/v1/completions", json={**dead_end, "stream": True}, timeout=GUARD_S) as resp:
        events = [line[6:] for line in resp.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and "choices" in json.loads(events[0]), events
    err = json.loads(events[-2])["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == "grammar", err
    assert (metric(url, "bmoe_requests", "ok"), metric(url, "bmoe_requests", "bad_request")) == (ok, bad + 1)
    assert metric(url, "bmoe_completion_tokens") == tokens + 2


@pytest.mark.parametrize("path,body,param", [
    ("/v1/chat/completions", {"messages": CHAT, "tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools"),
    ("/v1/chat/completions", {"messages": CHAT, "tool_choice": "required"}, "tool_choice"),
    ("/v1/chat/completions", {"messages": CHAT, "functions": [{"name": "f"}]}, "functions"),
    ("/v1/chat/completions", {"messages": CHAT, "function_call": {"name": "f"}}, "function_call"),
    ("/v1/completions", {"prompt": "x", "echo": True}, "echo"),
    ("/v1/completions", {"prompt": "x", "suffix": "end"}, "suffix"),
    ("/v1/completions", {"prompt": "x", "best_of": 3}, "best_of"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"x": 1}}, "logit_bias"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"5": 101}}, "logit_bias"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"999999": 1}}, "logit_bias"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"5": 10**400}}, "logit_bias"),  # was a 500: OverflowError
    ("/v1/chat/completions", {"messages": CHAT, "logit_bias": {"5": -(10**400)}}, "logit_bias"),
    ("/v1/completions", {"prompt": ["a", "b"]}, "prompt"),
    ("/v1/completions", {"prompt": "x", "response_format": {"type": "json_object", "schema": True}}, "response_format"),
    # samplers bmoe has none for were dropped unseen (200, generated as if absent)
    ("/v1/completions", {"prompt": "x", "typical_p": 0.5}, "typical_p"),
    ("/v1/completions", {"prompt": "x", "mirostat_mode": 2, "temperature": 1}, "mirostat_mode"),
    ("/v1/chat/completions", {"messages": CHAT, "mirostat": 1}, "mirostat"),
    ("/v1/chat/completions", {"messages": CHAT, "tfs_z": 0.9}, "tfs_z"),
    ("/v1/completions", {"prompt": "x", "ignore_eos": True}, "ignore_eos"),
    ("/v1/completions", {"prompt": "x", "repeat_last_n": 8}, "repeat_last_n"),
    ("/v1/completions", {"prompt": "x", "n_probs": 5}, "n_probs"),
    # a schema whose grammar nests past llama.cpp's parser stack killed the server (SIGSEGV)
    ("/v1/chat/completions", {"messages": CHAT, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "string", "maxLength": 50000}}}}, "response_format"),
    ("/v1/completions", {"prompt": "x", "grammar": "root ::= " + "(" * 20000 + '"a"' + ")" * 20000}, "grammar"),
    # a grammar llama.cpp cannot parse was refused only at its turn, naming no field
    ("/v1/chat/completions", {"messages": CHAT, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"enum": []}}}}, "response_format"),
])
def test_parameters_bmoe_cannot_honour_are_refused_by_name(served, path: str, body: dict, param: str) -> None:
    url, _ = served
    r = post(url, path, body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error", err
    assert "Error" not in err["message"] and "object has no attribute" not in err["message"], err
    assert len(err["message"]) < 200, err


def test_samplers_at_their_off_values_are_accepted(served) -> None:
    url, _ = served
    off = {"typical_p": 1, "tfs_z": 1.0, "mirostat_mode": 0, "mirostat": 0, "mirostat_tau": 5.0, "mirostat_eta": 0.1,
           "ignore_eos": False, "repeat_last_n": 64, "n_probs": 0}
    r = post(url, "/v1/completions", {"prompt": "x", "max_tokens": 2, **off})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("path,body,param,message", [
    ("/v1/completions", {"prompt": [[1, 2]]}, "prompt", "prompt must be one of: str, list[int], list[str]"),
    ("/v1/completions", {"prompt": None}, "prompt", "prompt must be one of: str, list[int], list[str]"),
    ("/v1/chat/completions", {"messages": CHAT, "stop": [None]}, "stop", "stop must be one of:"),
    ("/v1/chat/completions", {"messages": CHAT, "max_completion_tokens": 0}, "max_completion_tokens",
     "max_completion_tokens must be"),
    ("/v1/chat/completions", {"messages": CHAT, "temperature": "hot"}, "temperature", "temperature: "),
])
def test_a_refusal_names_the_requests_own_field(served, path: str, body: dict, param: str, message: str) -> None:
    """A field of several types was named by pydantic's type label (``prompt.str``: "Input should
    be a valid string" for a list of lists), and max_completion_tokens by the engine's max_tokens."""
    url, _ = served
    r = post(url, path, body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["message"].startswith(message), err


def test_a_trailing_slash_is_a_404_in_the_openai_shape(served) -> None:
    url, _ = served
    r = post(url, "/v1/completions/", {"prompt": "x", "max_tokens": 2})
    assert r.status_code == 404 and set(r.json()["error"]) == {"message", "type", "param", "code"}, r.text


def test_nulls_one_prompt_in_a_list_and_the_harmless_values_are_accepted(served) -> None:
    url, _ = served
    plain = post(url, "/v1/completions", {"prompt": "hi", "max_tokens": 3}).json()["choices"][0]["text"]
    for body in ({"prompt": ["hi"], "max_tokens": 3}, {"prompt": "hi", "max_tokens": 3, "n": None, "stream": None},
                 {"prompt": "hi", "max_tokens": 3, "echo": False, "best_of": 1, "suffix": None, "seed": -1}):
        r = post(url, "/v1/completions", body)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == plain, (body, r.text)
    for body in ({"messages": CHAT, "max_tokens": 3, "logprobs": None, "n": None, "stream": None},
                 {"messages": CHAT, "max_tokens": 3, "tools": [{"type": "function", "function": {"name": "f"}}],
                  "tool_choice": "none"},
                 {"messages": CHAT, "max_tokens": 3, "tools": [], "temperature": 0.9, "seed": -1}):
        r = post(url, "/v1/chat/completions", body)
        assert r.status_code == 200 and r.json()["object"] == "chat.completion", (body, r.text)


TOOL_CALL = {"id": "c1", "type": "function", "function": {"name": "colour", "arguments": "{}"}}


@pytest.mark.parametrize("body,param,needle", [
    ({"messages": [{"role": "user"}]}, "messages", "messages[0] has no content"),
    ({"messages": [{"role": "system", "content": None}, CHAT[1]]}, "messages", "messages[0] has no content"),
    ({"messages": [*CHAT, {"role": "assistant"}]}, "messages", "messages[2] has no content"),
    ({"messages": [*CHAT, {"role": "assistant", "content": None, "tool_calls": [TOOL_CALL]}, {"role": "tool"}]},
     "messages", "messages[3] has no content"),
    ({"messages": CHAT, "logprobs": True, "top_logprobs": 50}, "top_logprobs", "top_logprobs must be"),
    ({"messages": CHAT, "logprobs": True, "top_logprobs": -1}, "top_logprobs", "top_logprobs must be"),
])
def test_a_message_without_content_and_top_logprobs_out_of_range_are_refused_by_name(
        served, body: dict, param: str, needle: str) -> None:
    url, _ = served
    r = post(url, "/v1/chat/completions", {**body, "max_tokens": 2})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error", err
    assert err["message"].startswith(needle), err


def test_empty_content_and_an_assistant_tool_call_without_content_are_accepted(served) -> None:
    url, _ = served
    for messages in ([{"role": "user", "content": ""}],
                     [*CHAT, {"role": "assistant", "content": None, "tool_calls": [TOOL_CALL]},
                      {"role": "tool", "tool_call_id": "c1", "content": "red"}],
                     [*CHAT, {"role": "assistant", "tool_calls": [TOOL_CALL]}, {"role": "tool", "content": ""}]):
        r = post(url, "/v1/chat/completions", {"messages": messages, "max_tokens": 2})
        assert r.status_code == 200 and r.json()["object"] == "chat.completion", (messages, r.text)


def test_logit_bias_steers_the_draw(served, tiny_path) -> None:
    url, _ = served
    with Session.open(tiny_path, CONFIG) as s:
        ids = {s.token_bytes(t): t for t in reversed(range(s.n_vocab))}  # bytes -> first id

    def first_tokens(**kw) -> list[bytes]:  # noqa: ANN003
        body = {"messages": CHAT, "max_tokens": 4, "logprobs": True, "top_logprobs": 5, **kw}
        return [bytes(t["bytes"]) for t in post(url, "/v1/chat/completions", body).json()["choices"][0]["logprobs"]["content"]]

    greedy = post(url, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 1, "logprobs": True,
                                               "top_logprobs": 5}).json()["choices"][0]["logprobs"]["content"][0]
    first = bytes(greedy["bytes"])
    other = next(bytes(t["bytes"]) for t in greedy["top_logprobs"] if bytes(t["bytes"]) != first)
    assert first_tokens()[0] == first
    assert first_tokens(logit_bias={str(ids[first]): -100})[0] != first
    assert first_tokens(logit_bias={str(ids[other]): 100}) == [other] * 4


def test_text_offsets_follow_each_tokens_own_text_under_a_held_back_stop(served) -> None:
    url, _ = served
    body = {"prompt": "Hello", "max_tokens": 6, "logprobs": 1, "grammar": "root ::= [a-z ]{6,40}"}
    free = post(url, "/v1/completions", body).json()["choices"][0]
    tokens = free["logprobs"]["tokens"]
    assert len(tokens) == 6 and all(tokens), tokens
    stop = tokens[2] + "\x07never"  # a stop whose prefix is token 2's text: held back, then released
    held = post(url, "/v1/completions", {**body, "stop": stop}).json()["choices"][0]
    assert held["text"] == free["text"] and held["logprobs"]["tokens"] == tokens
    want = [len("Hello") + sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]  # from the prompt's start
    assert held["logprobs"]["text_offset"] == want == free["logprobs"]["text_offset"]


def test_text_offsets_give_a_split_or_broken_character_to_the_token_that_began_it() -> None:
    """A byte that began a character counted nothing, so the next token's offset was the broken
    character's own: '\ufffd@ m' read [0, 0, 2]."""
    from bmoe.engine.completions import _Offsets

    broken = _Offsets(0)
    assert [broken.next(b) for b in (b"\xe2", b"@", b" m")] == [0, 1, 2]
    split = _Offsets(5)
    assert [split.next(b) for b in (b"a", b"\xe2\x82", b"\xac", b"b")] == [5, 6, 7, 7]


def test_top_logprobs_keep_every_token_and_the_chosen_one(served) -> None:
    """Byte tokens (pieces of a UTF-8 character) all decoded to U+FFFD and overwrote each other:
    20 asked gave 15 keys, the chosen token missing. They are named ``bytes:\\xNN`` now."""
    url, _ = served
    body = {"prompt": "Hello", "max_tokens": 12, "logprobs": 20, "temperature": 1.0, "seed": 3}
    lp = post(url, "/v1/completions", body).json()["choices"][0]["logprobs"]
    for token, value, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"], strict=True):
        # Two tokens with the same text (the byte token for "=" and "=" itself) still share a key:
        # a dict keyed by text cannot tell them apart.
        assert len(top) >= 18 and top[token] == value, (token, value, top)
    assert any(k.startswith("bytes:\\x") for top in lp["top_logprobs"] for k in top), "the tiny vocabulary has byte tokens"


def test_schema_grammars_keep_control_characters_out_of_strings(served, tiny_path) -> None:
    # llama.cpp's own grammar sampler, steered hard towards a raw control character inside a string
    with Session.open(tiny_path, CONFIG) as s:
        model = s._model  # the vocabulary, for the native sampler
        piece = {model.piece(t): t for t in range(model.n_vocab)}
        quote, ctrl = piece[b'"'], piece[b"\x01"]
        sampler = Sampler(model.vocab, model.n_vocab, SamplingParams(json_schema={"type": "string"}), [])
        try:
            logits = np.zeros(model.n_vocab, np.float32)
            logits[quote] = 50
            assert sampler.sample(logits) == quote
            sampler.accept(quote)
            logits[quote], logits[ctrl] = 0, 50
            assert sampler.sample(logits) != ctrl
        finally:
            sampler.close()
    schema = {"type": "object", "properties": {"s": {"type": "string"}, "p": {"type": "string", "pattern": "^a.b$"}},
              "required": ["s"]}
    gbnf = SamplingParams(json_schema=schema).gbnf()
    assert gbnf is not None
    rules = dict(line.split(" ::= ", 1) for line in gbnf.splitlines())
    assert rules["char"].startswith(r'[^"\\\x7F\x00-\x1F]') and rules["dot"] == r'[^"\\\x7F\x00-\x1F]'
    url, _ = served
    bias = {str(t): 30 for b, t in piece.items() if len(b) == 1 and b[0] < 0x20}
    for seed in range(4):
        r = post(url, "/v1/completions", {
            "prompt": "Hello", "max_tokens": 30, "temperature": 1.0, "seed": seed, "logit_bias": bias,
            "response_format": {"type": "json_schema", "json_schema": {"name": "t", "schema": schema}}})
        choice = r.json()["choices"][0]
        if choice["finish_reason"] == "stop":
            assert isinstance(json.loads(choice["text"]), dict), choice["text"]
        assert not any(ord(c) < 0x20 for c in choice["text"].partition('"s"')[2]), choice["text"]


def test_model_routes_reply_model_name_and_api_key_scheme(tiny) -> None:
    path = tiny.path(TinySpec())
    with Session.open(path, CONFIG) as session, running(create_app(session, api_key="sesame")) as url:
        name = session.model_name
        auth = {"Authorization": "bearer sesame"}
        assert httpx.get(f"{url}/v1/models", headers=auth).status_code == 200
        assert httpx.get(f"{url}/v1/models", headers={"Authorization": "Basic sesame"}).status_code == 401
        one = httpx.get(f"{url}/v1/models/{name}", headers=auth)
        assert one.status_code == 200 and one.json()["id"] == name and one.json()["object"] == "model"
        missing = httpx.get(f"{url}/v1/models/gpt-4o", headers=auth)
        assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
        c = client(url, "sesame")
        assert c.completions.create(model="whatever", prompt="hi", max_tokens=2).model == name
        assert c.chat.completions.create(model="whatever", messages=CHAT, max_tokens=2).model == name


def test_context_overflow_names_the_server_flag_and_the_python_knob(served, tiny_path) -> None:
    url, _ = served
    r = post(url, "/v1/completions", {"prompt": "x", "max_tokens": 100000})
    err = r.json()["error"]
    assert r.status_code == 400 and err["code"] == "context_length_exceeded" and err["param"] == "max_tokens"
    assert "-c/--ctx" in err["message"] and "n_ctx" not in err["message"]
    with Session.open(tiny_path, CONFIG) as s, pytest.raises(ContextOverflow, match="RunConfig.n_ctx"):
        prepare_completion(s, "x", max_tokens=100000)
    with Session.open(tiny_path, CONFIG) as s, pytest.raises(ParamError) as info:
        prepare_completion(s, "x", temperature=-1)
    assert info.value.param == "temperature"


def test_shutdown_ends_a_running_stream_properly_and_refuses_the_waiting(tiny) -> None:
    """What SIGTERM does (``Server.handle_exit``), called in-process: the running stream ends at
    once with its last chunk and [DONE], the queued request gets a 503 in OpenAI's shape."""
    path = tiny.path(TinySpec())
    held = HeldReads()

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    with Session.open(path, RunConfig(mode="stream", n_ctx=512, cache_bytes=0), hooks=Hooks(before_read=held)) \
            as session, errors_logged() as seen:
        app = create_app(session, max_waiting=2)
        server = Server(uvicorn.Config(app, loop="uvloop", log_level="warning", lifespan="on",
                                       timeout_graceful_shutdown=GUARD_S))
        thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
        thread.start()
        until(lambda: server.started or not thread.is_alive())
        lines: list[str] = []
        queued: list[httpx.Response] = []

        def stream() -> None:
            body = {"prompt": "Far away", "max_tokens": 400, "stream": True}
            with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=GUARD_S) as r:
                for line in r.iter_lines():
                    if line:
                        lines.append(line)
                    if len(lines) == 2:
                        held.on = True  # the generation runs: block it in its next expert read

        streamer = threading.Thread(target=stream)
        waiter = threading.Thread(target=lambda: queued.append(
            post(url, "/v1/completions", {"prompt": "x", "max_tokens": 2})))
        try:
            streamer.start()
            assert held.entered.wait(GUARD_S)
            waiter.start()
            until(lambda: metric(url, "bmoe_queue_depth") >= 1)
            server.handle_exit(signal.SIGTERM, None)
            until(lambda: app.state.bmoe.stopping)
        finally:
            held.free()
        for t in (streamer, waiter, thread):
            t.join(GUARD_S)
        sock.close()
    assert not thread.is_alive()
    assert lines[-1] == "data: [DONE]"
    last = json.loads(lines[-2].removeprefix("data: "))
    # cut short: "length", one of OpenAI's finish reasons (it was bmoe's own "cancelled")
    assert last["choices"][0]["finish_reason"] == "length" and last["usage"]["completion_tokens"] < 400
    assert queued[0].status_code == 503 and queued[0].json()["error"]["code"] == "server_shutting_down"
    assert not seen, [rec.getMessage() for rec in seen]


def test_the_python_api_refuses_the_same_things(tiny) -> None:
    from bmoe.engine.sync import SyncSession

    with SyncSession.open(tiny.path(TinySpec()), RunConfig(mode="stream", n_ctx=256, cache_bytes=MiB)) as s:
        for kw in ({"echo": True}, {"n": 2}, {"max_tokens": 0}, {"prompt": ["a", "b"]}):
            with pytest.raises(ParamError):
                s.create_completion(**{"prompt": "x", **kw})
        with pytest.raises(ParamError, match="tools"):
            s.create_chat_completion(CHAT, tools=[{"type": "function"}])
        assert s.create_completion(["x"], max_tokens=2, seed=-1, temperature=0.5)["usage"]["completion_tokens"] == 2


def test_the_shutdown_waits_for_a_request_still_being_tokenized_before_freeing_the_model(tiny, monkeypatch) -> None:  # noqa: ANN001
    """Requests are tokenized on worker threads. Past uvicorn's graceful timeout the request's
    task is cancelled, but its thread goes on in llama_tokenize: the model a server opened was
    freed under it. The shutdown now waits for those threads first."""
    import bmoe.server.app as app_module

    release, entered = threading.Event(), threading.Event()
    real = app_module.prepare_completion

    def slow(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        entered.set()
        assert release.wait(GUARD_S)
        return real(*args, **kwargs)

    monkeypatch.setattr(app_module, "prepare_completion", slow)
    app = create_app(model=tiny.path(TinySpec()), config=CONFIG)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    server = Server(uvicorn.Config(app, loop="uvloop", log_level="critical", lifespan="on",
                                   timeout_graceful_shutdown=0.2))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    until(lambda: server.started or not thread.is_alive())
    def ask() -> None:
        with contextlib.suppress(httpx.HTTPError):  # cut off by the shutdown: what it gets is not the point
            httpx.post(f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=GUARD_S)

    asker = threading.Thread(target=ask, daemon=True)
    asker.start()
    try:
        assert entered.wait(GUARD_S)
        state = app.state.bmoe
        server.should_exit = True  # the graceful wait runs out; the lifespan's shutdown begins
        until(lambda: state.stopping or state.session.closed)  # the lifespan's shutdown has begun
        assert state.session is not None and not state.session.closed, "freed under a tokenizing thread"
    finally:
        release.set()
        thread.join(GUARD_S)
        sock.close()
    assert not thread.is_alive() and state.session.closed


def test_an_idle_server_asks_the_pressure_guard_and_reports_its_budget(tiny) -> None:
    """Between requests nothing asked the guard: the cache stayed whole whatever other programs took."""
    path = tiny.path(TinySpec())
    calls: list[bool] = []
    with Session.open(path, CONFIG) as session, running(create_app(session)) as url:
        real = session.check_memory
        session.check_memory = lambda: calls.append(True) or real()  # type: ignore[method-assign]
        until(lambda: len(calls) >= 2)
        assert metric(url, "bmoe_cache_budget_bytes") == session.budget_bytes


def test_a_server_on_a_lossy_session_says_so(tiny) -> None:
    """A server built through the API on a lossy session was indistinguishable from an exact one."""
    path = tiny.path(TinySpec())
    lossy = RunConfig(mode="stream", n_ctx=256, cache_bytes=MiB, n_expert_used=1)
    with Session.open(path, lossy) as session, running(create_app(session)) as url:
        (model,) = httpx.get(f"{url}/v1/models", timeout=GUARD_S).json()["data"]
        assert model["lossy"] is True and model["lossy_flags"] == "--n-expert-used 1", model
    with Session.open(path, CONFIG) as session, running(create_app(session)) as url:
        assert "lossy" not in httpx.get(f"{url}/v1/models", timeout=GUARD_S).json()["data"][0]
