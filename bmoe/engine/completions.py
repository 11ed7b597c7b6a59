"""Completions in the shape llama-cpp-python and OpenAI clients know: plain dicts, written once.

``completion`` and ``chat_completion`` turn a ``Session.stream`` into the dicts of
``create_completion`` / ``create_chat_completion`` (``text_completion`` and ``chat.completion``
objects, or their ``...chunk`` pieces with ``stream=True``), with ``usage`` in the body or the last
chunk. The Python API (``Session.create_completion``, ``SyncSession``) and the HTTP server are thin
fronts over these two functions, so both say the same thing in the same shape.

Each is two steps: ``prepare_completion`` / ``prepare_chat_completion`` check every value, render
and tokenize the prompt and check it fits the context (a ``ParamError`` naming the request field
otherwise), without touching the context; ``run`` generates. The server prepares a request as soon
as it arrives and queues only what was accepted, so both fronts refuse the same things, and a bad
request is refused at once even while another generation runs.

As in llama-cpp-python, control-token text in a prompt (``<|im_start|>``, ``</s>``) becomes its
token. Differences from llama-cpp-python on purpose:

- sampling is greedy unless a temperature is given (bmoe's default everywhere), so the same request
  gives the same answer; a temperature alone adds no top-k, top-p or min-p (OpenAI's reading, where
  llama-cpp-python adds 40 / 0.95 / 0.05);
- ``max_tokens`` None is 16 for a text completion (OpenAI's default; a chat's is the rest of the
  context) and 0 or less is refused (llama-cpp-python reads both as "up to the context");
- bytes that are not valid UTF-8 (a broken character anywhere, or one a reply ends inside) are
  U+FFFD, where llama-cpp-python drops them.
"""

from __future__ import annotations

import codecs
import dataclasses
import time
import uuid
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any, Protocol

from bmoe.engine import tools as toolcalls
from bmoe.engine.chat import ChatFormat, Message
from bmoe.engine.sampling import MAX_LOGPROBS, ParamError, SamplingParams, TokenLogprob
from bmoe.llama.seam import check_token_ids
from bmoe.engine.stops import StopStrings
from bmoe.engine.thinking import CLOSE as CLOSE_THINK, CUT, OPEN as OPEN_THINK
from bmoe.errors import ConfigError


# What this module uses of ``bmoe.engine.session``'s Session and Piece, written as protocols:
# session.py imports this module for its ``create_*`` methods, so importing it back would make a
# cycle. Any object with these members (a test's stand-in too) can be answered for.
class Usage(Protocol):
    prompt_tokens: int
    completion_tokens: int

    @property
    def total_tokens(self) -> int: ...

    @property
    def prompt_reused(self) -> int: ...


class Piece(Protocol):
    token: int | None
    text: str
    logprob: TokenLogprob | None
    finish_reason: str | None
    usage: Usage | None


class Session(Protocol):
    @property
    def n_ctx(self) -> int: ...

    @property
    def n_vocab(self) -> int: ...

    @property
    def model_name(self) -> str: ...

    def tokenize(self, text: str, *, special: bool = False) -> list[int]: ...

    def token_bytes(self, token: int) -> bytes: ...

    def check_grammar(self, sampling: SamplingParams) -> None: ...

    def chat_format(self) -> ChatFormat: ...

    def stream(self, prompt: str | Sequence[int], max_tokens: int = 64, *, sampling: SamplingParams | None = None,
               stop: Sequence[str] | str | None = None, reuse_prompt: bool | None = None) -> AsyncIterator[Piece]: ...


ROLES = ("system", "user", "assistant", "tool", "developer")
CONTEXT_FIX = "open the session with a larger RunConfig.n_ctx"


class ContextOverflow(ParamError):
    """A prompt (with the tokens asked for) longer than the context. The message names the knob
    that makes the context larger; a front with its own knob (a server's flag) says ``with_fix``."""

    def __init__(self, what: str, n_ctx: int, param: str) -> None:
        self.what, self.n_ctx = what, n_ctx
        super().__init__(self.with_fix(CONTEXT_FIX), param, "context_length_exceeded")

    def with_fix(self, fix: str) -> str:
        return f"{self.what} does not fit the context ({self.n_ctx} tokens); {fix}"


