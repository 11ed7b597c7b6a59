"""llama-server's own routes that front-ends call beside the OpenAI ones: ``/tokenize``,
``/detokenize``, ``/props`` and ``/completion``, with llama-server's field names, defaults and reply
shapes, so a page or a script written for llama-server works here.

What ``/props`` says is what applies to bmoe: the default sampling (greedy, where llama-server
samples at 0.8), the context, the slots (sequences decoded together), the model's path and chat
template, the build. Nothing llama-server reports that bmoe does not have (multimodal
projectors, speculative drafts, LoRA) is invented.
"""

from __future__ import annotations

import importlib.metadata
from typing import Any

from pydantic import BaseModel, ConfigDict

from bmoe.engine.sampling import SamplingParams
from bmoe.engine.session import Session


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    content: str
    add_special: bool = False  # llama-server's default: no BOS
    parse_special: bool = True  # control-token text becomes its token
    with_pieces: bool = False


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    tokens: list[int]


def tokenize(session: Session, request: TokenizeRequest) -> dict[str, Any]:
    """``{"tokens": [ids]}``, or with pieces ``[{"id", "piece"}]``: a piece is its text, or the
    list of its bytes when they are not whole UTF-8 (part of a character), as llama-server sends."""
    tokens = session.tokenize(request.content, special=request.parse_special)
    if not request.add_special:
        # What tokenizing adds of itself (BOS where the vocabulary adds one) is what empty text gives.
        added = session.tokenize("", special=False)
        if added and tokens[:len(added)] == added:
            tokens = tokens[len(added):]
    if not request.with_pieces:
        return {"tokens": tokens}
    out = []
    for token in tokens:
        piece = session.token_bytes(token)
        try:
            shown: str | list[int] = piece.decode("utf-8")
        except UnicodeDecodeError:
            shown = list(piece)
        out.append({"id": token, "piece": shown})
    return {"tokens": out}


def detokenize(session: Session, request: DetokenizeRequest) -> dict[str, Any]:
    return {"content": session.detokenize(request.tokens)}


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def props(session: Session, *, model_name: str | None, busy: bool, reuse_prompt: bool = True) -> dict[str, Any]:
    """llama-server's ``GET /props``, as far as it applies."""
    greedy = SamplingParams()
    template = session.chat_template()
    params = {
        "n_predict": -1,  # a chat's default: up to the context (a text completion's is 16, as OpenAI's)
        "temperature": greedy.temperature, "top_k": greedy.top_k, "top_p": greedy.top_p, "min_p": greedy.min_p,
        "repeat_penalty": greedy.repeat_penalty, "repeat_last_n": greedy.penalty_last_n,
        "presence_penalty": greedy.presence_penalty, "frequency_penalty": greedy.frequency_penalty,
        "seed": -1, "stop": [], "stream": False, "cache_prompt": reuse_prompt and session.config.reuse_prompt,
    }
    return {
        "default_generation_settings": {"id": 0, "n_ctx": getattr(session, "n_ctx_seq", session.n_ctx), "is_processing": busy,
                                        "params": params},
        "total_slots": max(1, int(getattr(session.config, "parallel", 1) or 1)),
        "model_path": str(session.layout.shards[0]) if session.layout.shards else "",
        "model_alias": model_name,
        "chat_template": template.decode("utf-8", errors="replace") if template else "",
        "modalities": {"vision": False, "audio": False},
        "build_info": f"bmoe {_version('bmoe')} (llama-cpp-python {_version('llama_cpp_python')})",
        "n_vocab": session.n_vocab,
    }



_STOP_TYPE = {"stop": "eos", "length": "limit", "cancelled": "limit"}  # a stop string is "eos" too


def native_completion(chunk: dict[str, Any]) -> dict[str, Any] | None:
    """A text completion (or one of its stream chunks) in llama-server's /completion shape:
    ``content`` and ``stop``, and once finished the token counts and ``stop_type`` (bmoe's "stop"
    does not tell an end token from a stop string: both are "eos"). The OpenAI usage chunk with
    no choices is dropped: the last chunk carries the counts already."""
    choices = chunk.get("choices") or []
    if not choices:
        return None
    choice, usage = choices[0], chunk.get("usage")
    out: dict[str, Any] = {"content": choice.get("text", ""), "id_slot": 0, "stop": usage is not None,
                           "model": chunk.get("model")}
    if usage is not None:
        out.update(tokens_predicted=usage["completion_tokens"], tokens_evaluated=usage["prompt_tokens"],
                   tokens_cached=usage["prompt_tokens_details"]["cached_tokens"],
                   stop_type=_STOP_TYPE.get(choice.get("finish_reason") or "", "eos"), truncated=False)
    return out
