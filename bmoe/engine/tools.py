"""Tool calls (OpenAI's ``tools`` / ``tool_choice``): checked, shown to the model, forced by a
grammar when a call is required, and parsed back out of the reply, in the model's own format.

Three formats, chosen from the chat template (``style_of``), as llama.cpp's chat parsers do:

- ``hermes`` (Qwen2.5 / Qwen3, Hermes, and any template that writes ``<tool_call>``): a call is
  ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` in the answer, or GLM-4.5's
  ``<tool_call>NAME<arg_key>k</arg_key><arg_value>v</arg_value></tool_call>``;
- ``harmony`` (gpt-oss): a call is a message addressed to ``functions.NAME`` (``to=functions.NAME``
  in its header), its body the arguments' JSON; ``bmoe.engine.thinking.ChannelSplitter`` finds it;
- ``generic``: any other template. A reply that is one JSON object ``{"tool_call": {"name", "arguments"}}``
  (or ``{"tool_calls": [...]}``, or ``{"name", "arguments" | "parameters"}`` as Llama 3.x writes) is a
  call; any other reply is the answer.

The tools reach the model through its template (``tools`` in the Jinja context, as transformers and
llama.cpp pass them); a template that does not render them gets them described in a system message
instead, with the format to answer in. With ``tool_choice`` ``required`` or a named function, a
grammar lets the model write nothing but one call whose arguments match the function's JSON
schema (llama.cpp's converter, as for ``response_format``), so even random weights call. With
``auto`` the model is free (llama.cpp's lazy grammar, triggered by the call's opening marker, has no
counterpart in bmoe's sampler yet). ``none`` renders no tools and parses nothing: no call is ever
reported.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from bmoe.engine.sampling import ParamError, SamplingParams

_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for a function's name
OPEN, CLOSE = "<tool_call>", "</tool_call>"


@dataclass(frozen=True)
class Tool:
    name: str
    parameters: dict[str, Any]
    spec: dict[str, Any]  # the request's own entry, for the template


@dataclass(frozen=True)
class ToolRequest:
    """The tools a request offers the model, and whether it must call one (``forced``: any of
    them, or the one named)."""

    tools: tuple[Tool, ...]
    forced: bool
    only: str | None  # tool_choice named this function
    parallel: bool

    def template_tools(self) -> list[dict[str, Any]]:
        return [t.spec for t in self.tools]


def tool_request(tools: Any, tool_choice: Any, parallel_tool_calls: Any = None) -> ToolRequest | None:
    """Check ``tools`` and ``tool_choice`` (a ``ParamError`` naming the field); None when no tool
    may be called (no tools, an empty list, or ``tool_choice: "none"``)."""
    if parallel_tool_calls is not None and not isinstance(parallel_tool_calls, bool):
        raise ParamError("parallel_tool_calls must be true or false", "parallel_tool_calls")
    if tools is not None and (not isinstance(tools, Sequence) or isinstance(tools, (str, bytes))):
        raise ParamError("tools must be a list of {type: function, function: {name, parameters}}", "tools")
    checked = tuple(_tool(i, t) for i, t in enumerate(tools or ()))
    names = [t.name for t in checked]
    if len(set(names)) != len(names):
        raise ParamError("tools: two functions have the same name", "tools")
    only = None
    if isinstance(tool_choice, Mapping):
        fn = tool_choice.get("function")
        only = fn.get("name") if tool_choice.get("type") == "function" and isinstance(fn, Mapping) else None
        if not isinstance(only, str):
            raise ParamError("tool_choice must be none, auto, required or {type: function, function: {name}}",
                             "tool_choice")
        if only not in names:
            raise ParamError(f"tool_choice names {only!r}, which is not among the tools", "tool_choice")
    elif tool_choice not in (None, "none", "auto", "required"):
        raise ParamError(f"tool_choice must be none, auto, required or a function, got {tool_choice!r}",
                         "tool_choice")
    if not checked:
        if tool_choice not in (None, "none", "auto"):
            raise ParamError("tool_choice needs tools", "tool_choice")
        return None
    if tool_choice == "none":
        return None
    return ToolRequest(checked, tool_choice == "required" or only is not None, only, parallel_tool_calls is not False)


def _tool(i: int, spec: Any) -> Tool:
    where = f"tools[{i}]"
    if not isinstance(spec, Mapping) or spec.get("type") != "function" or not isinstance(spec.get("function"), Mapping):
        raise ParamError(f"{where} must be {{type: function, function: {{name, parameters}}}}", "tools")
    fn = spec["function"]
    name = fn.get("name")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ParamError(f"{where}.function.name must be 1 to 64 letters, digits, _ or -, got {name!r}", "tools")
    if fn.get("description") is not None and not isinstance(fn.get("description"), str):
        raise ParamError(f"{where}.function.description must be text", "tools")
    params = fn.get("parameters")
    if params is None:
        params = {"type": "object", "properties": {}}
    if not isinstance(params, Mapping):
        raise ParamError(f"{where}.function.parameters must be a JSON schema object", "tools")
    try:
        SamplingParams(json_schema=dict(params))  # the same converter a forced call's grammar uses
    except ParamError as exc:
        raise ParamError(f"{where}.function.parameters: {exc}", "tools") from None
    return Tool(name, dict(params), {"type": "function", "function": {**fn, "parameters": dict(params)}})


def style_of(template: bytes | None, channels: bool) -> str:
    """The reply format a chat template's model writes calls in."""
    if channels:
        return "harmony"
    if template is not None and OPEN.encode() in template:
        return "hermes"
    return "generic"