# Samplers bmoe has none for, at the values that leave them off: llama-cpp-python's
# create_completion arguments, and llama-server's names for the same (``mirostat``) or for what
# bmoe keeps fixed (``repeat_last_n``: the penalties look at the last 64 tokens). mirostat's tau and
# eta do nothing while its mode is 0, the only mode taken.
_OFF_VALUES: dict[str, float | bool] = {
    "typical_p": 1.0, "tfs_z": 1.0, "mirostat_mode": 0, "mirostat": 0, "ignore_eos": False, "n_probs": 0,
    "repeat_last_n": SamplingParams.penalty_last_n,
}
_INERT = frozenset({"mirostat_tau", "mirostat_eta"})


def _is_off(value: Any, off: float | bool) -> bool:
    """``value`` leaves the sampler off: None, or the off value in its own kind (``True`` is not 1)."""
    if value is None:
        return True
    if isinstance(off, bool) or isinstance(value, bool):
        return value is off
    return isinstance(value, int | float) and value == off


def sampling_from(
    *, temperature: float | None = None, top_p: float | None = None, top_k: int | None = None,
    min_p: float | None = None, repeat_penalty: float | None = None, presence_penalty: float | None = None,
    frequency_penalty: float | None = None, seed: int | None = None, grammar: str | None = None,
    response_format: Mapping[str, Any] | None = None, logprobs: int | None = None,
    logit_bias: Mapping[str, float] | None = None, **other: Any,
) -> SamplingParams:
    """A SamplingParams from request-style arguments (None: the default; ``seed`` -1: a fresh one,
    as llama.cpp spells it). A chat's ``top_logprobs`` is checked by name before it gets here.
    Any other argument is refused by name (it was a TypeError naming this function), except
    llama-cpp-python's samplers at the values that leave them off."""
    for name, value in other.items():
        if name in _INERT:
            continue
        if name in _OFF_VALUES and _is_off(value, _OFF_VALUES[name]):
            continue
        if name in _OFF_VALUES:
            raise ParamError(f"{name} is not supported (only {_OFF_VALUES[name]}, which leaves it off)", name)
        raise ParamError(f"unknown parameter {name!r}", name)
    kw: dict[str, Any] = {}
    if seed == -1 and not isinstance(seed, bool):
        seed = None
    for name, value in (("temperature", temperature), ("top_p", top_p), ("top_k", top_k), ("min_p", min_p),
                        ("repeat_penalty", repeat_penalty), ("presence_penalty", presence_penalty),
                        ("frequency_penalty", frequency_penalty), ("seed", seed), ("grammar", grammar),
                        ("logprobs", logprobs)):
        if value is not None:
            kw[name] = value
    if logit_bias is not None:
        kw["logit_bias"] = _logit_bias(logit_bias)
    if response_format is not None:
        kw.update(_response_format(response_format))
    try:
        return SamplingParams(**kw)
    except ParamError as exc:
        raise ParamError(str(exc), _RENAME.get(exc.param, exc.param)) from None


_RENAME = {"json_schema": "response_format", "json_object": "response_format"}  # SamplingParams' names -> requests'


def _logit_bias(bias: Any) -> tuple[tuple[int, float], ...]:
    """OpenAI's ``{"token id": bias}`` as (token id, bias) pairs (range checks: SamplingParams)."""
    if not isinstance(bias, Mapping):
        raise ParamError("logit_bias must be an object of token id: bias", "logit_bias")
    pairs = []
    for key, value in bias.items():
        token = key if isinstance(key, int) and not isinstance(key, bool) else None
        if isinstance(key, str) and key.isascii() and key.isdigit():
            token = int(key)
        if token is None:
            raise ParamError(f"logit_bias keys are token ids, got {key!r}", "logit_bias")
        pairs.append((token, value))
    return tuple(pairs)


