"""Tool calls: OpenAI's ``tools`` / ``tool_choice`` through the model's own template, parsed back
from the reply in the family's format (Qwen / Hermes ``<tool_call>``, gpt-oss's channels, a
generic JSON fallback), streamed and not, from the Python API and from ``bmoe serve`` with the
official ``openai`` client. The fixtures' weights are random: a forced call (``required`` or a
named function) is the grammar's doing, and a call's arguments always match its schema."""

from __future__ import annotations

import json
import subprocess
import sys

import httpx
import pytest
from gguf import GGUFValueType, TokenType
from gguf.gguf_writer import GGUFValue

from bmoe.engine import tools
from bmoe.engine.chat import ChatFormat, Message
from bmoe.engine.config import RunConfig
from bmoe.engine.sampling import ParamError
from bmoe.engine.thinking import ChannelSplitter
from bmoe.synth.tiny import TinySpec, write_tiny

GUARD_S = 120  # a hang guard; nothing is timed

# Qwen2.5's template, cut to what matters here: tools listed in the system turn, past calls as
# <tool_call> blocks with their arguments through tojson, tool results as <tool_response>.
QWEN_TOOLS = (
    "{% if tools %}<|im_start|>system\n{% if messages[0].role == 'system' %}{{ messages[0].content }}\n\n{% endif %}"
    "# Tools\n\n<tools>{% for tool in tools %}\n{{ tool | tojson }}{% endfor %}\n</tools>\n\n"
    "For each function call, return a json object within <tool_call></tool_call> XML tags:\n"
    "<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n"
    "{% elif messages[0].role == 'system' %}<|im_start|>system\n{{ messages[0].content }}<|im_end|>\n{% endif %}"
    "{% for message in messages %}{% if message.role == 'system' and loop.first %}"
    "{% elif message.role == 'assistant' %}<|im_start|>assistant\n{{ message.content }}"
    "{% for tc in message.tool_calls or [] %}{% set f = tc.function if tc.function is defined else tc %}"
    "\n<tool_call>\n{\"name\": \"{{ f.name }}\", \"arguments\": {{ f.arguments | tojson }}}\n</tool_call>"
    "{% endfor %}<|im_end|>\n"
    "{% elif message.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ message.content }}\n</tool_response>"
    "<|im_end|>\n"
    "{% else %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# gpt-oss's template, cut likewise: tools as a TypeScript namespace in the developer message, a
# past call as a message to functions.NAME, its result as a message from it.
HARMONY_TOOLS = (
    "{% if tools %}<|start|>developer<|message|># Tools\n\nnamespace functions {\n{% for t in tools %}"
    "type {{ t.function.name }} = (_: {{ t.function.parameters | tojson }}) => any;\n{% endfor %}"
    "} // namespace functions<|end|>{% endif %}"
    "{% for m in messages %}{% if m.role == 'assistant' and m.tool_calls %}{% for tc in m.tool_calls %}"
    "<|start|>assistant<|channel|>commentary to=functions.{{ tc.function.name }} <|constrain|>json<|message|>"
    "{{ tc.function.arguments }}<|call|>{% endfor %}"
    "{% elif m.role == 'tool' %}<|start|>functions.{{ m.name }} to=assistant<|channel|>commentary<|message|>"
    "{{ m.content }}<|end|>"
    "{% else %}<|start|>{{ m.role }}{% if m.role == 'assistant' %}<|channel|>final{% endif %}<|message|>"
    "{{ m.content }}<|end|>{% endif %}{% endfor %}{% if add_generation_prompt %}<|start|>assistant{% endif %}"
)
HARMONY = ("<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|return|>", "<|call|>")

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]}},
                   "required": ["city"]}}}
CLOCK = {"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {}}}}
TOOLS = [WEATHER, CLOCK]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
ANSWERED = [*ASK, {"role": "assistant", "content": None, "tool_calls": [CALL]},
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}]
CONFIG = RunConfig(mode="stream", n_ctx=1024)


