"""The llama.cpp seam: model, context, tokens and logits through llama-cpp-python's low-level API.

Everything bmoe asks of llama.cpp goes through this module, so a pin bump has one place to review
(third_party/llama.cpp/SEAM.md lists the contract). Failure codes become LlamaCallError here.
The model is loaded with ``use_extra_bufts=False``: expert weights must keep the gguf layout,
because their bytes are read straight from the file into rebound memory. ``LlamaModel`` takes a
model that ``bmoe.llama.loader.open_model`` opened (``init_from_user`` with only the dense bytes
read, or mmap) and owns it from then on.
"""

from __future__ import annotations

import ctypes
import os
import sys
import tempfile
import threading
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cache
from typing import Any, Protocol

import numpy as np

from bmoe.llama import node_filter as node_filter_module
from bmoe.llama.callback import EvalCallback
from bmoe.llama.node_filter import NodeFilter, node_filter
from bmoe.errors import ConfigError, DecodeAbortedError, LlamaCallError


class OwnedModel(Protocol):
    """A loaded ``llama_model`` handed over to a ``LlamaModel`` (``loader.OpenedModel``)."""

    model: Any  # llama_cpp.llama_model_p
    # The optional tensors the open filled as no-ops, by address (empty unless the user open).
    noop_ones: tuple[int, ...]
    noop_zeros: tuple[int, ...]

    def free(self) -> None: ...

LOAD_MODE_MMAP = 1
GGML_LOG_LEVEL_ERROR = 4


@cache
def llama_lib():  # noqa: ANN201 - the llama_cpp module, imported on first use, never at bmoe import
    import llama_cpp

    llama_cpp.llama_backend_init()
    llama_cpp.llama_log_set(_quiet_log, None)
    # ggml's own logger (the gguf reader's messages) is separate from llama's: quiet it too.
    from bmoe.io.ggml import libggml_base

    base = libggml_base()
    base.ggml_log_set.restype = None
    base.ggml_log_set.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    base.ggml_log_set(ctypes.cast(_quiet_log, ctypes.c_void_p), None)
    return llama_cpp


# llama.cpp's error lines are kept, not printed: a failure becomes one bmoe line that quotes the
# last of them (``last_llama_error``). ``bmoe -v`` (or BMOE_LLAMA_LOG=1) prints the whole log.
_LLAMA_ERRORS: deque[str] = deque(maxlen=8)
_LOG = {"all": False}


def set_llama_log(verbose: bool) -> None:
    """Let llama.cpp's own log through to stderr (``bmoe -v``), or keep it quiet (the default:
    bmoe reports every failure itself as one line, and a cancelled decode's "graph_compute failed"
    lines are expected, not news)."""
    _LOG["all"] = verbose


def _filtered_log(level: int, text: bytes | None, _user: int | None) -> None:
    if not text:
        return
    if level >= GGML_LOG_LEVEL_ERROR:
        line = text.decode(errors="replace").strip()
        if line:
            _LLAMA_ERRORS.append(line)
    if _LOG["all"] or os.environ.get("BMOE_LLAMA_LOG"):
        os.write(2, text)


def forget_llama_errors() -> None:
    """Before a call whose failure will quote ``last_llama_error``: drop older lines."""
    _LLAMA_ERRORS.clear()


def last_llama_error() -> str:
    """The most telling error line llama.cpp logged last (the first of its final burst), or ''."""
    return _LLAMA_ERRORS[0] if len(_LLAMA_ERRORS) == 1 else next(
        (line for line in _LLAMA_ERRORS if "error loading model:" in line or "gguf_init" in line),
        _LLAMA_ERRORS[-1] if _LLAMA_ERRORS else "",
    )


_STDERR_HELD = threading.Lock()


