"""Completions in the shape llama-cpp-python and OpenAI clients know: plain dicts, written once.

``completion`` and ``chat_completion`` turn a ``Session.stream`` into the dicts of
``create_completion`` / ``create_chat_completion`` (``text_completion`` and ``chat.completion``
objects, or their ``...chunk`` pieces with ``stream=True``), with ``usage`` in the body or the last
chunk. The Python API (``Session.create_completion``, ``SyncSession``) and the HTTP server are thin
fronts over these two functions, so both say the same thing in the same shape.

One difference from llama-cpp-python on purpose: sampling is greedy unless a temperature is given
(bmoe's default everywhere), so the same request gives the same answer.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import aclosing
from typing import Any

from bmoe.engine.chat import Message
from bmoe.engine.sampling import SamplingParams, TokenLogprob
from bmoe.errors import ConfigError

# ``Session`` and ``Piece`` (bmoe.engine.session) are named in annotations only: session.py imports
# this module for its ``create_*`` methods, so importing it back would make a cycle.
Session = Piece = Any

ROLES = ("system", "user", "assistant", "tool", "developer")


def sampling_from(
    *, temperature: float | None = None, top_p: float | None = None, top_k: int | None = None,
    min_p: float | None = None, repeat_penalty: float | None = None, presence_penalty: float | None = None,
    frequency_penalty: float | None = None, seed: int | None = None, grammar: str | None = None,
    response_format: Mapping[str, Any] | None = None, logprobs: int | None = None,
) -> SamplingParams:
    """A SamplingParams from request-style arguments (None: the default)."""
    kw: dict[str, Any] = {}
    for name, value in (("temperature", temperature), ("top_p", top_p), ("top_k", top_k), ("min_p", min_p),
                        ("repeat_penalty", repeat_penalty), ("presence_penalty", presence_penalty),
                        ("frequency_penalty", frequency_penalty), ("seed", seed), ("grammar", grammar),
                        ("logprobs", logprobs)):
        if value is not None:
            kw[name] = value
    if response_format is not None:
        if not isinstance(response_format, Mapping):
            raise ConfigError("response_format must be an object with a 'type'")
        kind = response_format.get("type")
        if kind == "json_object":
            if response_format.get("schema") is not None:  # llama-cpp-python's spelling
                kw["json_schema"] = response_format["schema"]
            else:
                kw["json_object"] = True
        elif kind == "json_schema":
            spec = response_format.get("json_schema")
            schema = spec.get("schema") if isinstance(spec, Mapping) else None
            if schema is None:
                raise ConfigError("response_format json_schema needs json_schema.schema")
            kw["json_schema"] = schema
        elif kind != "text":
            raise ConfigError(f"response_format type must be text, json_object or json_schema, got {kind!r}")
    return SamplingParams(**kw)


def _max_tokens(value: int | None, default: int | None, session: Session, n_prompt: int) -> int:
    if n_prompt >= session.n_ctx:
        raise ConfigError(f"the prompt ({n_prompt} tokens) does not fit the context ({session.n_ctx} tokens)")
    if value is None:
        value = default if default is not None else session.n_ctx - n_prompt
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"max_tokens must be a positive integer, got {value!r}")
    return value


def messages_from(messages: Any) -> list[Message]:
    """Chat messages from OpenAI-style dicts (content as text, or a list of text parts)."""
    if not isinstance(messages, Sequence) or isinstance(messages, (str, bytes)) or not messages:
        raise ConfigError("messages must be a non-empty list of {role, content} objects")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping) or m.get("role") not in ROLES:
            raise ConfigError(f"messages[{i}] needs a role among {', '.join(ROLES)}")
        content = m.get("content")
        if content is None:
            content = ""
        elif isinstance(content, list):
            parts = [p.get("text") for p in content if isinstance(p, Mapping) and p.get("type") == "text"]
            if len(parts) != len(content) or not all(isinstance(p, str) for p in parts):
                raise ConfigError(f"messages[{i}].content: only text parts are supported")
            content = "".join(parts)
        elif not isinstance(content, str):
            raise ConfigError(f"messages[{i}].content must be text")
        role = "system" if m["role"] == "developer" else m["role"]
        out.append(Message(role, content))
    return out


class _Ids:
    def __init__(self, prefix: str, model: str | None, session: Session) -> None:
        self.id = f"{prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.model = model or session.model_name


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


async def completion(
    session: Session, prompt: str | Sequence[int], *, max_tokens: int | None = 16, stream: bool = False,
    stop: str | Sequence[str] | None = None, logprobs: int | None = None, model: str | None = None,
    n: int = 1, **sampling: Any,
) -> dict[str, Any] | AsyncIterator[dict[str, Any]]:
    """``create_completion``: a ``text_completion`` dict, or with ``stream=True`` an async iterator
    of chunk dicts (the last one carries ``finish_reason`` and ``usage``). ``sampling``: the
    arguments of ``sampling_from``."""
    if n != 1:
        raise ConfigError(f"n must be 1 (one generation at a time), got {n!r}")
    params = sampling_from(logprobs=logprobs, **sampling)
    tokens = session.tokenize(prompt) if isinstance(prompt, str) else list(prompt)
    limit = _max_tokens(max_tokens, 16, session, len(tokens))
    ids = _Ids("cmpl", model, session)
    pieces = session.stream(tokens, limit, sampling=params, stop=stop)

    def choice(text: str, piece: Piece, offset: int) -> dict[str, Any]:
        lp = None
        if logprobs is not None and piece.logprob is not None:
            tok = session.token_bytes(piece.token).decode("utf-8", errors="replace")  # type: ignore[arg-type]
            lp = {"tokens": [tok], "text_offset": [offset], "token_logprobs": [piece.logprob.logprob],
                  "top_logprobs": [{session.token_bytes(t).decode("utf-8", errors="replace"): v
                                    for t, v in piece.logprob.top}]}
        return {"text": text, "index": 0, "logprobs": lp, "finish_reason": piece.finish_reason}

    def chunk(body: dict[str, Any]) -> dict[str, Any]:
        return {"id": ids.id, "object": "text_completion", "created": ids.created, "model": ids.model, **body}

    if stream:
        first = await _prime(pieces)

        async def chunks() -> AsyncIterator[dict[str, Any]]:
            offset = 0
            async with aclosing(pieces):
                async for piece in _chain(first, pieces):
                    body = {"choices": [choice(piece.text, piece, offset)]}
                    offset += len(piece.text)
                    if piece.finish_reason is not None:
                        body["usage"] = _usage(piece)
                    yield chunk(body)

        return chunks()
    parts, lps, last = [], [], None
    offset = 0
    async with aclosing(pieces):
        async for piece in pieces:
            parts.append(piece.text)
            if piece.logprob is not None and logprobs is not None:
                lps.append(choice(piece.text, piece, offset)["logprobs"])
            offset += len(piece.text)
            last = piece
    assert last is not None
    merged = None
    if logprobs is not None:
        merged = {k: [x for lp in lps for x in lp[k]] for k in ("tokens", "text_offset", "token_logprobs", "top_logprobs")}
    return chunk({"choices": [{"text": "".join(parts), "index": 0, "logprobs": merged,
                               "finish_reason": last.finish_reason}], "usage": _usage(last)})


async def chat_completion(
    session: Session, messages: Any, *, max_tokens: int | None = None, stream: bool = False,
    stop: str | Sequence[str] | None = None, logprobs: bool = False, top_logprobs: int | None = None,
    model: str | None = None, n: int = 1, chat_template_kwargs: Mapping[str, Any] | None = None,
    **sampling: Any,
) -> dict[str, Any] | AsyncIterator[dict[str, Any]]:
    """``create_chat_completion``: the conversation rendered with the model's own chat template,
    answered as a ``chat.completion`` dict or ``chat.completion.chunk`` dicts.

    ``chat_template_kwargs`` reach the template (``{"enable_thinking": False}``). A reply that
    thinks in ``<think>...</think>`` or in gpt-oss's analysis channel has its reasoning in
    ``reasoning_content`` beside ``content`` (message and deltas), as llama-server reports it."""
    if n != 1:
        raise ConfigError(f"n must be 1 (one generation at a time), got {n!r}")
    if not isinstance(logprobs, bool):
        raise ConfigError("logprobs must be true or false for a chat completion")
    params = sampling_from(logprobs=(top_logprobs or 0) if logprobs else None, **sampling)
    if chat_template_kwargs is not None and not isinstance(chat_template_kwargs, Mapping):
        raise ConfigError("chat_template_kwargs must be an object")
    fmt = session.chat_format()
    prompt = fmt.render(messages_from(messages), chat_template_kwargs)
    split = fmt.splitter(prompt)
    tokens = session.tokenize(prompt, special=True)
    limit = _max_tokens(max_tokens, None, session, len(tokens))
    ids = _Ids("chatcmpl", model, session)
    pieces = session.stream(tokens, limit, sampling=params, stop=stop)

    def chunk(delta: dict[str, Any], piece: Piece | None) -> dict[str, Any]:
        lp = None
        if logprobs and piece is not None and piece.logprob is not None:
            lp = {"content": [_chat_logprob(session, piece.logprob)]}
        body: dict[str, Any] = {
            "id": ids.id, "object": "chat.completion.chunk", "created": ids.created, "model": ids.model,
            "choices": [{"index": 0, "delta": delta, "logprobs": lp,
                         "finish_reason": piece.finish_reason if piece is not None else None}],
        }
        if piece is not None and piece.finish_reason is not None:
            body["usage"] = _usage(piece)
        return body

    if stream:
        first = await _prime(pieces)

        async def chunks() -> AsyncIterator[dict[str, Any]]:
            yield chunk({"role": "assistant", "content": ""}, None)
            async with aclosing(pieces):
                async for piece in _chain(first, pieces):
                    reasoning, answer = split.feed(piece.text)
                    if piece.finish_reason is not None:
                        r2, a2 = split.flush()
                        reasoning, answer = reasoning + r2, answer + a2
                    delta = {}
                    if reasoning:
                        delta["reasoning_content"] = reasoning
                    if answer or (not reasoning and piece.finish_reason is None):
                        delta["content"] = answer
                    yield chunk(delta, piece)

        return chunks()
    parts, thoughts, content_lps, last = [], [], [], None
    async with aclosing(pieces):
        async for piece in pieces:
            reasoning, answer = split.feed(piece.text)
            parts.append(answer)
            thoughts.append(reasoning)
            if logprobs and piece.logprob is not None:
                content_lps.append(_chat_logprob(session, piece.logprob))
            last = piece
    assert last is not None
    reasoning, answer = split.flush()
    message = {"role": "assistant", "content": "".join(parts) + answer}
    if any(thoughts) or reasoning:
        message["reasoning_content"] = "".join(thoughts) + reasoning
    return {
        "id": ids.id, "object": "chat.completion", "created": ids.created, "model": ids.model,
        "choices": [{"index": 0, "message": message,
                     "logprobs": {"content": content_lps} if logprobs else None,
                     "finish_reason": last.finish_reason}],
        "usage": _usage(last),
    }


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
