"""``bmoe chat``: the interactive multi-turn chat, its slash commands, and the line reader that
keeps a stop signal from waiting on a blocked ``readline``; the expert cache stays warm between
turns."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from pathlib import Path

from bmoe.cli.edge import _SIGINT_TAKEN_BY, _prompt_text, _run
from bmoe.cli.flags import (
    _check_outputs,
    _common_flags,
    _config,
    _Help,
    _lossy_cli,
    _model_files,
    _model_flag,
    _sampling,
    _sampling_flags,
    _tokens,
    _verbosity_flags,
)
from bmoe.cli.generate import _summary
from bmoe.engine.config import RunConfig
from bmoe.engine.thinking import CUT
from bmoe.errors import ConfigError

DEFAULT_REPLY_TOKENS = 256


def _chat_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("chat", help="interactive multi-turn chat; the expert cache stays warm",
                       formatter_class=_Help)
    _model_flag(p)
    p.add_argument("-n", "--n-predict", type=_tokens, default=None,
                   help=f"most tokens per reply (default {DEFAULT_REPLY_TOKENS}, or half the context if that is smaller)")
    p.add_argument("--system", default=None, help="system message")
    p.add_argument("--no-think", action="store_true",
                   help="ask a thinking model to answer without reasoning first (enable_thinking=false)")
    _common_flags(p)
    _lossy_cli(p)
    _sampling_flags(p)
    _verbosity_flags(p)
    p.set_defaults(mode="stream", func=_cmd_chat)


def _cmd_chat(args: argparse.Namespace) -> int:
    if hasattr(sys.stdin, "reconfigure"):
        sys.stdin.reconfigure(errors="surrogateescape")  # bytes that are not UTF-8 reach _prompt_text
    _check_outputs(args, _model_files(args.model), "--route-trace", "--cache-profile")
    config, sampling = _config(args), _sampling(args)
    from bmoe.engine.stops import StopStrings

    StopStrings(args.stop)  # a bad --stop is refused now, not after the first message
    _run(_chat(args.model, config, args.system, args.n_predict, sampling=sampling, stop=args.stop,
               quiet=args.quiet, think=not args.no_think))
    return 0


CHAT_HELP = """commands:
  /help           this list
  /reset          forget the conversation (the system message stays)
  /stats          what the last reply measured, and the session's totals
  /think on|off   let a thinking model reason first (shown dimmed), or not
  /exit           leave (so do Ctrl-D, and Ctrl-C twice at an empty prompt)