@contextmanager
def stderr_kept(failed: Callable[[], bool]) -> Iterator[list[str]]:
    """Around a native call that prints to stderr itself (``fprintf``, not the log callback): what
    it printed is held back, and given back to stderr unless ``failed()`` says the call failed, when
    the lines go to the caller's one-line error instead (llama.cpp's GBNF parser reports a bad
    grammar as five lines with the grammar quoted). ``-v`` lets everything through as it comes."""
    lines: list[str] = []
    if _LOG["all"]:
        yield lines
        return
    # One redirection at a time in the process: two sessions' samplers made at once on two threads
    # would each restore the other's temporary file as stderr, and every later line would be lost.
    with _STDERR_HELD:
        sys.stderr.flush()
        saved = os.dup(2)
        with tempfile.TemporaryFile() as held:
            os.dup2(held.fileno(), 2)
            try:
                yield lines
            finally:
                os.dup2(saved, 2)
                os.close(saved)
                held.seek(0)
                text = held.read()
                if text and not failed():
                    os.write(2, text)
                lines.extend(line.strip() for line in text.decode(errors="replace").splitlines() if line.strip())


_quiet_log = ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_char_p, ctypes.c_void_p)(_filtered_log)
# The default load progress callback prints dots to stderr; bmoe reports progress its own way.
_no_progress = ctypes.CFUNCTYPE(ctypes.c_bool, ctypes.c_float, ctypes.c_void_p)(lambda _p, _u: True)


def model_params():  # noqa: ANN201 - a llama_cpp.llama_model_params
    """The params of bmoe's plain load: CPU only, no repacking (weights keep the gguf layout),
    mmap load mode, no progress dots."""
    lib = llama_lib()
    mparams = lib.llama_model_default_params()
    mparams.n_gpu_layers = 0
    mparams.use_extra_bufts = False
    mparams.load_mode = LOAD_MODE_MMAP
    mparams.progress_callback = _no_progress
    return mparams


@dataclass(frozen=True)
class Step:
    """One ``llama_decode`` over any number of sequences: token ``i`` goes to sequence ``seq[i]`` at
    position ``pos[i]``, and its logits are kept where ``out[i]`` (``LlamaModel.logits_at`` reads
    them by the index among the kept ones). A prompt chunk, a token of every decoding sequence, or
    a draft to verify are all steps."""

    tokens: tuple[int, ...]
    pos: tuple[int, ...]
    seq: tuple[int, ...]
    out: tuple[bool, ...]

    def __post_init__(self) -> None:
        n = len(self.tokens)
        if n == 0 or not len(self.pos) == len(self.seq) == len(self.out) == n:
            raise ValueError(f"a step needs as many positions, sequences and output flags as tokens ({n})")

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def n_out(self) -> int:
        return sum(self.out)