def _response_format(spec: Any) -> dict[str, Any]:
    if not isinstance(spec, Mapping):
        raise ParamError("response_format must be an object with a 'type'", "response_format")
    kind = spec.get("type")
    if kind == "text":
        return {}
    if kind == "json_object":
        schema = spec.get("schema")  # llama-cpp-python's spelling of a schema in JSON mode
        if schema is None:
            return {"json_object": True}
    elif kind == "json_schema":
        inner = spec.get("json_schema")
        schema = inner.get("schema") if isinstance(inner, Mapping) else None
        if schema is None:
            raise ParamError("response_format json_schema needs json_schema.schema", "response_format")
    else:
        raise ParamError(f"response_format type must be text, json_object or json_schema, got {kind!r}",
                         "response_format")
    if not isinstance(schema, Mapping):
        raise ParamError("response_format: the schema must be a JSON object", "response_format")
    return {"json_schema": dict(schema)}


def _max_tokens(value: Any, default: int | None, session: Session, n_prompt: int, prompt_param: str) -> int:
    if n_prompt >= session.n_ctx:
        raise ContextOverflow(f"the prompt ({n_prompt} tokens)", session.n_ctx, prompt_param)
    if value is None:
        value = default if default is not None else session.n_ctx - n_prompt
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ParamError(f"max_tokens must be a positive integer, got {value!r}", "max_tokens")
    if n_prompt + value > session.n_ctx:
        raise ContextOverflow(f"the prompt ({n_prompt} tokens) with max_tokens {value}", session.n_ctx,
                              "max_tokens")
    return value


def messages_from(messages: Any) -> list[Message]:
    """Chat messages from OpenAI-style dicts (content as text, or a list of text parts)."""
    if not isinstance(messages, Sequence) or isinstance(messages, (str, bytes)) or not messages:
        raise ParamError("messages must be a non-empty list of {role, content} objects", "messages")
    out = []
    names: dict[Any, str] = {}  # tool call id -> function name
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping) or m.get("role") not in ROLES:
            raise ParamError(f"messages[{i}] needs a role among {', '.join(ROLES)}", "messages")
        content = m.get("content")
        calls = toolcalls.check_calls(i, m["tool_calls"]) if m["role"] == "assistant" and m.get(
            "tool_calls") else ()
        if content is None:
            # OpenAI refuses a message without content, except an assistant's that calls a tool
            if not (m["role"] == "assistant" and (m.get("tool_calls") or m.get("function_call"))):
                raise ParamError(f"messages[{i}] has no content (only an assistant message with tool_calls "
                                 "may leave it out)", "messages")
            content = ""
        elif isinstance(content, list):
            parts = [p.get("text") for p in content if isinstance(p, Mapping) and p.get("type") == "text"]
            if len(parts) != len(content) or not all(isinstance(p, str) for p in parts):
                raise ParamError(f"messages[{i}].content: only text parts are supported", "messages")
            content = "".join(parts)
        elif not isinstance(content, str):
            raise ParamError(f"messages[{i}].content must be text", "messages")
        role = "system" if m["role"] == "developer" else m["role"]
        call_id, name = m.get("tool_call_id"), m.get("name")
        if role == "tool":
            if call_id is not None and not isinstance(call_id, str):
                raise ParamError(f"messages[{i}].tool_call_id must be text", "messages")
            name = name if isinstance(name, str) else names.get(call_id)  # the call it answers, for templates
        else:
            call_id, name = None, None
        names.update({c.get("id"): c["function"]["name"] for c in calls})
        out.append(Message(role, content, calls, call_id, name))
    return out