keys: up and down recall earlier lines; Esc then Enter (or Alt-Enter) starts a new line;
Ctrl-C stops a reply and keeps the conversation; at the prompt it clears the line."""


async def _chat(model: Path, config: RunConfig, system: str | None, n: int | None, *, sampling=None,  # noqa: ANN001
                stop: list[str] | None = None, quiet: bool = False, think: bool = True) -> None:
    """The interactive chat. Line editing and history (prompt_toolkit) when standard input is a
    terminal, plain lines otherwise; prompts go to stderr when standard output is not a terminal,
    so a redirected transcript holds only the replies."""
    from bmoe.engine.chat import Message
    from bmoe.engine.session import Session

    with Session.open(model, config) as session:
        if n is None:  # a small -c still leaves room for the conversation
            n = min(DEFAULT_REPLY_TOKENS, session.n_ctx // 2)
        elif n >= session.n_ctx:  # every message would be refused, one by one
            raise ConfigError(f"-n {n} leaves no room in the context ({session.n_ctx} tokens) for a message: "
                              "lower -n or raise -c")
        for warning in () if quiet else session.warnings:
            print(f"bmoe: warning: {warning}", file=sys.stderr)
        fmt = session.chat_format()
        start: list[Message] = [Message("system", system)] if system else []
        if start:  # else every message would be refused as too long, one by one
            empty = fmt.render([*start, Message("user", "")], {"enable_thinking": think})
            if len(session.tokenize(empty, special=True)) + n > session.n_ctx:
                raise ConfigError(f"the system message leaves no room in the context ({session.n_ctx} tokens, {n} "
                                  "of them kept for the reply) for a message: shorten it, or raise -c or lower -n")
        tty = sys.stdout.isatty()
        if not quiet:
            print(_banner(model, session, fmt, n, think), file=sys.stderr)
        history = list(start)
        read_line = _line_reader()
        totals = {"replies": 0, "tokens": 0, "prompt": 0, "reused": 0}
        while True:
            try:
                line = await read_line("> ")
            except _EmptyInterrupt:  # Ctrl-C at an empty prompt: say how to leave (a second one does)
                print("(Ctrl-C again, Ctrl-D or /exit leaves)", file=sys.stderr)
                continue
            except KeyboardInterrupt:
                continue  # Ctrl-C at the prompt: the line is dropped, the chat goes on
            except EOFError:
                print(file=sys.stderr)
                return
            text = line.strip()
            if not text:
                continue
            if text.startswith("/"):
                command = text.split()[0]
                if command in ("/exit", "/quit"):
                    return
                if command == "/help":
                    print(CHAT_HELP, file=sys.stderr)
                elif command == "/reset":
                    history = list(start)
                    print("conversation cleared", file=sys.stderr)
                elif command == "/stats":
                    print(_chat_stats(session, totals), file=sys.stderr)
                elif command == "/think":
                    if text.split()[1:] not in (["on"], ["off"]):
                        print(f"/think takes on or off (thinking is {'on' if think else 'off'})", file=sys.stderr)
                        continue
                    think = text.split()[1] == "on"
                    print(f"thinking {'on' if think else 'off'}"
                          + ("" if fmt.thinks else " (this model's template has no thinking switch)"), file=sys.stderr)
                else:
                    print(f"unknown command {command}; /help lists them", file=sys.stderr)
                continue
            try:
                prompt, kept = _fit(session, fmt, [*history, Message("user", _prompt_text(line))], n,
                                    {"enable_thinking": think})
            except ConfigError as exc:  # this message only: the conversation goes on without it
                print(f"bmoe: {exc}", file=sys.stderr)
                continue
            reply = _Reply(tty)
            split = fmt.splitter(prompt)
            finish = None
            _SIGINT_TAKEN_BY.append(session.cancel)  # Ctrl-C ends this reply only
            try:
                async for piece in session.stream(prompt, n, special=True, sampling=sampling, stop=stop):
                    reasoning, answer = split.feed(piece.text)
                    if piece.finish_reason is not None:
                        r2, a2 = split.flush(cut=piece.finish_reason in CUT)
                        reasoning, answer = reasoning + r2, answer + a2
                    reply.show(reasoning, answer)
                    if piece.usage is not None:
                        finish = piece.finish_reason
                        totals["replies"] += 1
                        totals["tokens"] += piece.usage.completion_tokens
                        totals["prompt"] += piece.usage.prompt_tokens
                        totals["reused"] += piece.usage.prompt_reused
            finally:
                _SIGINT_TAKEN_BY.remove(session.cancel)
            history, note = _settle(history, kept, reply.answer, finish, n, reply.reasoned)
            reply.end(note, quiet)
            stats = session.last_stats
            if stats is not None and not quiet:
                print(_summary(_figures(session, stats)), file=sys.stderr)


def _banner(model: Path, session, fmt, n: int, think: bool) -> str:  # noqa: ANN001
    """What the chat runs: the file, how, the context, the template; and how to get help."""
    from bmoe.engine.lossy import lossy_flags
    from bmoe.pipeline.budget import mib_text

    how = "resident"
    if session.config.mode != "resident":
        budget = session.budget_bytes
        how = "streamed, " + (f"cache {mib_text(budget)} MiB" if budget else "cache off")
    flags = lossy_flags(session.config)
    if flags:
        how += f", LOSSY {' '.join(flags)}"
    arch = getattr(getattr(session, "layout", None), "arch", None)
    first = (f"bmoe chat: {model.name}" + (f" ({arch})" if arch else "")
             + f", {how}, context {session.n_ctx} tokens, replies up to {n} tokens (-n)")
    thinking = f"; thinking {'on' if think else 'off'} (/think)" if fmt.thinks else ""
    return f"{first}\n{fmt.description}{thinking}. /help lists commands; Ctrl-D leaves."


# C0 controls but newline and tab, DEL, C1 controls: never written raw to a terminal, where a model's
# escape sequence, backspace or carriage return would move the cursor or change the terminal's state.
_CONTROLS = {c: (chr(0x2400 + c) if c < 0x20 else "\ufffd") for c in (*range(0x20), *range(0x7F, 0xA0))}
_CONTROLS[0x7F] = "\u2421"
_CONTROLS[ord("\r")] = None
del _CONTROLS[ord("\n")], _CONTROLS[ord("\t")]


class _Reply:
    """A reply as it streams to standard output. On a terminal the reasoning is shown dimmed, on a
    line of its own before the answer, and control characters are shown as symbols; a redirected
    transcript gets the answer only, as the model wrote it."""

    def __init__(self, tty: bool) -> None:
        self.tty = tty
        self.answer = ""
        self.reasoned = False
        self._last = "\n"  # the last character written to the terminal

    def show(self, reasoning: str, answer: str) -> None:
        out = sys.stdout
        if reasoning and self.tty:
            reasoning = reasoning.translate(_CONTROLS)
            if reasoning:
                self.reasoned = True
                out.write("\x1b[2m" + reasoning + "\x1b[0m")
                self._last = reasoning[-1]
        if answer:
            if not self.answer and self.reasoned and self._last != "\n":
                out.write("\n")  # the answer begins on a line of its own
            self.answer += answer
            shown = answer.translate(_CONTROLS) if self.tty else answer
            out.write(shown)
            self._last = shown[-1:] or self._last
        out.flush()

    def end(self, note: str | None, quiet: bool) -> None:
        """End the reply's line, with why it ended early (``note``) if it did."""
        if note is not None and self.tty:
            sys.stdout.write(f" [{note}]\n")
        elif self._last != "\n" or not self.tty:
            sys.stdout.write("\n")
        sys.stdout.flush()
        if note is not None and not self.tty and (not quiet or "not kept" in note):
            print(f"[{note}]", file=sys.stderr)


