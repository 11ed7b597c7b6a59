"""bmoe: run Mixture-of-Experts GGUF models bigger than RAM by reading routed experts from disk.

The public face is importable from here (``from bmoe import Session, SyncSession, RunConfig,
SamplingParams``, and every error class of ``bmoe.errors``: ``BmoeError``, ``ConfigError``,
``ComputeBusyError``, ...); each name loads its module on first use, so ``import bmoe`` stays
cheap (no numpy, no llama.cpp) for a CLI that only prints its help.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from bmoe._version import __version__

_PUBLIC = {
    "Session": "bmoe.engine.session",
    "SyncSession": "bmoe.engine.sync",
    "RunConfig": "bmoe.engine.config",
    "SamplingParams": "bmoe.engine.sampling",
    "Generation": "bmoe.engine.session",
    "Piece": "bmoe.engine.session",
    "Usage": "bmoe.engine.session",
    # Every error bmoe raises on purpose (the tree is in bmoe.errors' docstring).
    "BmoeError": "bmoe.errors",
    "ModelFileError": "bmoe.errors",
    "NotGGUFError": "bmoe.errors",
    "GGUFVersionError": "bmoe.errors",
    "TruncatedFileError": "bmoe.errors",
    "MissingKeyError": "bmoe.errors",
    "ExpertLayoutError": "bmoe.errors",
    "MissingShardError": "bmoe.errors",
    "UnsupportedArchitectureError": "bmoe.errors",
    "SeamError": "bmoe.errors",
    "SeamMismatchError": "bmoe.errors",
    "LlamaCallError": "bmoe.errors",
    "TraceFormatError": "bmoe.errors",
    "ReadError": "bmoe.errors",
    "ReadCancelled": "bmoe.errors",
    "BudgetError": "bmoe.errors",
    "RegionError": "bmoe.errors",
    "ConfigError": "bmoe.errors",
    "OutputPathError": "bmoe.errors",
    "SessionClosedError": "bmoe.errors",
    "ComputeBusyError": "bmoe.errors",
    "DecodeAbortedError": "bmoe.errors",
    "GenerationCancelled": "bmoe.errors",
    # A request value out of range (its ``param`` names it, as OpenAI's errors do), and a prompt
    # that does not fit the context: both ConfigErrors, raised by SamplingParams and create_*.
    "ParamError": "bmoe.engine.sampling",
    "ContextOverflow": "bmoe.engine.completions",
}

__all__ = ["__version__", *_PUBLIC]

if TYPE_CHECKING:  # what type checkers see of the lazy public face below
    from bmoe.engine.completions import ContextOverflow  # noqa: F401
    from bmoe.engine.config import RunConfig  # noqa: F401
    from bmoe.engine.sampling import ParamError, SamplingParams  # noqa: F401
    from bmoe.engine.session import Generation, Piece, Session, Usage  # noqa: F401
    from bmoe.engine.sync import SyncSession  # noqa: F401
    from bmoe.errors import (  # noqa: F401
        BmoeError,
        BudgetError,
        ComputeBusyError,
        ConfigError,
        DecodeAbortedError,
        ExpertLayoutError,
        GenerationCancelled,
        GGUFVersionError,
        LlamaCallError,
        MissingKeyError,
        MissingShardError,
        ModelFileError,
        NotGGUFError,
        OutputPathError,
        ReadCancelled,
        ReadError,
        RegionError,
        SeamError,
        SeamMismatchError,
        SessionClosedError,
        TraceFormatError,
        TruncatedFileError,
        UnsupportedArchitectureError,
    )


def __getattr__(name: str) -> Any:
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module 'bmoe' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