@dataclass(frozen=True)
class Prepared:
    """A completion request the engine has accepted, not run yet: every value checked, the prompt
    rendered and tokenized, the context length checked. What ``run`` needs and nothing else.

    Preparing touches only the vocabulary (read-only in llama.cpp) and the chat template, never the
    context, so a server prepares a request as it arrives, while another generation runs, and
    refuses a bad one at once instead of when its turn comes. Only a grammar is compiled at the
    turn (by the sampler)."""

    kind: str  # "text_completion" | "chat.completion"
    tokens: tuple[int, ...]
    max_tokens: int
    sampling: SamplingParams
    stop: tuple[str, ...]
    stream: bool
    model: str
    logprobs: bool  # report them (how many alternatives: sampling.logprobs)
    splitter: Callable[[], toolcalls.ReplyParser] | None = None  # chat: a fresh reasoning / answer / calls parser
    prompt_chars: int = 0  # a text completion's prompt length in characters (``text_offset`` counts from it)
    include_usage: bool = False  # stream_options.include_usage: a last chunk with no choices carries usage
    reuse_prompt: bool | None = None  # False: evaluate the prompt from its first token (None: the session's config)


def _check_grammar(session: Session, params: SamplingParams) -> None:
    """A grammar llama.cpp cannot parse is refused as the request is prepared, naming the field."""
    try:
        session.check_grammar(params)
    except ParamError as exc:
        raise ParamError(str(exc), _RENAME.get(exc.param, exc.param)) from None


def _one(name: str, value: Any, allowed: Callable[[Any], bool], why: str) -> None:
    if not allowed(value):
        raise ParamError(f"{name} {why}", name)


def _common(session: Session, *, stream: Any, stop: Any, n: Any, model: Any,
            stream_options: Any = None) -> tuple[tuple[str, ...], str, bool]:
    """The checks both kinds share; the stop strings, the model name to report, include_usage."""
    _one("stream", stream, lambda v: isinstance(v, bool), "must be true or false")
    _one("stream_options", stream_options, lambda v: v is None or (  # OpenAI's rule: only with stream true
        stream is True and isinstance(v, Mapping) and isinstance(v.get("include_usage", False), bool)),
        "is only for a stream (stream true), an object whose include_usage is true or false")
    _one("n", n, lambda v: v == 1 and not isinstance(v, bool), f"must be 1 (one generation at a time), got {n!r}")
    _one("model", model, lambda v: v is None or isinstance(v, str), "must be text")
    try:
        stops = StopStrings(stop).stops
    except ConfigError as exc:
        raise ParamError(str(exc), "stop") from None
    return stops, model or session.model_name, bool(stream_options and stream_options.get("include_usage"))


