"""The routes: OpenAI's chat and text completions (JSON or server-sent events), models, health and
Prometheus metrics; llama-server's /tokenize, /detokenize and /props (``bmoe.server.llama_routes``);
/stats and the chat page at / (``bmoe.server.stats``, ``webui.html``); over one Session on the
server's own event loop.

A generation request goes: body read within a size limit and within the server's bound on the
bodies it holds at once (``bmoe.server.bodies``; 503 past it), then on a worker thread, never on
the loop, parsed, validated and prepared by the engine (``bmoe.engine.completions.prepare_*``:
every value checked, the prompt rendered and tokenized, its length checked against the context;
400 in OpenAI's error shape otherwise), admitted to the wait
list (503 with Retry-After when full), waits its turn (FIFO), then ``run`` answers it. A bad request
is refused as it arrives, never after waiting behind another generation. Nothing is sent before
the engine has accepted the request, so a grammar llama.cpp cannot parse is still a 400 when
``stream`` is true. From admission on, a listener watches for the client going away: while the
request waits, its wait is cancelled; while it generates, the generation is cancelled at its next
MoE layer and the next request runs normally.

At shutdown (``_Server.request_shutdown``, called by ``bmoe.server.run``'s signal handling) the
running generation is cancelled at once and ends like any other (a stream with its last chunk and
``data: [DONE]``), and requests still waiting get 503: uvicorn's graceful wait then has nothing to
wait for. Requests still being checked and tokenized (on the server's own two worker threads) are
waited for before the model they use is freed.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import hmac
import json
import logging
import math
import re
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from contextlib import aclosing, asynccontextmanager
from importlib import resources
from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import HTMLResponse, JSONResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from bmoe.engine.completions import (
    ContextOverflow,
    Prepared,
    prepare_chat_completion,
    prepare_completion,
    run,
)
from bmoe.engine.config import RunConfig
from bmoe.engine.lossy import lossy_label
from bmoe.engine.sampling import ParamError
from bmoe.engine.session import Session
from bmoe.errors import BmoeError, ConfigError, SessionClosedError
from bmoe.server import llama_routes
from bmoe.server.bodies import Bodies, BodiesFull, Held
from bmoe.server.fields import FieldError, check_fields
from bmoe.server.metrics import ServerMetrics
from bmoe.server.schemas import ChatRequest, CompletionRequest
from bmoe.server.stats import snapshot
from bmoe.server.turns import QueueFull, Turns

log = logging.getLogger("bmoe.server")
MAX_BODY_BYTES = 4 << 20
MAX_DEPTH = 100  # JSON nesting: deeper than any real request, far below Python's recursion limit
RETRY_AFTER_S = 2
IDLE_MEMORY_CHECK_S = 1.0  # between requests, how often the pressure guard looks at memory
PREPARE_THREADS = 2  # requests parsed, checked and tokenized at once
MAX_BODIES = 16  # requests being read, parsed or prepared at once; more get 503
HELD_BODIES = 4  # the bytes of all bodies held at once: this many of the largest allowed
BODY_DEADLINE_S = 60.0  # a body not whole by then is a 408 (its place and bytes given back)
CONTEXT_FIX = "start the server with a larger -c/--ctx"
_SURROGATE = re.compile("[\ud800-\udfff]")
_ESCAPED_SURROGATE = re.compile(rb"\\u[dD][89a-fA-F]")
T = TypeVar("T")
ECHO_CHARS = 80  # of a name the client sent, echoed in an error


def error_body(message: str, kind: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def _error(status: int, message: str, kind: str = "invalid_request_error", **kw: Any) -> JSONResponse:
    headers = kw.pop("headers", None)
    return JSONResponse(error_body(message, kind, **kw), status_code=status, headers=headers)


class _BadRequest(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error", headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.kind, self.headers = kind, headers

    @classmethod
    def of(cls, exc: ConfigError) -> _BadRequest:
        """The engine's refusal as a 400: its ``param`` and ``code`` when it names them, and the
        server's own flag where the engine names the Python API's knob."""
        message = exc.with_fix(CONTEXT_FIX) if isinstance(exc, ContextOverflow) else str(exc)
        if isinstance(exc, ParamError):
            return cls(400, message, exc.param, exc.code)
        return cls(400, message)

    @classmethod
    def busy(cls, why: str) -> _BadRequest:
        return cls(503, f"the server is busy: {why}", kind="server_busy",
                   headers={"Retry-After": str(RETRY_AFTER_S)})


def _own_names(bad: _BadRequest, request: ChatRequest | CompletionRequest) -> _BadRequest:
    """A refusal under the request's own name for the field (the engine knows the limit as
    max_tokens, a schema as response_format)."""
    own = None
    if bad.param == "max_tokens" and request.n_predict is not None:
        own = "n_predict"
    elif (bad.param == "max_tokens" and isinstance(request, ChatRequest) and request.max_tokens is None
            and request.max_completion_tokens is not None):
        own = "max_completion_tokens"
    elif bad.param == "response_format" and request.json_schema is not None:
        own = "json_schema"
    if own is not None:
        bad.message = bad.message.replace(bad.param, own)
        bad.param = own
    return bad


class _Gone(Exception):
    """The client went away before its whole body came (starlette's ClientDisconnect)."""


async def _read_body(request: Request, limit: int, held: Held, deadline_s: float) -> bytearray:
    """The body, counted in ``held`` as it comes (its declared length at once): 413 past
    ``limit``, 503 past the server's bound on the bytes of all bodies held, 408 when it has not
    come whole within ``deadline_s`` (a client trickling its bodies kept every place taken)."""
    declared = request.headers.get("content-length")
    try:
        if declared is not None and declared.isdigit():
            if int(declared) > limit:
                raise _BadRequest(413, f"the request body is larger than {limit} bytes")
            held.take(int(declared))
        body = bytearray()
        async with asyncio.timeout(deadline_s):
            async for part in request.stream():
                body += part
                if len(body) > limit:
                    raise _BadRequest(413, f"the request body is larger than {limit} bytes")
                held.upto(len(body))
    except TimeoutError:
        raise _BadRequest(408, f"the request body did not come whole within {deadline_s:g} s") from None
    except BodiesFull as exc:
        raise _BadRequest.busy(str(exc)) from None
    except ClientDisconnect:
        raise _Gone from None
    return body


def _parse(body: bytes | bytearray, schema: type[BaseModel]) -> Any:
    """The body as a request of ``schema``, or _BadRequest: on a worker thread, never on the
    loop (twenty 4 MiB bodies parsed there stalled every stream for 33 s)."""
    try:
        value = json.loads(body)
    except (ValueError, UnicodeDecodeError) as exc:
        raise _BadRequest(400, f"the body is not valid JSON: {exc}") from None
    except RecursionError:
        raise _BadRequest(400, f"the body is not valid JSON: nested deeper than {MAX_DEPTH} levels") from None
    if _may_hold_trouble(body):
        _check_tree(value)
    if not isinstance(value, dict):
        raise _BadRequest(400, "the body must be a JSON object")
    try:
        check_fields(value, schema.model_fields.keys())
    except FieldError as exc:
        raise _BadRequest(400, str(exc), exc.param, exc.code) from None
    try:
        return schema.model_validate(value)
    except ValidationError as exc:
        message, param = _validation_message(exc)
        raise _BadRequest(400, message, param) from None


def _may_hold_trouble(body: bytes | bytearray) -> bool:
    """Whether the parsed body may hold what ``_check_tree`` refuses, from its bytes. In an ASCII
    body without NULs (UTF-8, not the UTF-16 / 32 json.loads also reads, and no raw surrogate,
    which json's decode would let through) a lone surrogate can only come from a ``\\u`` escape, and
    nesting deeper than MAX_DEPTH needs more brackets than that. Byte scans in C spare the walk
    in Python over a large flat body (a prompt of a million token ids), whose holding of the GIL
    slowed the running generation's eval callbacks."""
    if not body.isascii() or b"\0" in body:
        return True
    return bool(_ESCAPED_SURROGATE.search(body)) or body.count(b"[") + body.count(b"{") > MAX_DEPTH


def _check_tree(value: Any) -> None:
    """Refuse what JSON lets through but nothing downstream can use: a lone surrogate
    (``"\\ud800"``), which no UTF-8 tokenizer or reply can encode, and nesting deep enough to
    exhaust the recursion of whatever walks the value next (a schema converter, a serializer).
    Iterative, so the check itself cannot recurse too deep."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, str):
            if _SURROGATE.search(item):
                raise _BadRequest(400, "the body holds a lone surrogate (\\ud800-\\udfff): not valid Unicode")
            continue
        if not isinstance(item, (list, dict)):
            continue
        if depth > MAX_DEPTH:
            raise _BadRequest(400, f"the body is not valid JSON: nested deeper than {MAX_DEPTH} levels")
        children = [*item.keys(), *item.values()] if isinstance(item, dict) else item
        stack.extend((x, depth + 1) for x in children if isinstance(x, (str, list, dict)))


def _validation_message(exc: ValidationError) -> tuple[str, str | None]:
    """The first error as one line, ``param`` the request's field. A field of several accepted
    types fails once per type, each located under the type's name (``prompt.str``,
    ``prompt.list[int]``): that is said as the types the field takes."""
    errors = exc.errors()
    loc = tuple(errors[0].get("loc", ()))
    if not loc:
        return str(errors[0].get("msg")), None
    field = str(loc[0])
    if len(loc) > 1 and isinstance(loc[1], str):  # a union's members
        kinds = list(dict.fromkeys(str(e["loc"][1]) for e in errors
                                   if len(e.get("loc", ())) > 1 and e["loc"][0] == loc[0] and isinstance(e["loc"][1], str)))
        return f"{field} must be one of: {', '.join(kinds)}", field
    where = field + "".join(f"[{x}]" if isinstance(x, int) else f".{x}" for x in loc[1:])
    return f"{where}: {errors[0].get('msg')}", field


class _Server:
    """What the routes share: the session, the turns, the metrics, the settings."""

    def __init__(self, session: Session | None, opener: Callable[[], Session] | None, *, api_key: str | None,
                 max_waiting: int, max_body: int, model_name: str | None, max_bodies: int = MAX_BODIES,
                 max_held_bytes: int | None = None, reuse_prompt: bool = True,
                 body_deadline_s: float = BODY_DEADLINE_S, slots: int = 1) -> None:
        self.session = session
        self._opener = opener
        self.api_key = api_key
        # As many generations at once as the session decodes together (RunConfig.parallel).
        self.turns = Turns(max_waiting, slots)
        self.max_body = max_body
        self.reuse_prompt = reuse_prompt  # False: no request reuses the context's prompt (--no-prompt-reuse)
        self.body_deadline_s = body_deadline_s
        self.bodies = Bodies(max_bodies, max_held_bytes or HELD_BODIES * max_body)
        self.metrics = ServerMetrics(lambda: self.turns.waiting, self._budget_bytes, lambda: self.bodies.count,
                                     self._step_figures)
        self.model_name = model_name
        self.created = int(time.time())
        self.stopping = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._owns = session is None
        # Requests are parsed, checked and tokenized here, off the loop: two at a time at most (a
        # flood of 4 MiB prompts queues here rather than taking every core), and the shutdown
        # waits for them before the model they tokenize with is freed.
        self._preparing = concurrent.futures.ThreadPoolExecutor(PREPARE_THREADS, thread_name_prefix="bmoe-prepare")

    def _step_figures(self) -> Any:
        """The step loop's figures for /metrics (None: no model open, or no step loop)."""
        session = self.session
        return None if session is None or session.closed or session.scheduler is None else session.scheduler.figures

    def slots(self) -> list[dict[str, Any]]:
        """What each sequence slot does (``/slots``, as llama-server's): one slot per sequence the
        session decodes together."""
        session = self.session
        if session is None or session.closed:
            raise SessionClosedError("the model is not open")
        if session.scheduler is not None:
            view = session.scheduler.slot_view()
        else:
            view = [{"id": 0, "state": "generating" if self.turns.running else "idle", "n_cached": None,
                     "n_prompt": None, "n_decoded": None}]
        return [{**v, "is_processing": v["state"] != "idle", "n_ctx": session.n_ctx_seq} for v in view]

    def _budget_bytes(self) -> float:
        """The cache budget now, for /metrics (NaN: no model open, or no cache)."""
        session = self.session
        budget = None if session is None or session.closed else session.budget_bytes
        return math.nan if budget is None else budget

    def open(self) -> None:
        self._loop = asyncio.get_running_loop()
        if self.session is None and self._opener is not None:
            self.session = self._opener()
        if self.model_name is None and self.session is not None:
            self.model_name = self.session.model_name

    def request_shutdown(self) -> None:
        """Begin the shutdown from anywhere (a signal handler, another thread): it runs on the
        server's loop, where the requests it ends run."""
        if self._loop is None or self._loop.is_closed():
            return
        self._loop.call_soon_threadsafe(self.begin_shutdown)

    def begin_shutdown(self) -> None:
        """Refuse new and waiting requests (503) and cancel the running generation now, rather
        than letting uvicorn's graceful wait run out and cut a stream off mid-way."""
        self.stopping = True
        if self.session is not None and not self.session.closed:
            self.session.cancel()

    def prepare(self, route: str, request: ChatRequest | CompletionRequest) -> Prepared:
        """The engine's checks and tokenization (on a worker thread: a long prompt does not stall
        the stream of the generation running meanwhile). Raises _BadRequest."""
        session = self.session
        if session is None or session.closed:
            raise SessionClosedError("the model is not open")
        kw = {**request.engine_kwargs(), "model": self.model_name}
        if isinstance(request, CompletionRequest) and request.prompt in ("", [""]):
            raise _BadRequest(400, "the prompt is empty", "prompt")  # as bmoe run -p '' is refused
        if request.json_schema is not None and request.response_format is not None:
            raise _BadRequest(400, "give json_schema or response_format, not both", "json_schema")
        to_context = request.n_predict == -1 and route == "completions"
        if to_context:
            kw["max_tokens"] = 1  # checked as the least, then the rest of the context
        try:
            if route == "chat":
                assert isinstance(request, ChatRequest)
                prepared = prepare_chat_completion(session, request.messages, **kw)
            else:
                assert isinstance(request, CompletionRequest)
                prepared = prepare_completion(session, request.prompt, **kw)
        except ConfigError as exc:
            raise _own_names(_BadRequest.of(exc), request) from None
        if to_context:
            prepared = dataclasses.replace(prepared, max_tokens=session.n_ctx - len(prepared.tokens))
        reuse = False if request.cache_prompt is False or not self.reuse_prompt else None
        return dataclasses.replace(prepared, reuse_prompt=reuse) if reuse is not None else prepared

    def parse_and_prepare(self, route: str, schema: type[BaseModel], body: bytes | bytearray) -> Prepared:
        return self.prepare(route, _parse(body, schema))

    def answer(self, fn: Callable[[Session, Any], dict[str, Any]], schema: type[BaseModel] | None,
               body: bytes | bytearray | None) -> dict[str, Any]:
        """``fn(session, request)`` for a route that asks the model something without generating
        (llama-server's /tokenize, /detokenize, /props); on a worker thread. Raises _BadRequest."""
        request = None if schema is None or body is None else _parse(body, schema)
        session = self.session
        if session is None or session.closed:
            raise SessionClosedError("the model is not open")
        try:
            return fn(session, request)
        except ConfigError as exc:
            raise _BadRequest.of(exc) from None

    async def off_loop(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` on a worker thread (a long prompt does not stall the stream of the
        generation running meanwhile). Raises what ``fn`` raises, or SessionClosedError once the
        server is stopping."""
        if self.stopping:
            raise SessionClosedError("the server is shutting down")
        try:
            work = self._preparing.submit(fn, *args)
        except RuntimeError:  # the pool is shut down: the server is closing
            raise SessionClosedError("the server is shutting down") from None
        # A client gone mid-way cancels this wait, never the thread: the shutdown waits for it.
        return await asyncio.wrap_future(work)

    async def close(self) -> None:
        """Wait for the requests still being tokenized (they use the model), then free the model
        if the server opened it (on this loop, the session's)."""
        self.stopping = True
        await asyncio.to_thread(self._preparing.shutdown, wait=True)
        if self._owns and self.session is not None:
            self.session.close()


class _ShuttingDown(Exception):
    pass


_NOT_RUN = object()  # a request that never reached the engine: no generation of its own to record


def _shutting_down() -> JSONResponse:
    return _error(503, "the server is shutting down", "server_error", code="server_shutting_down")


class _Generation(Response):
    """The answer to one prepared completion request: an error (400 for a grammar llama.cpp
    refuses, 503), a JSON body, or a stream of server-sent events ending ``data: [DONE]``."""

    def __init__(self, server: _Server, prepared: Prepared, arrived: float,
                 shape: Callable[[dict[str, Any]], dict[str, Any] | None] | None = None, done: bool = True) -> None:
        """``shape``: the engine's answer and chunks as the route's clients read them (OpenAI's by
        default; llama-server's for /completion, whose stream has no ``[DONE]``: ``done`` False)."""
        self._server, self._prepared, self._arrived = server, prepared, arrived
        self._shape, self._done = shape or _as_openai, done

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        server = self._server
        if server.stopping:
            server.metrics.requests.labels("unavailable").inc()
            await _shutting_down()(scope, receive, send)
            return
        try:
            server.turns.admit()
        except QueueFull:
            server.metrics.requests.labels("busy").inc()
            await _error(503, "the server is busy: every place in the queue is taken", "server_busy",
                         headers={"Retry-After": str(RETRY_AFTER_S)})(scope, receive, send)
            return
        me = asyncio.current_task()
        state = {"turn": False, "gone": False}

        async def listen() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass
            state["gone"] = True
            session = server.session
            if state["turn"] and session is not None and session.scheduler is None:
                session.cancel()  # ours is the running generation: stop it at its next MoE layer
            elif me is not None:
                # Still waiting: give up the place. Or one sequence of several: cancelling this
                # task closes its stream, and the step loop lets it go at the next step; the
                # others go on.
                me.cancel()

        listener = asyncio.create_task(listen())
        outcome = "ok"
        stats_before: Any = _NOT_RUN
        try:
            await server.turns.wait_turn()
            state["turn"] = True
            session = server.session
            if server.stopping:
                raise _ShuttingDown
            if session is None or session.closed:
                raise SessionClosedError("the model is not open")
            stats_before = session.last_stats
            started = time.monotonic()
            result = await run(session, self._prepared)
            if self._prepared.stream:  # its first piece is drawn
                server.metrics.first_token.observe(time.monotonic() - self._arrived)
            if server.stopping:  # the shutdown came while this generation was starting
                session.cancel()
            if not self._prepared.stream:
                await JSONResponse(self._shape(result))(scope, receive, send)
                return
            outcome = await self._send_events(result, send, state)
        except asyncio.CancelledError:
            outcome = "disconnected"
            if not state["gone"]:
                raise
            if me is not None:
                me.uncancel()  # the listener's own cancel, now handled
        except ConfigError as exc:
            outcome = "bad_request"
            bad = _BadRequest.of(exc)
            await _error(bad.status, bad.message, param=bad.param, code=bad.code)(scope, receive, send)
        except _ShuttingDown:
            outcome = "unavailable"
            await _shutting_down()(scope, receive, send)
        except SessionClosedError as exc:
            outcome = "unavailable"
            await _error(503, str(exc), "server_error")(scope, receive, send)
        except BmoeError as exc:
            outcome = "error"
            log.error("generation failed: %s", exc)
            await _error(500, str(exc), "server_error")(scope, receive, send)
        finally:
            listener.cancel()
            if state["gone"] and outcome == "ok":
                outcome = "disconnected"
            server.metrics.requests.labels(outcome).inc()
            session = server.session
            if stats_before is not _NOT_RUN and session is not None and session.last_stats is not stats_before:
                # this request's own generation ran (a refusal at the turn leaves the last one's)
                stats = session.last_stats
                server.metrics.record(stats, session.last_usage)
                if not self._prepared.stream and stats is not None and outcome == "ok":
                    server.metrics.first_token.observe(started - self._arrived + stats.prefill_s)
            if outcome == "ok":
                server.metrics.latency.observe(time.monotonic() - self._arrived)
            server.turns.leave(state["turn"])

    async def _send_events(self, chunks: AsyncIterator[dict[str, Any]], send: Send, state: dict) -> str:
        """Send the stream; its outcome for the request metric. A failure after the status line
        goes as an error event in the shape (and with the type) a 4xx or 5xx would have had."""
        await send({"type": "http.response.start", "status": 200, "headers": [
            (b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
            (b"x-accel-buffering", b"no"),
        ]})
        outcome = "ok"
        try:
            async with aclosing(chunks):
                async for engine_chunk in chunks:
                    if state["gone"]:
                        break
                    chunk = self._shape(engine_chunk)
                    if chunk is None:
                        continue
                    data = b"data: " + json.dumps(chunk, separators=(",", ":")).encode() + b"\n\n"
                    await send({"type": "http.response.body", "body": data, "more_body": True})
        except BmoeError as exc:  # the status line is out: the failure goes as an event
            if isinstance(exc, ConfigError):
                outcome, bad = "bad_request", _BadRequest.of(exc)
                body = error_body(bad.message, param=bad.param, code=bad.code)
            else:
                outcome, body = "error", error_body(str(exc), "server_error")
                log.error("generation failed mid-stream: %s", exc)
            data = b"data: " + json.dumps(body).encode() + b"\n\n"
            await send({"type": "http.response.body", "body": data, "more_body": True})
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n" if self._done else b"",
                    "more_body": False})
        return outcome


def _as_openai(chunk: dict[str, Any]) -> dict[str, Any] | None:
    """An engine's answer or chunk as OpenAI's clients read it, or None for a chunk that says
    nothing: a stream on a thinking template sent ``delta: {"content": ""}`` for each token the
    reasoning splitter held back (a tag), and a generation ended by a cancel (a client gone, the
    shutdown) finished as "cancelled", which is none of OpenAI's finish reasons: it is "length",
    an answer cut short."""
    choices = chunk.get("choices") or ()
    for choice in choices:
        if choice.get("finish_reason") == "cancelled":
            choice["finish_reason"] = "length"
    if (len(choices) == 1 and choices[0].get("delta") == {"content": ""} and choices[0].get("finish_reason") is None
            and choices[0].get("logprobs") is None and "usage" not in chunk):
        return None
    return chunk


def create_app(
    session: Session | None = None, *, model: str | Path | None = None, config: RunConfig | None = None,
    api_key: str | None = None, max_waiting: int = 8, max_body: int = MAX_BODY_BYTES,
    model_name: str | None = None, on_ready: Callable[[Session], None] | None = None,
    max_bodies: int = MAX_BODIES, max_held_bytes: int | None = None, reuse_prompt: bool = True,
    webui: bool = True, cors_origins: Sequence[str] = (), body_deadline_s: float = BODY_DEADLINE_S,
) -> Starlette:
    """The ASGI application: around an open ``session`` (left open at shutdown), or opening
    ``model`` with ``config`` at startup (closed at shutdown). At most ``max_bodies`` requests are
    read and checked at once, their bodies ``max_held_bytes`` together (``HELD_BODIES`` bodies of
    ``max_body`` bytes by default), each whole within ``body_deadline_s``. ``reuse_prompt`` False: no request reuses the prompt the
    context holds (a request's own ``cache_prompt: false`` does so for itself). ``webui``: the chat
    page at ``/`` (a JSON 404 there without it). ``cors_origins``: the origins a browser may call
    the server from (``*``: any)."""
    if (session is None) == (model is None):
        raise ConfigError("give the server either an open session or a model path")
    opener = None if model is None else (lambda: Session.open(model, config))
    slots = (session.config if session is not None else config or RunConfig()).parallel
    server = _Server(session, opener, api_key=api_key, max_waiting=max_waiting, max_body=max_body,
                     model_name=model_name, max_bodies=max_bodies, max_held_bytes=max_held_bytes,
                     reuse_prompt=reuse_prompt, body_deadline_s=body_deadline_s, slots=slots)

    @contextlib.contextmanager
    def holding() -> Iterator[Held]:
        try:
            with server.bodies.hold() as held:
                yield held
        except BodiesFull as exc:
            raise _BadRequest.busy(str(exc)) from None

    async def generation(request: Request, route: str, schema: type[BaseModel], **shape: Any) -> Response:
        """Read, parse, check and tokenize the request (the body held, and counted, until then),
        then answer it as a _Generation."""
        arrived = time.monotonic()
        try:
            with holding() as held:
                body = await _read_body(request, server.max_body, held, server.body_deadline_s)
                prepared = await server.off_loop(server.parse_and_prepare, route, schema, body)
        except SessionClosedError as exc:
            server.metrics.requests.labels("unavailable").inc()
            return _error(503, str(exc), "server_error")
        return _Generation(server, prepared, arrived, **shape)

    async def asking(request: Request, fn: Callable[[Session, Any], dict[str, Any]],
                     schema: type[BaseModel] | None) -> Response:
        try:
            if schema is None:
                return JSONResponse(await server.off_loop(server.answer, fn, None, None))
            with holding() as held:
                body = await _read_body(request, server.max_body, held, server.body_deadline_s)
                return JSONResponse(await server.off_loop(server.answer, fn, schema, body))
        except SessionClosedError as exc:
            return _error(503, str(exc), "server_error")

    async def tokenize(request: Request) -> Response:
        return await asking(request, llama_routes.tokenize, llama_routes.TokenizeRequest)

    async def detokenize(request: Request) -> Response:
        return await asking(request, llama_routes.detokenize, llama_routes.DetokenizeRequest)

    async def slots(_: Request) -> Response:
        try:
            return JSONResponse(server.slots())
        except SessionClosedError as exc:
            return _error(503, str(exc), "server_error")

    async def props(request: Request) -> Response:
        return await asking(request, lambda s, _: llama_routes.props(s, model_name=server.model_name,
                                                                     busy=bool(server.turns.running),
                                                                     reuse_prompt=server.reuse_prompt), None)

    async def chat(request: Request) -> Response:
        return await generation(request, "chat", ChatRequest)

    async def completions(request: Request) -> Response:
        return await generation(request, "completions", CompletionRequest)

    async def native_completion(request: Request) -> Response:
        return await generation(request, "completions", CompletionRequest, shape=llama_routes.native_completion,
                                done=False)

    def model_object() -> dict[str, Any]:
        out = {"id": server.model_name, "object": "model", "created": server.created, "owned_by": "bmoe"}
        session = server.session
        if session is not None:  # a server built on a lossy session says so (bmoe serve takes no lever)
            label = lossy_label(session.config)
            if label["lossy"]:
                out.update(label)
        return out

    async def models(_: Request) -> Response:
        return JSONResponse({"object": "list", "data": [model_object()]})

    async def one_model(request: Request) -> Response:
        name = request.path_params["model"]
        if name != server.model_name:
            shown = name if len(name) <= ECHO_CHARS else name[:ECHO_CHARS] + "..."
            return _error(404, f"the model {shown!r} does not exist (this server serves {server.model_name!r})",
                          param="model", code="model_not_found")
        return JSONResponse(model_object())

    async def health(_: Request) -> Response:
        if server.session is None or server.session.closed:
            return _error(503, "the model is not open", "server_error")
        changed = server.session.file_changed()
        if changed is not None:  # every completion fails now: a supervisor must see it and restart
            return _error(503, changed, "server_error")
        return JSONResponse({"status": "ok"})

    async def metrics(_: Request) -> Response:
        return Response(server.metrics.render(), media_type=server.metrics.content_type)

    async def watch_memory() -> None:
        """Between requests the guard is asked every second: an idle server kept its whole cache
        while other programs took the machine's memory, until its next request."""
        while True:
            await asyncio.sleep(IDLE_MEMORY_CHECK_S)
            session = server.session
            if session is not None and session.check_memory():  # False once closed
                log.warning("memory pressure: the expert cache budget is now %.0f MiB",
                            (session.budget_bytes or 0) / (1 << 20))

    @asynccontextmanager
    async def lifespan(_: Starlette) -> AsyncIterator[None]:
        server.open()
        if on_ready is not None and server.session is not None:
            on_ready(server.session)
        watcher = asyncio.create_task(watch_memory())
        try:
            yield
        finally:
            watcher.cancel()
            await server.close()

    async def bad_request(_: Request, exc: Exception) -> Response:
        assert isinstance(exc, _BadRequest)
        # refused before it reached the queue
        server.metrics.requests.labels("busy" if exc.status == 503 else "bad_request").inc()
        return _error(exc.status, exc.message, exc.kind, param=exc.param, code=exc.code, headers=exc.headers)

    async def gone(request: Request, _: Exception) -> Response:
        """A client that left mid-body: one debug line, never the ASGI traceback (a response to
        nobody is dropped by uvicorn)."""
        server.metrics.requests.labels("disconnected").inc()
        log.debug("%s %s: the client went away before its whole body came", request.method, request.url.path)
        return Response(status_code=400)

    async def http_error(_: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        return _error(exc.status_code, str(exc.detail))

    async def crash(_: Request, exc: Exception) -> Response:
        log.error("request failed: %r", exc)
        return _error(500, "internal error", "server_error")

    middleware = []
    if cors_origins:  # outermost: a preflight is answered before the key is asked for
        middleware.append(Middleware(CORSMiddleware, allow_origins=list(cors_origins), allow_methods=["*"],
                                     allow_headers=["*"], max_age=600))
    if api_key is not None:
        middleware.append(Middleware(_KeyGuard, key=api_key))
    page_html = (resources.files("bmoe.server") / "webui.html").read_bytes() if webui else b""

    async def page(_: Request) -> Response:
        return HTMLResponse(page_html, headers={"cache-control": "no-cache"})

    async def stats(_: Request) -> Response:
        return JSONResponse(snapshot(server.session, model=server.model_name, generating=bool(server.turns.running),
                                     waiting=server.turns.waiting, life_hit_pct=server.metrics.life_hit_pct,
                                     tokens=server.metrics.tokens_total, last=server.metrics.last_stats))

    app = Starlette(
        routes=[
            Route("/v1/chat/completions", chat, methods=["POST"]),
            Route("/v1/completions", completions, methods=["POST"]),
            # llama-server's spellings: the OpenAI routes without /v1, and its own /completion
            Route("/chat/completions", chat, methods=["POST"]),
            Route("/completions", completions, methods=["POST"]),
            Route("/completion", native_completion, methods=["POST"]),
            Route("/v1/models", models, methods=["GET"]),
            Route("/v1/models/{model:path}", one_model, methods=["GET"]),
            Route("/health", health, methods=["GET"]),
            Route("/tokenize", tokenize, methods=["POST"]),
            Route("/detokenize", detokenize, methods=["POST"]),
            Route("/props", props, methods=["GET"]),
            Route("/slots", slots, methods=["GET"]),
            Route("/metrics", metrics, methods=["GET"]),
            Route("/stats", stats, methods=["GET"]),
            *([Route("/", page, methods=["GET"])] if webui else []),
        ],
        middleware=middleware,
        exception_handlers={_BadRequest: bad_request, _Gone: gone, ClientDisconnect: gone, HTTPException: http_error,
                            Exception: crash},
        lifespan=lifespan,
    )
    app.router.redirect_slashes = False  # "/v1/completions/" is a 404 in the OpenAI shape, not a bare 307
    app.state.bmoe = server
    return app


class _KeyGuard:
    """Every route but /health and the page at / requires ``Authorization: Bearer <key>`` (401
    otherwise; the page holds no data and asks for the key itself); the scheme's name is
    case-insensitive (RFC 9110), the key is not. Inside the CORS middleware, so a browser's
    preflight (which carries no key) is answered."""

    OPEN = frozenset({"/health", "/"})

    def __init__(self, app: ASGIApp, key: str) -> None:
        self.app, self.expected = app, key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope.get("path") not in self.OPEN:
            scheme, _, given = dict(scope.get("headers") or ()).get(b"authorization", b"").partition(b" ")
            if scheme.lower() != b"bearer" or not hmac.compare_digest(given.strip(b" "), self.expected):
                await _error(401, "a valid API key is required (Authorization: Bearer KEY)",
                             code="invalid_api_key")(scope, receive, send)
                return
        await self.app(scope, receive, send)