def _figures(session, stats) -> dict:  # noqa: ANN001
    """A reply's figures as ``_summary`` shows them, labelled lossy as ``bmoe run``'s are (a chat
    with --n-expert-used read as exact)."""
    from bmoe.engine.lossy import lossy_label

    return {"n_tokens": stats.generated_tokens, **stats.as_dict(), **lossy_label(session.config)}


def _chat_stats(session, totals: dict[str, int]) -> str:  # noqa: ANN001
    stats = session.last_stats
    lines = []
    if stats is not None:
        lines.append("last reply: " + _summary(_figures(session, stats)))
    usage = session.last_usage

    def count(n: int, one: str, many: str) -> str:
        return f"{n} {one if n == 1 else many}"

    if usage is not None:
        lines.append(f"last prompt: {count(usage.prompt_tokens, 'token', 'tokens')}, {usage.prompt_evaluated} "
                     f"evaluated, {usage.prompt_reused} reused from the context")
    lines.append(f"session: {count(totals['replies'], 'reply', 'replies')}, "
                 f"{count(totals['tokens'], 'token', 'tokens')} generated, {totals['reused']} of "
                 f"{count(totals['prompt'], 'prompt token', 'prompt tokens')} reused")
    return "\n".join(lines)


def _continuation(width: int, line: int, wrap: int) -> str:
    """Before the second and later lines of a message: ". " (blank where a long line wraps)."""
    return " " * width if wrap else "." * (width - 1) + " "


class _EmptyInterrupt(KeyboardInterrupt):
    """Ctrl-C at a prompt with nothing typed."""


def _line_reader():  # noqa: ANN202 - async (prompt) -> line; raises EOFError / KeyboardInterrupt
    """prompt_toolkit on a terminal (editing, history, Ctrl-C clears the line, Esc-Enter starts a
    new line); plain lines else, each echoed after its prompt so that the prompt stream reads as a
    transcript (a reply never shares a line with the prompt)."""
    prompt_to = sys.stdout if sys.stdout.isatty() else sys.stderr
    if sys.stdin.isatty():
        from prompt_toolkit import PromptSession
        from prompt_toolkit.history import InMemoryHistory
        from prompt_toolkit.key_binding import KeyBindings
        from prompt_toolkit.output import create_output

        keys = KeyBindings()

        @keys.add("escape", "enter")
        @keys.add("escape", "c-j")
        def _newline(event) -> None:  # noqa: ANN001
            event.current_buffer.insert_text("\n")

        ps = PromptSession(history=InMemoryHistory(), output=create_output(stdout=prompt_to), key_bindings=keys,
                           prompt_continuation=_continuation)

        typed = [False]  # a key changed the line since the prompt was drawn
        armed = [False]  # the last prompt ended by Ctrl-C with nothing typed
        ps.default_buffer.on_text_changed += lambda _: typed.__setitem__(0, True)

        async def edited(prompt: str) -> str:
            # Ctrl-C at the prompt is a key in raw mode; leave the runner's SIGINT handler alone
            typed[0] = False
            try:
                line = await ps.prompt_async(prompt, handle_sigint=False)
            except KeyboardInterrupt:
                if ps.default_buffer.text.strip():
                    armed[0] = False
                    raise
                if armed[0] and not typed[0]:  # Ctrl-C twice in a row at an empty prompt: leave
                    raise EOFError from None
                armed[0] = True
                raise _EmptyInterrupt from None
            armed[0] = False
            return line

        return edited

    lines = _StdinLines()

    async def plain(prompt: str) -> str:
        prompt_to.write(prompt)
        prompt_to.flush()
        line = await lines.readline()
        if not line:
            raise EOFError
        text = line.decode("utf-8", errors="replace").rstrip("\n")
        prompt_to.write(text.translate(_CONTROLS) + "\n")
        prompt_to.flush()
        return text

    return plain