def _tokenize(session: Session, text: str, param: str, special: bool = False) -> list[int]:
    """The text's tokens; a refusal names ``param`` (``Session.tokenize``'s own error would name
    neither it nor, for a chat, a place in the user's text rather than in the rendered template)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise ParamError(f"{param}: the text is not valid Unicode (a lone surrogate)", param) from None
    return session.tokenize(text, special=special)


def _prompt_tokens(session: Session, prompt: Any) -> list[int]:
    if isinstance(prompt, Sequence) and not isinstance(prompt, str) and prompt and all(
            isinstance(p, str) for p in prompt):
        if len(prompt) > 1:
            raise ParamError(f"one prompt at a time, got {len(prompt)}", "prompt")
        prompt = prompt[0]
    if isinstance(prompt, str):  # control-token text is its token, as llama-cpp-python and llama-server read it
        tokens = _tokenize(session, prompt, "prompt", special=True)
    elif isinstance(prompt, Sequence) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        try:
            tokens = check_token_ids(prompt, session.n_vocab, "prompt")
        except ConfigError as exc:
            raise ParamError(str(exc), "prompt") from None
    else:
        raise ParamError("a prompt is text or a list of token ids", "prompt")
    if not tokens:
        raise ParamError("the prompt tokenizes to nothing", "prompt")
    return tokens


def prepare_completion(
    session: Session, prompt: str | Sequence[int] | Sequence[str], *, max_tokens: int | None = 16,
    stream: bool = False, stop: str | Sequence[str] | None = None, logprobs: int | None = None,
    model: str | None = None, n: int = 1, echo: bool = False, suffix: str | None = None,
    best_of: int | None = None, stream_options: Mapping[str, Any] | None = None, **sampling: Any,
) -> Prepared:
    """A ``create_completion`` request checked and tokenized (``run`` answers it). ``prompt`` may
    also be a list of one string. ``echo``, ``suffix`` and ``best_of`` > 1 are refused, not
    ignored: bmoe does not do them."""
    stops, name, include_usage = _common(session, stream=stream, stop=stop, n=n, model=model,
                                         stream_options=stream_options)
    _one("echo", echo, lambda v: v is False, "is not supported (only false)")
    _one("suffix", suffix, lambda v: v is None or v == "", "is not supported")
    _one("best_of", best_of, lambda v: v is None or (v == 1 and not isinstance(v, bool)), "must be 1")
    params = sampling_from(logprobs=logprobs, **sampling)
    params.check_vocab(session.n_vocab)
    _check_grammar(session, params)
    tokens = _prompt_tokens(session, prompt)
    limit = _max_tokens(max_tokens, 16, session, len(tokens), "prompt")
    if isinstance(prompt, Sequence) and not isinstance(prompt, str) and isinstance(prompt[0], str):
        prompt = prompt[0]
    chars = len(prompt) if isinstance(prompt, str) else len(
        b"".join(session.token_bytes(t) for t in tokens).decode("utf-8", errors="replace"))
    return Prepared("text_completion", tuple(tokens), limit, params, stops, stream, name, logprobs is not None,
                    prompt_chars=chars, include_usage=include_usage)


def _legacy_functions(functions: Any, function_call: Any) -> None:
    """OpenAI's deprecated ``functions`` / ``function_call`` are refused by name: ``tools`` do the
    same (llama-server takes only ``tools`` too)."""
    if functions:
        raise ParamError("functions are not supported: send them as tools", "functions")
    if function_call not in (None, "none", "auto"):
        raise ParamError("function_call is not supported: send tools and tool_choice", "function_call")


def _render(fmt: ChatFormat, messages: list[Message], request: toolcalls.ToolRequest | None, style: str,
            template_kwargs: Mapping[str, Any] | None) -> str:
    """The prompt, with the tools. A template that renders tools itself gets them as they are; any
    other has them described in the system message (in the first user message where the template
    refuses a system message), and past calls written into the assistant's text, in the format
    the reply is parsed in."""
    if fmt.renders_tools:
        return fmt.render(messages, template_kwargs, request.template_tools() if request is not None else None)
    if any(m.tool_calls for m in messages):
        messages = [Message(m.role, "\n".join(x for x in (m.content, toolcalls.as_text(m.tool_calls)) if x))
                    if m.tool_calls else m for m in messages]
    if request is None:
        return fmt.render(messages, template_kwargs)
    text = toolcalls.describe(request, style)
    if messages[0].role == "system":
        described = [Message("system", messages[0].content + "\n\n" + text), *messages[1:]]
    else:
        described = [Message("system", text), *messages]
    try:
        return fmt.render(described, template_kwargs)
    except ParamError:
        user = next((i for i, m in enumerate(messages) if m.role == "user"), None)
        if user is None:
            raise
        m = messages[user]
        return fmt.render([*messages[:user], Message("user", text + "\n\n" + m.content), *messages[user + 1:]],
                          template_kwargs)


def prepare_chat_completion(
    session: Session, messages: Any, *, max_tokens: int | None = None, stream: bool = False,
    stop: str | Sequence[str] | None = None, logprobs: bool = False, top_logprobs: int | None = None,
    model: str | None = None, n: int = 1, chat_template_kwargs: Mapping[str, Any] | None = None,
    tools: Any = None, tool_choice: Any = None, parallel_tool_calls: bool | None = None, functions: Any = None,
    function_call: Any = None, stream_options: Mapping[str, Any] | None = None, **sampling: Any,
) -> Prepared:
    """A ``create_chat_completion`` request checked, rendered with the model's template and
    tokenized (``run`` answers it). ``tools`` / ``tool_choice``: ``bmoe.engine.tools``."""
    stops, name, include_usage = _common(session, stream=stream, stop=stop, n=n, model=model,
                                         stream_options=stream_options)
    _one("logprobs", logprobs, lambda v: isinstance(v, bool), "must be true or false for a chat completion")
    _one("chat_template_kwargs", chat_template_kwargs, lambda v: v is None or isinstance(v, Mapping),
         "must be an object")
    _legacy_functions(functions, function_call)
    request = toolcalls.tool_request(tools, tool_choice, parallel_tool_calls)
    _one("top_logprobs", top_logprobs,  # OpenAI bounds it whether or not logprobs is asked for
         lambda v: v is None or (isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= MAX_LOGPROBS),
         f"must be an integer in [0, {MAX_LOGPROBS}], got {top_logprobs!r}")
    params = sampling_from(logprobs=(top_logprobs or 0) if logprobs else None, **sampling)
    params.check_vocab(session.n_vocab)
    fmt = session.chat_format()
    style = toolcalls.style_of(fmt.template, fmt.channels)
    prompt = _render(fmt, messages_from(messages), request, style, chat_template_kwargs)
    # a generation prompt that opened a think block: a forced call closes it first
    forced = toolcalls.grammar(request, style, lead=CLOSE_THINK + "\n\n" if not fmt.channels and
                               prompt.rstrip().endswith(OPEN_THINK) else "") if request is not None else None
    if forced is not None:
        if params.gbnf() is not None:
            raise ParamError(f"tool_choice {tool_choice!r} constrains the reply to a call; it does not combine "
                             f"with a {params.grammar_param}", "tool_choice")
        params = dataclasses.replace(params, grammar=forced)
    _check_grammar(session, params)
    tokens = _tokenize(session, prompt, "messages", special=True)
    limit = _max_tokens(max_tokens, None, session, len(tokens), "messages")
    calls = style if request is not None else None
    return Prepared("chat.completion", tuple(tokens), limit, params, stops, stream, name, logprobs,
                    lambda: toolcalls.ReplyParser(fmt.splitter(prompt, calls=calls == "harmony"), calls),
                    include_usage=include_usage)


async def completion(session: Session, prompt: str | Sequence[int], **kwargs: Any) -> Any:
    """``create_completion``: a ``text_completion`` dict, or with ``stream=True`` an async iterator
    of chunk dicts (the last one carries ``finish_reason`` and ``usage``). ``kwargs``: those of
    ``prepare_completion``, then of ``sampling_from``."""
    return await run(session, prepare_completion(session, prompt, **kwargs))


async def chat_completion(session: Session, messages: Any, **kwargs: Any) -> Any:
    """``create_chat_completion``: the conversation rendered with the model's own chat template,
    answered as a ``chat.completion`` dict or ``chat.completion.chunk`` dicts.

    ``chat_template_kwargs`` reach the template (``{"enable_thinking": False}``). A reply that
    thinks in ``<think>...</think>`` or in gpt-oss's analysis channel has its reasoning in
    ``reasoning_content`` beside ``content`` (message and deltas), as llama-server reports it.
    With ``tools``, a call the reply makes comes back as ``message.tool_calls`` (or
    ``delta.tool_calls`` pieces) with ``finish_reason`` ``"tool_calls"`` (``bmoe.engine.tools``)."""
    return await run(session, prepare_chat_completion(session, messages, **kwargs))


async def run(session: Session, prepared: Prepared) -> dict[str, Any] | AsyncIterator[dict[str, Any]]:
    """Generate the answer to a prepared request: its dict, or (``stream``) an async iterator of
    chunk dicts whose first piece is already drawn, so a grammar llama.cpp refuses fails here,
    before a server has sent its status line."""
    if not isinstance(prepared, Prepared):
        raise ConfigError(f"run needs a Prepared request, got {type(prepared).__name__}")
    pieces = session.stream(list(prepared.tokens), prepared.max_tokens, sampling=prepared.sampling,
                            stop=prepared.stop, reuse_prompt=prepared.reuse_prompt)
    answer = _chat if prepared.kind == "chat.completion" else _text
    return await answer(session, prepared, pieces, _Ids(prepared))


class _Ids:
    def __init__(self, prepared: Prepared) -> None:
        self.id = f"{'chatcmpl' if prepared.kind == 'chat.completion' else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.model = prepared.model


def _usage(piece: Piece) -> dict[str, Any]:
    u = piece.usage
    assert u is not None
    return {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
            "total_tokens": u.total_tokens, "prompt_tokens_details": {"cached_tokens": u.prompt_reused}}


def _chat_logprob(session: Session, lp: TokenLogprob) -> dict[str, Any]:
    def entry(token: int, value: float) -> dict[str, Any]:
        text = session.token_bytes(token)
        return {"token": text.decode("utf-8", errors="replace"), "logprob": value, "bytes": list(text)}

    return {**entry(lp.token, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top]}


def _token_key(piece: bytes) -> str:
    """A token as a text completion's logprobs name it: its text, or, for a piece of a UTF-8
    character, ``bytes:\\xe2\\x80`` (OpenAI's spelling). Decoded with replacement, every such
    token was "\ufffd" and they overwrote each other in ``top_logprobs``."""
    try:
        return piece.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in piece)


class _Offsets:
    """``text_offset`` of each token: where its own text starts, counted from the start of the
    prompt as OpenAI and llama-cpp-python count it (the prompt's characters, then the reply's).
    Counted over the tokens' text, not the text released so far, which lags while a stop string's
    prefix is held. A character whose bytes span tokens belongs to the token that started it: the
    next token's own text starts after it."""

    def __init__(self, start: int) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._at = start

    def next(self, token_bytes: bytes) -> int:
        pending = bool(self._decoder.getstate()[0])  # a character begun by an earlier token
        at = self._at + pending
        self._at += len(self._decoder.decode(token_bytes))
        return at


async def _text(session: Session, p: Prepared, pieces: AsyncIterator[Piece], ids: _Ids) -> Any:
    offsets = _Offsets(p.prompt_chars)

    def choice(piece: Piece) -> dict[str, Any]:
        lp = None
        if p.logprobs and piece.logprob is not None:
            own = session.token_bytes(piece.token)
            top = {_token_key(session.token_bytes(t)): v for t, v in piece.logprob.top}
            top[_token_key(own)] = piece.logprob.logprob  # the chosen token is always there
            lp = {"tokens": [_token_key(own)], "text_offset": [offsets.next(own)],
                  "token_logprobs": [piece.logprob.logprob], "top_logprobs": [top]}
        return {"text": piece.text, "index": 0, "logprobs": lp, "finish_reason": piece.finish_reason}

    def chunk(body: dict[str, Any]) -> dict[str, Any]:
        return {"id": ids.id, "object": "text_completion", "created": ids.created, "model": ids.model, **body}

    if p.stream:
        first = await _prime(pieces)

        async def chunks() -> AsyncIterator[dict[str, Any]]:
            async with aclosing(pieces):
                async for piece in _chain(first, pieces):
                    body = {"choices": [choice(piece)]}
                    if piece.finish_reason is not None:
                        body["usage"] = _usage(piece)
                    yield chunk(body)
                    if piece.finish_reason is not None and p.include_usage:
                        yield chunk({"choices": [], "usage": body["usage"]})

        return chunks()
    parts, lps, last = [], [], None
    async with aclosing(pieces):
        async for piece in pieces:
            c = choice(piece)
            parts.append(piece.text)
            if c["logprobs"] is not None:
                lps.append(c["logprobs"])
            last = piece
    assert last is not None
    merged = None
    if p.logprobs:
        merged = {k: [x for lp in lps for x in lp[k]] for k in ("tokens", "text_offset", "token_logprobs", "top_logprobs")}
    return chunk({"choices": [{"text": "".join(parts), "index": 0, "logprobs": merged,
                               "finish_reason": last.finish_reason}], "usage": _usage(last)})


async def _chat(session: Session, p: Prepared, pieces: AsyncIterator[Piece], ids: _Ids) -> Any:
    assert p.splitter is not None
    split = p.splitter()

    def chunk(delta: dict[str, Any], piece: Piece | None) -> dict[str, Any]:
        lp = None
        if p.logprobs and piece is not None and piece.logprob is not None:
            lp = {"content": [_chat_logprob(session, piece.logprob)]}
        body: dict[str, Any] = {
            "id": ids.id, "object": "chat.completion.chunk", "created": ids.created, "model": ids.model,
            "choices": [{"index": 0, "delta": delta, "logprobs": lp,
                         "finish_reason": piece.finish_reason if piece is not None else None}],
        }
        if piece is not None and piece.finish_reason is not None:
            body["usage"] = _usage(piece)
        return body

    if p.stream:
        first = await _prime(pieces)

        async def chunks() -> AsyncIterator[dict[str, Any]]:
            yield chunk({"role": "assistant", "content": ""}, None)
            async with aclosing(pieces):
                async for piece in _chain(first, pieces):
                    reasoning, answer, calls = split.feed(piece.text)
                    if piece.finish_reason is not None:
                        r2, a2, c2 = split.flush(cut=piece.finish_reason in CUT)
                        reasoning, answer, calls = reasoning + r2, answer + a2, calls + c2
                    delta: dict[str, Any] = {}
                    if reasoning:
                        delta["reasoning_content"] = reasoning
                    if answer or (not reasoning and not calls and piece.finish_reason is None):
                        delta["content"] = answer
                    if calls:
                        delta["tool_calls"] = toolcalls.merge(calls)
                    out = chunk(delta, piece)
                    if piece.finish_reason is not None:
                        out["choices"][0]["finish_reason"] = _finish(piece.finish_reason, split)
                    yield out
                    if piece.finish_reason is not None and p.include_usage:
                        yield {**chunk({}, None), "choices": [], "usage": _usage(piece)}

        return chunks()
    parts, thoughts, content_lps, last = [], [], [], None
    async with aclosing(pieces):
        async for piece in pieces:
            reasoning, answer, _ = split.feed(piece.text)
            parts.append(answer)
            thoughts.append(reasoning)
            if p.logprobs and piece.logprob is not None:
                content_lps.append(_chat_logprob(session, piece.logprob))
            last = piece
    assert last is not None
    reasoning, answer, _ = split.flush(cut=last.finish_reason in CUT)
    message: dict[str, Any] = {"role": "assistant", "content": "".join(parts) + answer}
    if any(thoughts) or reasoning:
        message["reasoning_content"] = "".join(thoughts) + reasoning
    if split.calls:  # OpenAI's shape: no text beside the calls is null content
        message["tool_calls"] = split.calls
        if not message["content"].strip():
            message["content"] = None
    return {
        "id": ids.id, "object": "chat.completion", "created": ids.created, "model": ids.model,
        "choices": [{"index": 0, "message": message,
                     "logprobs": {"content": content_lps} if p.logprobs else None,
                     "finish_reason": _finish(last.finish_reason, split)}],
        "usage": _usage(last),
    }


def _finish(reason: str | None, split: toolcalls.ReplyParser) -> str | None:
    """A reply that ended on its own after calling a tool finished for ``tool_calls`` (OpenAI's
    reason); one cut by ``max_tokens`` or a cancel keeps its own."""
    return "tool_calls" if reason == "stop" and split.calls else reason


async def _prime(pieces: AsyncIterator[Piece]) -> Piece:
    """The first piece, taken before any chunk exists: a request the engine refuses (a prompt too
    long for the context, a bad grammar) fails here, before a server has sent its status line."""
    try:
        return await anext(pieces)
    except BaseException:
        await pieces.aclose()  # type: ignore[attr-defined]
        raise


async def _chain(first: Piece, rest: AsyncIterator[Piece]) -> AsyncIterator[Piece]:
    yield first
    if first.finish_reason is None:
        async for piece in rest:
            yield piece
