"""Chat: a conversation rendered to a prompt with the model's own template.

The template comes from the file (``tokenizer.chat_template``). It is rendered first as what it is,
a Jinja template (sandboxed, as llama.cpp's ``--jinja`` and llama-cpp-python do), so that template
switches such as ``enable_thinking`` work; a template that Jinja cannot render falls back to
llama.cpp's built-in renderer, which recognises the common families by their markers (and ignores
switches); a file without a template, or one neither can render, gets a plain "role: content"
transcript and says so.
"""

from __future__ import annotations

import ctypes
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cache, cached_property
from typing import Any

from bmoe.llama.seam import llama_lib
from bmoe.engine.thinking import ChannelSplitter, ThinkSplitter

PLAIN = "plain transcript (the model file has no chat template that can be rendered)"
OWN = "the model's own chat template"
BUILTIN = "the model's own chat template (llama.cpp's built-in renderer)"


@dataclass(frozen=True)
class Message:
    role: str  # "system" | "user" | "assistant" | "tool"
    content: str
    # An assistant's tool calls, in the shape templates read (``bmoe.engine.tools.template_call``);
    # a tool result's call id and function name.
    tool_calls: tuple[Mapping[str, Any], ...] = ()
    tool_call_id: str | None = None
    name: str | None = None

    def for_template(self) -> dict[str, Any]:
        """The message as a Jinja template reads it; the tool fields only where they are set
        (templates test ``message.tool_calls`` and ``is defined``)."""
        out: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.tool_calls:
            out["tool_calls"] = list(self.tool_calls)
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            out["name"] = self.name
        return out


class ChatFormat:
    def __init__(self, template: bytes | None, *, bos: str = "", eos: str = "", channels: bool = False,
                 adds_bos: bool = False) -> None:
        """``channels``: the model answers in gpt-oss's channels (its architecture says so); a
        template that writes ``<|channel|>`` says so too. ``adds_bos``: tokenizing the prompt puts
        BOS first, so a template's own leading ``{{ bos_token }}`` is dropped from the text (as
        llama.cpp's ``common_chat_templates_apply`` does): else the model would see BOS twice."""
        self._template = template
        self._strip_bos = bos if adds_bos else ""
        self.channels = channels or (template is not None and b"<|channel|>" in template)
        self._jinja: Any = None
        self._special = {"bos_token": bos, "eos_token": eos}
        self.description = PLAIN
        if template is None:
            return
        probe = [Message("user", "hi")]
        self._jinja = _compile(template.decode("utf-8", errors="replace"))
        if self._jinja is not None and self._render_jinja(probe, {}) is not None:
            self.description = OWN
        elif self._apply(template, probe) is not None:
            self._jinja = None
            self.description = BUILTIN
        else:
            self._jinja = self._template = None

    @property
    def thinks(self) -> bool:
        """Whether the template knows the ``enable_thinking`` switch (Qwen3 style)."""
        return self._template is not None and b"enable_thinking" in self._template

    def splitter(self, prompt: str, *, calls: bool = False) -> ThinkSplitter | ChannelSplitter:
        """What separates a reply to ``prompt`` into reasoning and answer (``bmoe.engine.thinking``);
        ``calls``: gpt-oss's messages to a function are reported as tool calls."""
        return ChannelSplitter(prompt, calls=calls) if self.channels else ThinkSplitter(prompt)

    @property
    def template(self) -> bytes | None:
        """The template this format renders with (None: the plain transcript)."""
        return self._template

    @cached_property
    def renders_tools(self) -> bool:
        """Whether the template itself shows the model a ``tools`` list (a tool's name given to it
        comes out in the prompt), as llama.cpp probes a template's capabilities."""
        if self._jinja is None:
            return False
        tool = {"type": "function", "function": {"name": "bmoe_probe_tool", "description": "probe",
                                                 "parameters": {"type": "object", "properties": {}}}}
        text = self._render_jinja([Message("user", "hi")], {"tools": [tool]})
        return text is not None and "bmoe_probe_tool" in text

    def render(self, messages: Sequence[Message], template_kwargs: Mapping[str, Any] | None = None,
               tools: Sequence[Mapping[str, Any]] | None = None) -> str:
        """The prompt for the assistant's next turn. ``template_kwargs`` (``enable_thinking``...)
        reach a Jinja template; the built-in renderer and the plain transcript ignore them.
        ``tools`` (OpenAI's entries) reach a Jinja template as its ``tools``."""
        if self._jinja is not None:
            kwargs = dict(template_kwargs or {})
            if tools is not None:
                kwargs["tools"] = list(tools)
            text = self._render_jinja(messages, kwargs, refuse=True)
            if text is not None:
                return self._one_bos(text)
        if self._template is not None:
            text = self._apply(self._template, messages)
            if text is not None:
                return self._one_bos(text)
        lines = [f"{m.role}: {m.content}" for m in messages]
        return "\n".join(lines) + "\nassistant:"

    def _one_bos(self, text: str) -> str:
        bos = self._strip_bos
        return text[len(bos):] if bos and text.startswith(bos) else text

    def _render_jinja(self, messages: Sequence[Message], kwargs: Mapping[str, Any], *,
                      refuse: bool = False) -> str | None:
        """The Jinja rendering, or None where Jinja cannot render the template (the built-in
        renderer is tried next). With ``refuse``, a conversation the template itself refuses
        (``raise_exception``: roles that do not alternate, a system message it does not take) is a
        ParamError with the template's words, as llama.cpp's server and llama-cpp-python give it;
        it was rendered another way, silently."""
        try:
            return self._jinja.render(
                messages=[m.for_template() for m in messages],
                add_generation_prompt=True, **self._special, **kwargs,
            )
        except TemplateRefusal as e:
            if refuse:
                from bmoe.engine.sampling import ParamError

                raise ParamError(f"the model's chat template refuses this conversation: {e}", "messages") from None
            return None
        except Exception:  # noqa: BLE001 - any other template error: fall back to the built-in renderer
            return None

    @staticmethod
    def _apply(template: bytes, messages: Sequence[Message]) -> str | None:
        lib = llama_lib()
        encoded = [(m.role.encode(), m.content.encode()) for m in messages]
        chat = (lib.llama_chat_message * len(encoded))(*(lib.llama_chat_message(r, c) for r, c in encoded))
        size = 2 * sum(len(r) + len(c) for r, c in encoded) + 256
        for _ in range(2):
            buf = ctypes.create_string_buffer(size)
            n = lib.llama_chat_apply_template(template, chat, len(encoded), True, buf, size)
            if n < 0:
                return None
            if n <= size:
                return buf.raw[:n].decode("utf-8", errors="replace")
            size = n + 1
        return None


class TemplateRefusal(Exception):  # noqa: N818 - what the template's raise_exception raises
    """A chat template's own ``raise_exception``: the conversation is not one it takes."""


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    """``tojson`` as transformers (and llama.cpp's minja) give it to chat templates: keys in their
    order, no HTML escaping (Jinja's own sorts keys and writes ``<`` as ``\\u003c``, which is not
    the text the model was trained on), and GLM's ``tojson(ensure_ascii=False)`` accepted."""
    import json

    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


@cache
def _compile(source: str) -> Any:
    """The template compiled in a sandbox (no attribute access to Python internals), with the
    helpers chat templates expect; None when it does not even parse."""
    import datetime

    from jinja2 import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise TemplateRefusal(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.globals["raise_exception"] = raise_exception
    env.filters["tojson"] = _tojson
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    try:
        return env.from_string(source)
    except TemplateError:
        return None