def _with_template(folder, template: str, spec: TinySpec = TinySpec(), harmony: bool = False):  # noqa: ANN001, ANN201
    from bmoe.synth.vocab import byte_vocab

    def edit(w) -> None:  # noqa: ANN001
        kv = w.kv_data[0]
        kv["tokenizer.chat_template"] = GGUFValue(template, GGUFValueType.STRING)
        if harmony:  # the markers as control tokens, in the last normal pieces' slots
            vocab = byte_vocab()
            tokens, types = list(vocab.tokens), list(vocab.types)
            for i, marker in enumerate(HARMONY, start=len(tokens) - len(HARMONY)):
                tokens[i], types[i] = marker, int(TokenType.CONTROL)
            kv["tokenizer.ggml.tokens"] = GGUFValue(tokens, GGUFValueType.ARRAY, GGUFValueType.STRING)
            kv["tokenizer.ggml.token_type"] = GGUFValue(types, GGUFValueType.ARRAY, GGUFValueType.INT32)

    (path,) = write_tiny(folder / "m.gguf", spec, edit_metadata=edit)
    return path


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):  # noqa: ANN001, ANN201
    return _with_template(tmp_path_factory.mktemp("qwen"), QWEN_TOOLS)


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory):  # noqa: ANN001, ANN201
    return _with_template(tmp_path_factory.mktemp("gptoss"), HARMONY_TOOLS, TinySpec(arch="gpt-oss", n_layer=2),
                          harmony=True)


def _weather_args(call: dict) -> dict:
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"]["name"] == "get_weather", call
    args = json.loads(call["function"]["arguments"])
    assert args in ({"city": "Paris"}, {"city": "Oslo"}), args
    return args


def _gathered(chunks: list[dict]) -> tuple[list[dict], str | None, list[dict]]:
    """A stream's tool calls joined by index, as a client does; the finish reason; the deltas."""
    calls: dict[int, dict] = {}
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    for d in deltas:
        for piece in d.get("tool_calls") or []:
            have = calls.setdefault(piece["index"], {"id": None, "type": None, "function": {"name": "", "arguments": ""}})
            have["id"] = piece.get("id") or have["id"]
            have["type"] = piece.get("type") or have["type"]
            have["function"]["name"] += piece["function"].get("name") or ""
            have["function"]["arguments"] += piece["function"].get("arguments") or ""
    finish = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1]
    return [calls[i] for i in sorted(calls)], finish, deltas


# -- checks and parsers: no model ------------------------------------------------------------------


@pytest.mark.pure
@pytest.mark.parametrize("given,choice,param,needle", [
    ("get_weather", None, "tools", "tools must be a list"),
    ([{"type": "function"}], None, "tools", "tools[0] must be"),
    ([{"type": "function", "function": {"name": "a b"}}], None, "tools", "tools[0].function.name"),
    ([{"type": "function", "function": {"name": "f", "parameters": "x"}}], None, "tools", "parameters must be"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "n": {"type": "string", "maxLength": 10**6}}}}}], None, "tools", "tools[0].function.parameters:"),
    ([WEATHER, WEATHER], None, "tools", "same name"),
    (TOOLS, "sometimes", "tool_choice", "tool_choice must be"),
    (TOOLS, {"type": "function", "function": {"name": "nope"}}, "tool_choice", "names 'nope'"),
    (None, "required", "tool_choice", "tool_choice needs tools"),
])
def test_bad_tools_and_tool_choice_are_refused_by_name(given, choice, param: str, needle: str) -> None:  # noqa: ANN001
    with pytest.raises(ParamError) as info:
        tools.tool_request(given, choice)
    assert info.value.param == param and needle in str(info.value), str(info.value)


@pytest.mark.pure
def test_tool_choice_none_or_no_tools_offers_nothing_and_required_forces() -> None:
    assert tools.tool_request(TOOLS, "none") is None and tools.tool_request([], "auto") is None
    assert tools.tool_request(None, None) is None
    auto = tools.tool_request(TOOLS, None)
    assert auto is not None and not auto.forced and tools.grammar(auto, "hermes") is None
    named = tools.tool_request(TOOLS, {"type": "function", "function": {"name": "now"}})
    assert named is not None and named.forced and named.only == "now"
    assert "get_weather" not in (tools.grammar(named, "hermes") or "")