def describe(request: ToolRequest, style: str) -> str:
    """The tools and how to call them, for a template that does not render ``tools`` itself."""
    listing = "\n".join(json.dumps(t.spec["function"], ensure_ascii=False) for t in request.tools)
    how = {
        "hermes": f'{OPEN}\n{{"name": <function name>, "arguments": <arguments as a JSON object>}}\n{CLOSE}',
        "harmony": "a message on the commentary channel addressed to functions.<function name>, "
                   "whose body is the arguments as a JSON object",
        "generic": '{"tool_call": {"name": <function name>, "arguments": <arguments as a JSON object>}}, '
                   "and nothing else",
    }[style]
    return f"You can call these functions:\n{listing}\nTo call one, answer with {how}."


def grammar(request: ToolRequest, style: str, lead: str = "") -> str | None:
    """GBNF that allows one call and nothing else, when the request forces a call (after ``lead``,
    text the reply must begin with: the end of a think block its prompt opened)."""
    if not request.forced:
        return None
    tools = [t for t in request.tools if request.only in (None, t.name)]
    rules, alternatives = [], []
    for i, tool in enumerate(tools):
        prefix = f"t{i}-"
        if style == "harmony":
            schema: dict[str, Any] = tool.parameters
        else:
            schema = _object({"name": {"const": tool.name}, "arguments": tool.parameters})
            if style == "generic":
                schema = _object({"tool_call": schema})
        gbnf = SamplingParams(json_schema=schema).gbnf() or ""
        rules.append(_prefixed(gbnf, prefix))
        root = prefix + "root"
        if style == "harmony":
            alternatives.append(f'{json.dumps(tool.name + " <|constrain|>json<|message|>")} {root}')
        else:
            alternatives.append(root)
    body = " | ".join(alternatives)
    root = {
        "hermes": f'root ::= {json.dumps(OPEN + chr(10))} ( {body} ) {json.dumps(chr(10) + CLOSE)}',
        "harmony": f'root ::= "<|channel|>commentary to=functions." ( {body} )',
        "generic": f"root ::= {body}",
    }[style]
    if lead:
        root = root.replace("root ::= ", f"root ::= {json.dumps(lead)} ( ", 1) + " )"
    return "\n".join([root, *rules])


def _object(properties: dict[str, Any]) -> dict[str, Any]:
    return {"type": "object", "properties": properties, "required": list(properties), "additionalProperties": False}


_GBNF_TOKEN = re.compile(r'"(?:\\.|[^"\\])*"|\[(?:\\.|[^\]\\])*\]|[A-Za-z][A-Za-z0-9-]*|.', re.S)


def _prefixed(gbnf: str, prefix: str) -> str:
    """Every rule name of ``gbnf`` (defined or used) with ``prefix``, so that the grammars of
    several schemas share one file; literals and character classes are left as they are."""
    out = []
    for token in _GBNF_TOKEN.findall(gbnf):
        out.append(prefix + token if token[0].isalpha() else token)
    return "".join(out)


