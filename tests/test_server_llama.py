"""llama-server's surface (issue 38 item 4): /tokenize, /detokenize, /props, n_predict,
top-level json_schema, cache_prompt per request and the server's own switch, and which unknown
fields are refused and which ignored."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest

from bmoe.engine.session import Session
from bmoe.server.app import create_app
from bmoe.synth.tiny import TinySpec
from tests.test_server import CONFIG, running
from tests.test_server_requests import post


@pytest.fixture(scope="module")
def served(tiny) -> Iterator[tuple[str, Session]]:
    with Session.open(tiny.path(TinySpec()), CONFIG) as session, running(create_app(session)) as url:
        yield url, session


def test_tokenize_and_detokenize_as_llama_server_does(served) -> None:
    url, session = served
    text = "Hello world, héllo"
    full = session.tokenize(text, special=True)
    bare = post(url, "/tokenize", {"content": text}).json()["tokens"]
    assert post(url, "/tokenize", {"content": text, "add_special": True}).json()["tokens"] == full
    added = session.tokenize("")  # what add_special puts first: llama-server's default is without
    assert bare == full[len(added):] and bare, (bare, full)
    pieces = post(url, "/tokenize", {"content": text, "with_pieces": True}).json()["tokens"]
    assert [p["id"] for p in pieces] == bare
    joined = b"".join(p["piece"].encode() if isinstance(p["piece"], str) else bytes(p["piece"]) for p in pieces)
    assert joined.decode() == session.detokenize(bare) and joined.decode().strip() == text  # a vocabulary may add a space
    assert post(url, "/detokenize", {"tokens": bare}).json() == {"content": session.detokenize(bare)}
    bad = post(url, "/detokenize", {"tokens": [session.n_vocab]})
    assert bad.status_code == 400 and bad.json()["error"]["type"] == "invalid_request_error", bad.text
    assert post(url, "/tokenize", {"content": 5}).status_code == 400


def test_props_say_what_applies(served) -> None:
    url, session = served
    props = httpx.get(f"{url}/props").json()
    settings = props["default_generation_settings"]
    assert settings["n_ctx"] == session.n_ctx and settings["params"]["temperature"] == 0.0
    assert props["total_slots"] == 1 and props["model_path"].endswith(session.model_name)
    assert props["chat_template"] == (session.chat_template() or b"").decode()
    assert props["build_info"].startswith("bmoe ")


def test_n_predict_is_max_tokens_and_wins_over_it(served) -> None:
    url, session = served
    for body in ({"prompt": "Once upon a time", "n_predict": 3},
                 {"prompt": "Once upon a time", "n_predict": 3, "max_tokens": 10}):
        r = post(url, "/v1/completions", body)
        assert r.json()["usage"]["completion_tokens"] == 3, (body, r.text)
    chat = post(url, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "n_predict": 3})
    assert chat.json()["usage"]["completion_tokens"] == 3, chat.text
    zero = post(url, "/v1/completions", {"prompt": "x", "n_predict": 0})
    assert zero.status_code == 400 and zero.json()["error"]["param"] == "n_predict", zero.text
    rest = post(url, "/v1/completions", {"prompt": "x", "n_predict": -1, "logit_bias": {}}).json()["usage"]
    assert rest["completion_tokens"] > 16, "-1: up to the context (16 is a text completion's default)"
    assert rest["total_tokens"] <= session.n_ctx


def test_top_level_json_schema(served) -> None:
    url, _ = served
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    r = post(url, "/v1/completions", {"prompt": "x", "max_tokens": 40, "temperature": 1.0, "seed": 3,
                                      "json_schema": schema})
    assert isinstance(json.loads(r.json()["choices"][0]["text"])["ok"], bool), r.text
    both = post(url, "/v1/completions", {"prompt": "x", "json_schema": schema,
                                         "response_format": {"type": "json_object"}})
    assert both.status_code == 400 and both.json()["error"]["param"] == "json_schema", both.text


def test_cache_prompt_false_evaluates_the_prompt_from_its_first_token(served, tiny) -> None:
    url, _ = served
    body = {"prompt": "The same prompt again and again", "max_tokens": 2}
    post(url, "/v1/completions", body)
    reused = post(url, "/v1/completions", body).json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    fresh = post(url, "/v1/completions", {**body, "cache_prompt": False}).json()
    assert reused > 0 and fresh["usage"]["prompt_tokens_details"]["cached_tokens"] == 0, (reused, fresh)
    with Session.open(tiny.path(TinySpec()), CONFIG) as session, \
            running(create_app(session, reuse_prompt=False)) as other:
        for _ in range(2):
            r = post(other, "/v1/completions", body).json()
            assert r["usage"]["prompt_tokens_details"]["cached_tokens"] == 0, r
        assert httpx.get(f"{other}/props").json()["default_generation_settings"]["params"]["cache_prompt"] is False


@pytest.mark.parametrize("path,base", [("/v1/completions", {"prompt": "hi", "max_tokens": 3}),
                                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                                 "max_tokens": 3})])
def test_unknown_fields_are_refused_as_openai_does_and_the_listed_ones_ignored(served, path: str, base: dict) -> None:
    url, _ = served
    def answer(r: httpx.Response) -> object:
        choice = r.json()["choices"][0]
        return choice.get("text", choice.get("message"))

    plain = answer(post(url, path, base))
    for extra in ({"user": "u1", "metadata": {"a": "b"}, "store": False},
                  {"id_slot": 0, "timings_per_token": True, "samplers": ["top_k"]},
                  {"dry_multiplier": 0, "xtc_probability": 0.0, "dry_base": 1.75}):
        r = post(url, path, {**base, **extra})
        assert r.status_code == 200 and answer(r) == plain, (extra, r.text)
    for extra, param in (({"max_token": 3}, "max_token"), ({"temprature": 0.5}, "temprature"),
                         ({"dry_multiplier": 0.8}, "dry_multiplier"), ({"xtc_probability": 0.5}, "xtc_probability")):
        r = post(url, path, {**base, **extra})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (extra, r.text)
    r = post(url, path, {**base, "max_token": 3})
    assert r.json()["error"]["message"] == "Unrecognized request argument supplied: max_token"


def test_llama_servers_own_completion_route_and_the_routes_without_v1(served) -> None:
    url, _ = served
    whole = post(url, "/completion", {"prompt": "Once upon a time", "n_predict": 3}).json()
    assert whole["stop"] is True and whole["tokens_predicted"] == 3 and whole["stop_type"] == "limit", whole
    assert isinstance(whole["content"], str) and whole["tokens_evaluated"] > 0
    with httpx.stream("POST", f"{url}/completion", json={"prompt": "Once upon a time", "n_predict": 3,
                                                         "stream": True}, timeout=120) as r:
        lines = [line for line in r.iter_lines() if line]
    assert all(line.startswith("data: {") for line in lines), "no [DONE]: llama-server's /completion sends none"
    events = [json.loads(line[6:]) for line in lines]
    assert [e["stop"] for e in events] == [False] * (len(events) - 1) + [True]
    assert "".join(e["content"] for e in events) == whole["content"] and events[-1]["tokens_predicted"] == 3
    assert post(url, "/completions", {"prompt": "hi", "max_tokens": 2}).json()["object"] == "text_completion"
    chat = post(url, "/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    assert chat.json()["object"] == "chat.completion"