@pytest.mark.pure
def test_a_call_split_at_every_position_is_parsed_and_no_marker_is_shown() -> None:
    reply = 'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    for cut in range(len(reply) + 1):
        p = tools.HermesParser()
        a, da = p.feed(reply[:cut])
        b, db = p.feed(reply[cut:])
        c, dc = p.flush()
        assert a + b + c == "Let me look.\n", cut
        assert len([d for d in da + db + dc if d.name]) == 1
    assert p.calls.gathered[0]["function"] == {"name": "get_weather", "arguments": '{"city": "Oslo"}'}
    # token by token, the name comes as soon as it is written and the arguments piece by piece
    p = tools.HermesParser()
    deltas = [d for ch in reply for d in p.feed(ch)[1]] + p.flush()[1]
    assert deltas[0].name == "get_weather" and deltas[0].id and all(d.name is None for d in deltas[1:])
    assert len(deltas) > 5 and "".join(d.arguments for d in deltas) == '{"city": "Oslo"}'
    # a model that ends without </tool_call> after a whole call still made it
    p = tools.HermesParser()
    p.feed('<tool_call>{"name": "now", "arguments": {"a": {}}} ')
    assert p.flush()[0] == ""
    assert p.calls.gathered[0]["function"] == {"name": "now", "arguments": '{"a": {}}'}
    # a block that is no call stays text; an unclosed one is what the model wrote
    p = tools.HermesParser()
    text, deltas = p.feed("<tool_call>not json</tool_call> and <tool_call>{\"name\"")
    assert text == "<tool_call>not json</tool_call> and " and not deltas
    assert p.flush() == ('<tool_call>{"name"', []) and not p.calls.gathered


@pytest.mark.pure
def test_glm_calls_inside_tool_call_tags() -> None:
    p = tools.HermesParser()
    text, deltas = p.feed("<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Oslo</arg_value>\n"
                          "<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n</tool_call>")
    assert text == "" and deltas[0].name == "get_weather"
    assert json.loads(p.calls.gathered[0]["function"]["arguments"]) == {"city": "Oslo", "days": 3}


@pytest.mark.pure
@pytest.mark.parametrize("reply,calls", [
    ('{"tool_call": {"name": "now", "arguments": {}}}', [("now", "{}")]),
    ('  {"name": "get_weather", "parameters": {"city": "Paris"}}', [("get_weather", '{"city": "Paris"}')]),
    ('{"tool_calls": [{"name": "now", "arguments": {}}, {"name": "now", "arguments": "{}"}]}',
     [("now", "{}"), ("now", "{}")]),
    ('{"answer": 42}', []),  # JSON, but no call: the answer
    ("Plain words {not json}", []),
])
def test_the_generic_format_takes_a_reply_that_is_one_json_call(reply: str, calls: list) -> None:
    p = tools.GenericParser()
    shown = "".join(p.feed(ch)[0] for ch in reply)
    tail, _ = p.flush()
    found = [(c["function"]["name"], c["function"]["arguments"]) for c in p.calls.gathered]
    assert found == calls
    assert (shown + tail) == ("" if calls else reply)