class JsonArgs(dict):  # type: ignore[type-arg]
    """A call's arguments as a template sees them: a mapping (``| tojson``, ``.items()``, as Qwen's
    and gpt-oss's templates want) that prints as its JSON (``{{ arguments }}``, as others write it)."""

    def __str__(self) -> str:
        return json.dumps(self, ensure_ascii=False)


def template_call(call: Mapping[str, Any]) -> dict[str, Any]:
    """An OpenAI tool call (arguments as JSON text) in the shape templates read."""
    fn = call.get("function") or {}
    args: Any = fn.get("arguments")
    if isinstance(args, str):
        try:
            parsed = json.loads(args) if args.strip() else {}
        except ValueError:
            parsed = None
        args = JsonArgs(parsed) if isinstance(parsed, dict) else args
    elif isinstance(args, Mapping):
        args = JsonArgs(args)
    out = {"type": "function", "function": {"name": fn.get("name"), "arguments": args}}
    if call.get("id") is not None:
        out["id"] = call["id"]
    return out


def check_calls(i: int, calls: Any) -> tuple[dict[str, Any], ...]:
    """An assistant message's ``tool_calls``, checked (``messages`` names the field)."""
    if not isinstance(calls, Sequence) or isinstance(calls, (str, bytes)):
        raise ParamError(f"messages[{i}].tool_calls must be a list", "messages")
    out = []
    for call in calls:
        fn = call.get("function") if isinstance(call, Mapping) else None
        if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str) or not isinstance(
                fn.get("arguments", ""), (str, Mapping)):
            raise ParamError(f"messages[{i}].tool_calls: each is {{id, type: function, function: {{name, "
                             "arguments}}}", "messages")
        out.append(template_call(call))
    return tuple(out)


def as_text(calls: Sequence[Mapping[str, Any]]) -> str:
    """Past calls written as the generic format asks the model to write them."""
    return "\n".join(json.dumps({"tool_call": {"name": c["function"]["name"], "arguments": c["function"]["arguments"]}},
                                ensure_ascii=False) for c in calls)


@dataclass
class CallDelta:
    """A piece of a call as a stream reports it: the first piece of call ``index`` carries its id
    and name, the next ones pieces of its arguments (JSON text)."""

    index: int
    arguments: str = ""
    id: str | None = None
    name: str | None = None

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"index": self.index}
        if self.id is not None:
            out.update(id=self.id, type="function")
        fn: dict[str, Any] = {}
        if self.name is not None:
            fn["name"] = self.name
        fn["arguments"] = self.arguments
        out["function"] = fn
        return out


def merge(deltas: Sequence[CallDelta]) -> list[dict[str, Any]]:
    """One stream chunk's call pieces, one entry per call (a client joins them by index)."""
    out: dict[int, CallDelta] = {}
    for d in deltas:
        have = out.get(d.index)
        if have is None:
            out[d.index] = CallDelta(d.index, d.arguments, d.id, d.name)
        else:
            have.arguments += d.arguments
            have.id, have.name = have.id or d.id, have.name or d.name
    return [d.as_dict() for d in out.values()]