class LlamaModel:
    """A loaded model and one context on it, with bmoe's callbacks installed."""

    def __init__(
        self, opened: OwnedModel, *, n_ctx: int, n_threads: int, callback: EvalCallback, install: bool,
        n_seq_max: int = 1,
    ) -> None:
        """``install=False`` leaves llama.cpp without bmoe's eval callback (plain resident runs):
        it is a Python call per graph node, which a baseline must not pay.

        ``opened`` is owned from then on: ``close`` frees it, and so does a failure to create the
        context.
        """
        lib = llama_lib()
        self._lib = lib
        self.callback = callback
        self._opened: OwnedModel | None = opened
        self.model = opened.model
        cparams = lib.llama_context_default_params()
        cparams.n_ctx = n_ctx
        cparams.n_batch = cparams.n_ubatch = min(512, n_ctx)
        cparams.n_threads = cparams.n_threads_batch = n_threads
        # Sequences this context decodes together; each gets its own n_ctx / n_seq_max cells (the
        # KV is not unified: a sequence's attention never reads another's cells).
        cparams.n_seq_max = n_seq_max
        self._node_filter: NodeFilter | None = None
        # Who answers llama.cpp's question about each graph node (stats report it): "c" (only MoE
        # nodes reach Python), "python: <why not c>", or None (no callback installed).
        self.filter_kind: str | None = None
        if install:
            self._node_filter = node_filter(callback.c_eval)
            if self._node_filter is not None:
                cparams.cb_eval = self._node_filter.fn
                cparams.cb_eval_user_data = self._node_filter.data
                callback.node_filter = self._node_filter
                self.filter_kind = "c"
                if opened.noop_ones or opened.noop_zeros:
                    self._node_filter.skip_noops(opened.noop_ones, opened.noop_zeros)
            else:
                cparams.cb_eval = callback.c_eval
                self.filter_kind = f"python: {node_filter_module.unavailable}"
        cparams.no_perf = True
        self.ctx = lib.llama_init_from_model(self.model, cparams)
        if not self.ctx:
            self._free_model()
            raise LlamaCallError(f"llama.cpp could not create a context (n_ctx={n_ctx}) for the opened model")
        self.vocab = lib.llama_model_get_vocab(self.model)
        self.n_vocab = lib.llama_vocab_n_tokens(self.vocab)
        self.n_ctx = lib.llama_n_ctx(self.ctx)
        self.n_batch = cparams.n_batch
        self.n_seq_max = lib.llama_n_seq_max(self.ctx)
        self.n_ctx_seq = lib.llama_n_ctx_seq(self.ctx)  # cells one sequence may hold
        self._piece_buf = ctypes.create_string_buffer(256)
        self._batch = None  # a llama_batch of n_batch tokens, made on the first Step

    def tokenize(self, text: str, *, add_special: bool = True, parse_special: bool = False) -> list[int]:
        """``parse_special`` lets control-token text (a chat template's markers) become tokens."""
        data = text.encode("utf-8")
        cap = len(data) + 8
        buf = (ctypes.c_int32 * cap)()
        n = self._lib.llama_tokenize(self.vocab, data, len(data), buf, cap, add_special, parse_special)
        if n < 0:
            raise LlamaCallError(f"tokenization needs {-n} tokens, more than expected")
        return list(buf[:n])

    def piece(self, token: int) -> bytes:
        n = self._lib.llama_token_to_piece(self.vocab, token, self._piece_buf, 256, 0, False)
        if n < 0:
            raise LlamaCallError(f"token {token} has a piece longer than 256 bytes")
        return self._piece_buf.raw[:n]

    def special_text(self) -> tuple[str, str]:
        """The text of the BOS and EOS tokens (what a chat template calls ``bos_token`` /
        ``eos_token``), empty where the vocabulary has none."""
        out = []
        for tok in (self._lib.llama_vocab_bos(self.vocab), self._lib.llama_vocab_eos(self.vocab)):
            text = self._lib.llama_vocab_get_text(self.vocab, tok) if 0 <= tok < self.n_vocab else None
            out.append(text.decode("utf-8", errors="replace") if text else "")
        return out[0], out[1]

    def adds_bos(self) -> bool:
        """Whether tokenizing with ``add_special`` puts BOS first (the vocabulary's own setting)."""
        return bool(self._lib.llama_vocab_get_add_bos(self.vocab))

    def chat_template(self) -> bytes | None:
        return self._lib.llama_model_chat_template(self.model, None) or None

    def is_end(self, token: int) -> bool:
        return bool(self._lib.llama_vocab_is_eog(self.vocab, token))

    def clear_memory(self) -> None:
        self._lib.llama_memory_clear(self._lib.llama_get_memory(self.ctx), True)

    def keep_prefix(self, n: int) -> bool:
        """Drop every cached position from ``n`` on, keeping the first ``n`` for the next prompt to
        build on. False when the memory cannot keep a partial sequence (then clear it instead):
        sliding-window caches drop old positions, so only full-attention models reuse a prefix."""
        if n <= 0 or self._lib.llama_model_n_swa(self.model) > 0 or self._lib.llama_model_is_recurrent(self.model):
            return False
        return bool(self._lib.llama_memory_seq_rm(self._lib.llama_get_memory(self.ctx), 0, n, -1))

    def seq_keep_prefix(self, seq: int, n: int) -> bool:
        """``keep_prefix`` for one sequence of many: its cells from ``n`` on are dropped, the other
        sequences' untouched. False where the memory cannot keep a partial sequence (then
        ``seq_clear`` it)."""
        if n <= 0 or self._lib.llama_model_n_swa(self.model) > 0 or self._lib.llama_model_is_recurrent(self.model):
            return False
        return bool(self._lib.llama_memory_seq_rm(self._lib.llama_get_memory(self.ctx), seq, n, -1))

    def seq_drop_tail(self, seq: int, n: int) -> bool:
        """Drop a sequence's cells from position ``n`` on (a rejected draft's): False where the
        memory cannot (a recurrent state has no positions to drop)."""
        if self._lib.llama_model_is_recurrent(self.model) or self._lib.llama_model_is_hybrid(self.model):
            return False
        return bool(self._lib.llama_memory_seq_rm(self._lib.llama_get_memory(self.ctx), seq, n, -1))

    def seq_clear(self, seq: int) -> None:
        """Every cell of one sequence dropped, the others' kept."""
        self._lib.llama_memory_seq_rm(self._lib.llama_get_memory(self.ctx), seq, -1, -1)

    def can_drop_tail(self) -> bool:
        """Whether a sequence's last positions can be taken back (what a rejected draft needs):
        not in a recurrent or hybrid model, whose state has no positions."""
        return not (self._lib.llama_model_is_recurrent(self.model) or self._lib.llama_model_is_hybrid(self.model))

    def decode(self, tokens: list[int] | Step) -> None:
        """Run one batch (blocking: call it on the compute thread). A list is one sequence's tokens
        after what the context holds, logits only for the last; a ``Step`` says each token's
        sequence and position and which logits to keep."""
        if isinstance(tokens, Step):
            batch = self._fill(tokens)
        else:
            arr = (ctypes.c_int32 * len(tokens))(*tokens)
            batch = self._lib.llama_batch_get_one(arr, len(tokens))
        self.callback.before_decode(len(tokens))
        try:
            rc = self._lib.llama_decode(self.ctx, batch)
        finally:
            self.callback.after_decode()
        if self.callback.error is not None:
            raise self.callback.error
        if rc == 2:
            raise DecodeAbortedError("decode aborted")
        if rc != 0:
            raise LlamaCallError(f"llama_decode returned {rc}")

    def _fill(self, step: Step):  # noqa: ANN202 - a llama_cpp.llama_batch
        if len(step) > self.n_batch:
            raise ConfigError(f"a step of {len(step)} tokens exceeds the context's batch ({self.n_batch})")
        if self._batch is None:
            self._batch = self._lib.llama_batch_init(self.n_batch, 0, 1)
        b = self._batch
        for i, (t, p, s, o) in enumerate(zip(step.tokens, step.pos, step.seq, step.out)):
            b.token[i] = t
            b.pos[i] = p
            b.n_seq_id[i] = 1
            b.seq_id[i][0] = s
            b.logits[i] = o
        b.n_tokens = len(step)
        return b

    def logits(self) -> np.ndarray:
        return self.logits_at(-1)

    def logits_at(self, i: int) -> np.ndarray:
        """Scores after the token at index ``i`` of the last decode's batch (one whose logits were
        kept), or -1 for the last kept: a view, valid until the next decode."""
        ptr = self._lib.llama_get_logits_ith(self.ctx, i)
        if not ptr:
            raise LlamaCallError("llama.cpp returned no logits")
        return np.ctypeslib.as_array(ptr, shape=(self.n_vocab,))

    def close(self) -> None:
        if self._batch is not None:
            self._lib.llama_batch_free(self._batch)
            self._batch = None
        if self.ctx:
            self._lib.llama_free(self.ctx)
            self.ctx = None
        self._free_model()

    def _free_model(self) -> None:
        if self._opened is not None:
            self._opened.free()
            self._opened = None
        elif self.model:
            self._lib.llama_model_free(self.model)
        self.model = None


def check_token_ids(tokens: object, n_vocab: int, what: str) -> list[int]:
    """Token ids as llama.cpp may take them (a list, a tuple or a 1-D numpy array of integers):
    one outside the vocabulary aborts the process there."""
    if isinstance(tokens, np.ndarray) and tokens.ndim == 1:
        tokens = tokens.tolist()  # numpy integers become ints; floats stay floats, refused below
    if isinstance(tokens, (str, bytes, bytearray, memoryview)) or not isinstance(tokens, Sequence):
        raise ConfigError(f"{what} must be a list of token ids, got {type(tokens).__name__}")
    ids = list(tokens)
    for t in ids:
        if isinstance(t, bool) or not isinstance(t, (int, np.integer)):
            raise ConfigError(f"{what}: a token id is an integer, got {t!r}")
        if not 0 <= t < n_vocab:
            raise ConfigError(f"{what}: token id {t} is outside the vocabulary (0..{n_vocab - 1})")
    return [int(t) for t in ids]
