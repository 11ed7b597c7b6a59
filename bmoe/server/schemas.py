"""Request bodies of the OpenAI routes, validated by pydantic (strict types: ``"5"`` is not a number).

A field neither declared here nor in ``bmoe.server.fields``' lists is refused (400), as the OpenAI
API refuses it; those lists say which fields are accepted and ignored. A known field of the wrong
type is a 400, and null is the field's default wherever OpenAI allows null. The
fields bmoe cannot honour (``functions``, ``echo``, ``suffix``, ``best_of`` > 1...) are declared here so
that the engine refuses them by name instead of their being dropped unseen. ``tools`` are checked by
the engine too (``bmoe.engine.tools``: a bad one is a 400 whose ``param`` is ``tools``). Semantic checks
(max_tokens > 0, messages well formed, a prompt that fits the context, n == 1) are the engine's
(``bmoe.engine.completions.prepare_*``), so the Python API and the server refuse the same things.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repeat_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool | None = None
    stream_options: dict[str, Any] | None = None
    n: int | None = None
    grammar: str | None = None
    response_format: dict[str, Any] | None = None
    logit_bias: dict[str, Any] | None = None
    # Samplers bmoe has none for (llama-cpp-python's server and llama-server send them): declared so
    # that the engine accepts them at the values that leave them off and refuses any other by name.
    typical_p: float | None = None
    tfs_z: float | None = None
    mirostat_mode: int | None = None
    mirostat: int | None = None
    mirostat_tau: float | None = None
    mirostat_eta: float | None = None
    ignore_eos: bool | None = None
    repeat_last_n: int | None = None
    n_probs: int | None = None
    # llama-server's names: n_predict is max_tokens (and wins over it, as there; -1: up to the
    # context), json_schema is response_format's json_schema, cache_prompt false evaluates the
    # prompt from its first token (the server's to apply: it is no argument of the engine's).
    n_predict: int | None = None
    json_schema: dict[str, Any] | None = None
    cache_prompt: bool | None = None

    def engine_kwargs(self) -> dict[str, Any]:
        """Arguments for ``bmoe.engine.completions.prepare_*`` (None left out: the engine's
        default). ``model`` is the server's to fill: a reply names the model it came from."""
        kw = {k: v for k, v in self.model_dump().items()
              if k not in ("model", "n_predict", "json_schema", "cache_prompt") and v is not None}
        if self.n_predict is not None:
            kw.pop("max_tokens", None)
            kw.pop("max_completion_tokens", None)
            if self.n_predict != -1:  # -1: the server fills in the rest of the context
                kw["max_tokens"] = self.n_predict
        if self.json_schema is not None:
            kw["response_format"] = {"type": "json_schema", "json_schema": {"schema": self.json_schema}}
        return kw


class ChatRequest(_Sampling):
    messages: list[Any]
    logprobs: bool | None = None
    top_logprobs: int | None = None
    max_completion_tokens: int | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    functions: list[Any] | None = None
    function_call: str | dict[str, Any] | None = None

    def engine_kwargs(self) -> dict[str, Any]:
        kw = super().engine_kwargs()
        kw.pop("messages", None)
        limit = kw.pop("max_completion_tokens", None)
        if limit is not None and "max_tokens" not in kw:
            kw["max_tokens"] = limit
        return kw


class CompletionRequest(_Sampling):
    prompt: str | list[int] | list[str]
    logprobs: int | None = None
    echo: bool | None = None
    suffix: str | None = None
    best_of: int | None = None

    def engine_kwargs(self) -> dict[str, Any]:
        kw = super().engine_kwargs()
        kw.pop("prompt", None)
        return kw