@pytest.mark.pure
def test_gpt_oss_calls_come_from_messages_to_functions() -> None:
    reply = ("<|channel|>analysis<|message|>need weather<|end|><|start|>assistant<|channel|>commentary "
             'to=functions.get_weather <|constrain|>json<|message|>{"city": "Oslo"}')
    split = ChannelSplitter("<|start|>assistant", calls=True)
    parser = tools.ReplyParser(split, "harmony")
    out = [parser.feed(ch) for ch in reply] + [parser.flush()]
    assert "".join(r for r, _, _ in out) == "need weather" and "".join(a for _, a, _ in out) == ""
    pieces = [d for _, _, ds in out for d in ds]
    assert pieces[0].name == "get_weather" and len(pieces) > 3, "arguments stream piece by piece"
    assert parser.calls == [{"id": pieces[0].id, "type": "function",
                             "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]
    # the header's other order (gpt-oss writes both), and without tools offered: hidden, as before
    other = tools.ReplyParser(ChannelSplitter("", calls=True), "harmony")
    other.feed('<|start|>assistant to=functions.now<|channel|>commentary json<|message|>{}<|call|>')
    assert [c["function"] for c in other.calls] == [{"name": "now", "arguments": "{}"}]
    hidden = tools.ReplyParser(ChannelSplitter(""), None)
    assert hidden.feed(reply) == ("need weather", "", []) and hidden.calls == []


@pytest.mark.pure
def test_templates_render_tools_past_calls_and_results() -> None:
    fmt = ChatFormat(QWEN_TOOLS.encode())
    assert fmt.renders_tools and not ChatFormat(CHATML.encode()).renders_tools
    call = tools.template_call(CALL)
    text = fmt.render([Message("user", "hi"), Message("assistant", "", (call,)),
                       Message("tool", "sunny", tool_call_id="call_1")], tools=TOOLS)
    assert '"name": "get_weather"' in text and "<tools>" in text
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text
    assert "<tool_response>\nsunny\n</tool_response>" in text
    # a template that prints the arguments as they are gets their JSON, not a Python dict
    assert str(call["function"]["arguments"]) == '{"city": "Paris"}'
    # tojson as transformers gives it: keys in order, no HTML escaping (Jinja's own wrote \u003c)
    assert '{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city"' in text
    odd = tools.template_call({"function": {"name": "f", "arguments": '{"q": "a<b"}'}})
    assert '"arguments": {"q": "a<b"}' in fmt.render([Message("assistant", "", (odd,))])


@pytest.mark.pure
def test_a_template_that_refuses_a_system_message_gets_the_tools_in_the_first_user_message() -> None:
    from bmoe.engine.completions import _render

    no_system = ("{% for m in messages %}{% if m.role == 'system' %}{{ raise_exception('System role not supported') }}"
                 "{% endif %}<{{ m.role }}>{{ m.content }}\n{% endfor %}<assistant>")
    request = tools.tool_request([WEATHER], "auto")
    text = _render(ChatFormat(no_system.encode()), [Message("user", "hi")], request, "generic", None)
    assert text.startswith("<user>You can call these functions:") and text.endswith("\n\nhi\n<assistant>")


@pytest.mark.pure
def test_a_forced_call_after_a_think_block_the_prompt_opened_closes_it_first() -> None:
    request = tools.tool_request([CLOCK], "required")
    assert tools.grammar(request, "hermes", lead="</think>\n\n").startswith(
        'root ::= "</think>\\n\\n" ( "<tool_call>\\n" ( t0-root ) "\\n</tool_call>" )')


# -- the Python API on tiny models -----------------------------------------------------------------


def test_a_forced_call_whole_and_streamed_from_the_python_api(qwen) -> None:  # noqa: ANN001
    from bmoe.engine.sync import SyncSession

    with SyncSession.open(qwen, CONFIG) as s:
        body = s.create_chat_completion(ASK, tools=TOOLS, tool_choice="required", max_tokens=150)
        chunks = list(s.create_chat_completion(ASK, tools=TOOLS, tool_choice="required", max_tokens=150, stream=True))
        named = s.create_chat_completion(ASK, tools=TOOLS, max_tokens=150,
                                         tool_choice={"type": "function", "function": {"name": "get_weather"}})
        none = s.create_chat_completion(ASK, tools=TOOLS, tool_choice="none", max_tokens=20)
    choice = body["choices"][0]
    assert choice["finish_reason"] == "tool_calls", choice
    assert choice["message"]["content"] is None and len(choice["message"]["tool_calls"]) == 1
    call = choice["message"]["tool_calls"][0]
    assert call["function"]["name"] in ("get_weather", "now")
    streamed, finish, deltas = _gathered(chunks)
    assert finish == "tool_calls" and [c["function"] for c in streamed] == [call["function"]]
    assert not any(d.get("content") for d in deltas), "no marker or JSON shown as text"
    assert sum(1 for d in deltas if d.get("tool_calls")) > 2, "the name first, then the arguments in pieces"
    _weather_args(named["choices"][0]["message"]["tool_calls"][0])
    # none: the same conversation gets no call (and the prompt is the one without tools: below)
    assert "tool_calls" not in none["choices"][0]["message"] and none["choices"][0]["finish_reason"] != "tool_calls"


def test_tools_and_a_tool_result_reach_the_template(qwen) -> None:  # noqa: ANN001
    from bmoe.engine.completions import prepare_chat_completion
    from bmoe.engine.sync import SyncSession

    with SyncSession.open(qwen, CONFIG) as s:
        offered = s.session.detokenize(prepare_chat_completion(s.session, ASK, tools=TOOLS).tokens)
        plain = s.session.detokenize(prepare_chat_completion(s.session, ASK, tools=TOOLS, tool_choice="none").tokens)
        assert plain == s.session.detokenize(prepare_chat_completion(s.session, ASK).tokens)
        back = s.session.detokenize(prepare_chat_completion(s.session, ANSWERED, tools=TOOLS).tokens)
        reply = s.create_chat_completion(ANSWERED, tools=TOOLS, max_tokens=8)
    assert '"name": "get_weather"' in offered and "get_weather" not in plain
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in back
    assert "<tool_response>\nsunny, 21 C\n</tool_response>" in back
    assert reply["object"] == "chat.completion"


def test_gpt_oss_calls_through_its_channels(gpt_oss) -> None:  # noqa: ANN001
    from bmoe.engine.completions import prepare_chat_completion
    from bmoe.engine.sync import SyncSession

    with SyncSession.open(gpt_oss, CONFIG) as s:
        # (SentencePiece detokenizes a control token with a space after it)
        prompt = s.session.detokenize(prepare_chat_completion(s.session, ANSWERED, tools=TOOLS).tokens)
        prompt = prompt.replace("|> ", "|>")
        kw = dict(tools=TOOLS, max_tokens=150, tool_choice={"type": "function", "function": {"name": "get_weather"}})
        body = s.create_chat_completion(ASK, **kw)
        chunks = list(s.create_chat_completion(ASK, stream=True, **kw))
    assert "type get_weather = " in prompt
    assert '<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>' \
           '{"city": "Paris"}' in prompt
    assert "<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>sunny, 21 C" in prompt
    choice = body["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None, choice
    args = _weather_args(choice["message"]["tool_calls"][0])
    streamed, finish, deltas = _gathered(chunks)
    assert finish == "tool_calls" and json.loads(streamed[0]["function"]["arguments"]) == args
    assert sum(1 for d in deltas if d.get("tool_calls")) > 2, "the arguments came in pieces"


def test_a_template_without_tools_gets_them_described_and_the_generic_format(tiny) -> None:  # noqa: ANN001
    from bmoe.engine.completions import prepare_chat_completion
    from bmoe.engine.sync import SyncSession

    with SyncSession.open(tiny.path(TinySpec()), CONFIG) as s:  # no template: the plain transcript
        prompt = s.session.detokenize(prepare_chat_completion(s.session, ANSWERED, tools=TOOLS).tokens)
        body = s.create_chat_completion(ASK, tools=[WEATHER], tool_choice="required", max_tokens=150)
    assert prompt.lstrip().startswith("system: You can call these functions:") and '"tool_call"' in prompt
    assert 'assistant: {"tool_call": {"name": "get_weather", "arguments": {"city": "Paris"}}}' in prompt
    assert body["choices"][0]["finish_reason"] == "tool_calls"
    _weather_args(body["choices"][0]["message"]["tool_calls"][0])


def test_a_forced_call_does_not_combine_with_a_grammar(qwen) -> None:  # noqa: ANN001
    from bmoe.engine.sync import SyncSession

    with SyncSession.open(qwen, CONFIG) as s:
        with pytest.raises(ParamError) as info:
            s.create_chat_completion(ASK, tools=TOOLS, tool_choice="required", response_format={"type": "json_object"})
        assert info.value.param == "tool_choice"
        with pytest.raises(ParamError) as info:
            s.create_chat_completion(ASK, functions=[{"name": "f"}])
        assert info.value.param == "functions"


def test_auto_lets_the_model_choose_and_its_call_is_parsed(qwen) -> None:  # noqa: ANN001
    """auto leaves the reply free; here a request grammar makes the model write a call (a model that
    chose to), which comes back parsed, not as text."""
    from bmoe.engine.sync import SyncSession

    written = 'root ::= "Checking.\\n<tool_call>\\n{\\"name\\": \\"now\\", \\"arguments\\": {}}\\n</tool_call>"'
    with SyncSession.open(qwen, CONFIG) as s:
        body = s.create_chat_completion(ASK, tools=TOOLS, max_tokens=150, grammar=written)
        chunks = list(s.create_chat_completion(ASK, tools=TOOLS, max_tokens=150, grammar=written, stream=True))
        as_text = s.create_chat_completion(ASK, max_tokens=150, grammar=written)  # no tools: no call
    message = body["choices"][0]["message"]
    assert body["choices"][0]["finish_reason"] == "tool_calls" and message["content"] == "Checking.\n"
    assert [c["function"] for c in message["tool_calls"]] == [{"name": "now", "arguments": "{}"}]
    streamed, finish, deltas = _gathered(chunks)
    assert finish == "tool_calls" and [c["function"] for c in streamed] == [{"name": "now", "arguments": "{}"}]
    assert "".join(d.get("content") or "" for d in deltas) == "Checking.\n"
    assert "<tool_call>" in as_text["choices"][0]["message"]["content"]


def test_a_thinking_template_with_a_forced_call(tmp_path) -> None:  # noqa: ANN001
    from bmoe.engine.sync import SyncSession

    path = _with_template(tmp_path, QWEN_TOOLS.replace("<|im_start|>assistant\n{% endif %}",
                                                        "<|im_start|>assistant\n<think>\n{% endif %}"))
    with SyncSession.open(path, CONFIG) as s:
        body = s.create_chat_completion(ASK, tools=TOOLS, tool_choice="required", max_tokens=150)
    choice = body["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None, choice
    assert "reasoning_content" not in choice["message"] and len(choice["message"]["tool_calls"]) == 1


# -- over HTTP, with the official client -----------------------------------------------------------


def test_bmoe_serve_answers_the_openai_client_with_tool_calls(qwen) -> None:  # noqa: ANN001
    from openai import BadRequestError, OpenAI

    proc = subprocess.Popen([sys.executable, "-m", "bmoe.cli", "serve", "-m", str(qwen), "--port", "0", "-c", "1024"],
                            stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stderr.readline()
        assert "http://127.0.0.1:" in line, line
        base = line.split()[-1].removesuffix("/v1")
        client = OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=GUARD_S)
        named = {"type": "function", "function": {"name": "get_weather"}}
        r = client.chat.completions.create(model="m", messages=ASK, tools=TOOLS, tool_choice=named, max_tokens=150)
        assert r.choices[0].finish_reason == "tool_calls"
        call = r.choices[0].message.tool_calls[0]
        assert call.function.name == "get_weather" and json.loads(call.function.arguments)["city"] in ("Paris", "Oslo")
        chunks = [c.model_dump() for c in client.chat.completions.create(
            model="m", messages=ASK, tools=TOOLS, tool_choice=named, max_tokens=150, stream=True)]
        streamed, finish, _ = _gathered(chunks)
        assert finish == "tool_calls" and streamed[0]["function"] == call.model_dump()["function"]
        # the result goes back; none makes no call
        again = client.chat.completions.create(model="m", messages=ANSWERED, tools=TOOLS, tool_choice="none",
                                               max_tokens=5)
        assert again.choices[0].message.tool_calls is None and again.choices[0].finish_reason != "tool_calls"
        with pytest.raises(BadRequestError) as info:
            client.chat.completions.create(model="m", messages=ASK, max_tokens=5, tools=[
                {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": 7}}}])
        assert info.value.body["param"] == "tools" and "tools[0]" in info.value.body["message"]
        bad = httpx.post(f"{base}/v1/chat/completions", timeout=GUARD_S,
                         json={"messages": ASK, "tools": [{"type": "function", "function": {"name": ""}}]})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "tools"
    finally:
        proc.terminate()
        proc.wait(GUARD_S)