@dataclass
class Calls:
    """Numbers the calls of one reply and gathers their pieces into the message's ``tool_calls``."""

    gathered: list[dict[str, Any]] = field(default_factory=list)

    def start(self, name: str, arguments: str = "") -> list[CallDelta]:
        index = len(self.gathered)
        call_id = f"call_{uuid.uuid4().hex[:24]}"
        self.gathered.append({"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}})
        return [CallDelta(index, "", call_id, name), *([CallDelta(index, arguments)] if arguments else [])]

    def more(self, arguments: str) -> list[CallDelta]:
        if not self.gathered or not arguments:
            return []
        self.gathered[-1]["function"]["arguments"] += arguments
        return [CallDelta(len(self.gathered) - 1, arguments)]


def _arguments_text(args: Any) -> str:
    return args if isinstance(args, str) else json.dumps(args if args is not None else {}, ensure_ascii=False)


def _calls_in(obj: Any) -> list[tuple[str, str]] | None:
    """(name, arguments JSON) of each call a parsed JSON reply holds, or None if it is no call."""
    if not isinstance(obj, Mapping):
        return None
    if isinstance(obj.get("tool_calls"), list):
        found = [_calls_in(c) for c in obj["tool_calls"]]
        return [c for one in found for c in one] if found and all(found) else None  # type: ignore[union-attr]
    if isinstance(obj.get("tool_call"), Mapping):
        return _calls_in(obj["tool_call"])
    if isinstance(obj.get("function"), Mapping):
        return _calls_in(obj["function"])
    name = obj.get("name")
    args = obj.get("arguments", obj.get("parameters"))
    if isinstance(name, str) and isinstance(args, (Mapping, str)) and set(obj) <= {"name", "arguments", "parameters", "id", "type"}:
        return [(name, _arguments_text(args))]
    return None


# The start of a call written name first (as the templates ask and a forced grammar writes it): from
# here on its arguments stream as they are written.
_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"([A-Za-z0-9_.-]{1,64})"\s*,\s*"arguments"\s*:\s*(?=\S)')


class HermesParser:
    """``<tool_call>{json}</tool_call>`` out of answer text: feed (content, call pieces). Text that
    may still become ``<tool_call>`` is held until the next piece decides. A call written name
    first is reported as soon as its name is, then its arguments piece by piece (held back: a last
    ``}`` and what follows it, which may be the call object's own end); any other block is read
    when it closes, and one whose JSON is no call stays content, as the model wrote it."""

    def __init__(self) -> None:
        self._held, self._inside = "", False
        self._body, self._sent = "", -1  # the open block's text; how much of it was sent (-1: no call yet)
        self.calls = Calls()

    def feed(self, text: str) -> tuple[str, list[CallDelta]]:
        pending, self._held = self._held + text, ""
        content, deltas = "", []
        while pending:
            if not self._inside:
                at = pending.find(OPEN)
                if at < 0:
                    keep = _partial(pending, OPEN)
                    content += pending[: len(pending) - keep]
                    self._held = pending[len(pending) - keep:]
                    break
                content += pending[:at]
                self._inside, pending = True, pending[at + len(OPEN):]
            else:
                at = pending.find(CLOSE)
                if at < 0:
                    keep = _partial(pending, CLOSE)
                    self._body += pending[: len(pending) - keep]
                    self._held = pending[len(pending) - keep:]
                    deltas += self._stream()
                    break
                self._body += pending[:at]
                pending = pending[at + len(CLOSE):]
                text_back, more = self._close()
                content += text_back
                deltas += more
        return content, deltas

    def _stream(self) -> list[CallDelta]:
        """The call's name once it is written, then what can be sent of its arguments."""
        out: list[CallDelta] = []
        if self._sent < 0:
            head = _HEAD.match(self._body)
            if head is None:
                return out
            out += self.calls.start(head.group(1))
            self._sent = head.end()
        end = self._body.rfind("}")
        limit = end if end >= self._sent and not self._body[end + 1:].strip() else len(self._body)
        if limit > self._sent:
            out += self.calls.more(self._body[self._sent:limit])
            self._sent = limit
        return out

    def _close(self) -> tuple[str, list[CallDelta]]:
        body, sent = self._body, self._sent
        self._inside, self._body, self._sent = False, "", -1
        if sent >= 0:  # a call already under way: the rest of its arguments, up to the object's end
            end = body.rfind("}")
            return "", self.calls.more(body[sent:end] if end > sent else "")
        found = _parse_calls(body)
        if found is None:
            return OPEN + body + CLOSE, []
        return "", [d for name, args in found for d in self.calls.start(name, args)]

    def flush(self, cut: bool = False) -> tuple[str, list[CallDelta]]:
        """An unclosed block is what the model wrote, not a call: content (a marker's start is
        dropped when ``cut``, as the reasoning splitters drop it); a call under way keeps what it
        had, as OpenAI's reply cut by ``max_tokens`` does."""
        held, self._held = self._held, ""
        if self._inside and self._sent >= 0:
            if _parse_calls(self._body) is not None:  # whole, only its </tool_call> missing
                return self._close()
            rest = self._body[self._sent:] + ("" if cut else held)
            self._inside, self._body, self._sent = False, "", -1
            return "", self.calls.more(rest)
        if cut and not self._inside:
            return "", []
        text = (OPEN + self._body if self._inside else "") + held
        self._inside, self._body = False, ""
        return text, []


def _parse_calls(body: str) -> list[tuple[str, str]] | None:
    try:
        return _calls_in(json.loads(body))
    except ValueError:
        return _glm_call(body)


_GLM = re.compile(r"\s*([A-Za-z0-9_.-]{1,64})\s*((?:<arg_key>.*?</arg_key>\s*<arg_value>.*?</arg_value>\s*)*)", re.S)
_GLM_PAIR = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.S)


def _glm_call(body: str) -> list[tuple[str, str]] | None:
    """GLM-4.5's call inside ``<tool_call>``: the name, then ``<arg_key>k</arg_key><arg_value>v</arg_value>``
    pairs (a value is JSON where it parses, else text, as GLM's template writes strings bare)."""
    found = _GLM.fullmatch(body)
    if found is None:
        return None
    args: dict[str, Any] = {}
    for key, value in _GLM_PAIR.findall(found.group(2)):
        try:
            args[key.strip()] = json.loads(value)
        except ValueError:
            args[key.strip()] = value
    return [(found.group(1), json.dumps(args, ensure_ascii=False))]


class GenericParser:
    """A reply that is one JSON call object (``_calls_in``) is that call; anything else is the
    answer. A reply that begins with ``{`` is held whole until it ends (it may be a call)."""

    def __init__(self) -> None:
        self._held, self._state = "", "start"
        self.calls = Calls()

    def feed(self, text: str) -> tuple[str, list[CallDelta]]:
        if self._state == "plain":
            return text, []
        self._held += text
        stripped = self._held.lstrip()
        if not stripped:
            return "", []
        if stripped.startswith("{"):
            self._state = "json"
            return "", []
        self._state, held, self._held = "plain", self._held, ""
        return held, []

    def flush(self, cut: bool = False) -> tuple[str, list[CallDelta]]:
        held, self._held = self._held, ""
        if self._state == "json" and not cut:
            found = _parse_calls(held)
            if found:
                return "", [d for name, args in found for d in self.calls.start(name, args)]
        return held, []


class HarmonyCalls:
    """gpt-oss's calls as ``ChannelSplitter`` reports them (``take_calls``): a name when a message
    to ``functions.NAME`` opens, then pieces of its body. The answer text passes through."""

    def __init__(self, splitter: Any) -> None:
        self._splitter = splitter
        self.calls = Calls()

    def feed(self, text: str) -> tuple[str, list[CallDelta]]:
        return text, self._drain()

    def flush(self, cut: bool = False) -> tuple[str, list[CallDelta]]:
        return "", self._drain()

    def _drain(self) -> list[CallDelta]:
        deltas: list[CallDelta] = []
        for kind, text in self._splitter.take_calls():
            deltas += self.calls.start(text) if kind == "name" else self.calls.more(text)
        return deltas


class ReplyParser:
    """A reply split three ways: reasoning, the answer's content, and tool calls. ``feed`` and
    ``flush`` return (reasoning, content, call pieces)."""

    def __init__(self, splitter: Any, style: str | None) -> None:
        self._split = splitter
        self._calls: Any = None
        if style == "hermes":
            self._calls = HermesParser()
        elif style == "generic":
            self._calls = GenericParser()
        elif style == "harmony":
            self._calls = HarmonyCalls(splitter)

    @property
    def calls(self) -> list[dict[str, Any]]:
        """The calls made so far, whole (a message's ``tool_calls``)."""
        return self._calls.calls.gathered if self._calls is not None else []

    def feed(self, text: str) -> tuple[str, str, list[CallDelta]]:
        reasoning, answer = self._split.feed(text)
        if self._calls is None:
            return reasoning, answer, []
        content, deltas = self._calls.feed(answer)
        return reasoning, content, deltas

    def flush(self, cut: bool = False) -> tuple[str, str, list[CallDelta]]:
        reasoning, answer = self._split.flush(cut=cut)
        if self._calls is None:
            return reasoning, answer, []
        content, deltas = self._calls.feed(answer)
        tail, more = self._calls.flush(cut=cut)
        return reasoning, content + tail, deltas + more


def _partial(text: str, tag: str) -> int:
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0