class _StdinLines:
    """Lines of standard input, waited for on the event loop: a pipe that stays open (a script
    feeding the chat) must not hold the process after a stop signal, as a thread blocked in
    ``readline`` did (the interpreter joins it at exit). What the loop cannot watch (a regular
    file, /dev/null) never blocks, and is read in a thread."""

    def __init__(self) -> None:
        self._fd = 0
        self._buf = b""
        self._eof = False

    async def readline(self) -> bytes:
        while b"\n" not in self._buf and not self._eof:
            chunk = await self._read()
            self._eof = not chunk
            self._buf += chunk
        line, nl, self._buf = self._buf.partition(b"\n")
        return line + nl

    async def _read(self) -> bytes:
        loop = asyncio.get_running_loop()
        ready = loop.create_future()
        try:
            loop.add_reader(self._fd, lambda: ready.done() or ready.set_result(None))
        except (OSError, ValueError):  # not pollable: a regular file or /dev/null, which never waits
            return await asyncio.to_thread(os.read, self._fd, 1 << 16)
        try:
            await ready
        finally:
            loop.remove_reader(self._fd)
        return os.read(self._fd, 1 << 16)


def _settle(history: list, kept: list, answer: str, finish: str | None, n: int,
            reasoned: bool) -> tuple[list, str | None]:
    """The conversation after a reply, and the note to show under it. ``kept`` is what the reply
    was asked on: the new user message last, maybe without the oldest turns ``_fit`` dropped. A
    reply stopped or cut before any answer leaves the conversation as it was before the message:
    the message would sit in it unanswered, and the turns dropped to make room for it are not lost
    for a reply that never came."""
    from bmoe.engine.chat import Message

    note = {"cancelled": "stopped", "length": f"cut at {n} tokens (-n)"}.get(finish or "")
    if note is None or answer.strip():
        return [*kept, Message("assistant", answer)], note
    note += " before the answer; the message is not kept (up arrow recalls it)"
    if len(kept) < len(history) + 1:
        note += ", and the turns dropped for it are back"
    if finish == "length" and reasoned:
        note += ": raise -n, or /think off"
    return history, note


def _fit(session, fmt, history, n: int, template_kwargs: dict | None = None) -> tuple[str, list]:  # noqa: ANN001
    """Render the conversation, dropping the oldest turns (a user message with its reply; never the
    system message) to fit: the prompt, and the messages it holds. ``history`` is left as it was
    (``_settle`` decides what stays once the reply is known). A last message that cannot fit even
    alone raises ConfigError."""
    kept = list(history)
    dropped = 0
    while True:
        prompt = fmt.render(kept, template_kwargs)
        if len(session.tokenize(prompt, special=True)) + n <= session.n_ctx:
            if dropped:
                what = "the oldest turn was dropped" if dropped == 1 else f"the oldest {dropped} turns were dropped"
                print(f"bmoe: the conversation outgrew the context ({session.n_ctx} tokens, {n} of them kept for "
                      f"the reply): {what}, the model no longer sees {'it' if dropped == 1 else 'them'}",
                      file=sys.stderr)
            return prompt, kept
        oldest = next((i for i, m in enumerate(kept) if m.role != "system"), None)
        if oldest is None or oldest == len(kept) - 1:
            raise ConfigError(f"the message does not fit the context ({session.n_ctx} tokens, {n} of them kept "
                              f"for the reply); not sent: shorten it, or raise -c or lower -n")
        end = oldest + 1  # the turn runs to the next user message (never past the new one)
        while end < len(kept) - 1 and kept[end].role != "user":
            end += 1
        del kept[oldest:end]
        dropped += 1
