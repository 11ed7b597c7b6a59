"""Sampling: how the next token is chosen from the logits, as one validated value and the llama.cpp
sampler chain that carries it out.

``SamplingParams()`` is greedy, and greedy stays bmoe's own ``argmax`` over the logits: the path
every byte-identity gate was written against. Anything else (temperature, top-k / top-p / min-p,
penalties, a grammar) runs through llama.cpp's own samplers (the public ``llama_sampler_*`` API of
the pin), so a seeded run draws exactly what llama.cpp would draw from the same logits; bmoe
re-implements none of them. A grammar (GBNF text, or a JSON schema converted to GBNF by
llama-cpp-python's converter) constrains every token, so the output parses whatever the weights.

Log-probabilities, when asked, are the log-softmax of the raw logits (the model's distribution, as
llama-cpp-python and OpenAI report them), not of the filtered distribution the draw came from.
"""

from __future__ import annotations

import ctypes
import itertools
import json as _json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import numpy as np

from bmoe.llama.seam import llama_lib, stderr_kept
from bmoe.errors import ConfigError

# JSON mode: any JSON value whose top level is an object (llama.cpp's json.gbnf, object root).
_JSON_OBJECT_ROOT = "root ::= object"
MAX_LOGPROBS = 20
MAX_LOGIT_BIAS = 300  # entries, as OpenAI allows
# llama-cpp-python 0.3.36's schema converter lets a JSON string hold raw control characters (and a
# pattern's "." a raw quote or backslash), which no JSON parser accepts: its rules, as it writes
# them, and the ones JSON allows (json.gbnf's string characters). Replaced only when found
# verbatim, so a corrected converter is left as it is.
_SCHEMA_RULE_FIXES = (
    (r'char ::= [^"\\] |', r'char ::= [^"\\\x7F\x00-\x1F] |'),
    (r"dot ::= [^\x0A\x0D]", r'dot ::= [^"\\\x7F\x00-\x1F]'),
)


# What llama.cpp's grammar parser survives: it descends recursively into every bracket, on the
# calling thread's stack, and a request nesting 20000 deep killed the process (SIGSEGV; 10000 passed
# on an 8 MiB stack). A schema's length and count bounds (``maxLength: N``) become N nested optional
# groups in llama-cpp-python's converter, so they are held to the same depth; and the text itself is
# bounded, since a bound of 10^8 made the converter build gigabytes while holding the GIL.
MAX_GRAMMAR_DEPTH = 4096
MAX_GRAMMAR_CHARS = 1 << 20
_SCHEMA_COUNTS = ("minLength", "maxLength", "minItems", "maxItems", "minProperties", "maxProperties")
_GBNF_OPAQUE = re.compile(r'"(?:\\.|[^"\\])*"|\[(?:\\.|[^\]\\])*\]|#[^\n]*')  # literals, classes, comments
_PATTERN_COUNT = re.compile(r"\{\s*(\d+)\s*(?:,\s*(\d*)\s*)?\}")


class ParamError(ConfigError):
    """A request value out of range; ``param`` names it as OpenAI's error bodies do."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.param, self.code = param, code


@dataclass(frozen=True)
class SamplingParams:
    """How tokens are drawn. The default is greedy (``temperature=0``).

    ``top_k=0``, ``top_p=1``, ``min_p=0``, ``repeat_penalty=1`` and zero presence / frequency
    penalties are off. ``seed=None`` draws a fresh seed per generation; a fixed seed makes a run
    reproducible (the same logits give the same draws). ``grammar`` (GBNF text), ``json_schema``
    (a JSON schema, as a dict or JSON text) and ``json_object`` (any JSON object) constrain the
    output; at most one of them. ``logprobs``: report the top-n alternatives of each token (0: the
    chosen token's own log-probability only; None: nothing). ``logit_bias``: (token id, bias) pairs
    added to the logits before any other sampler (llama.cpp's logit-bias sampler), as OpenAI's
    ``logit_bias``; the ids are checked against the vocabulary when the generation starts.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repeat_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    penalty_last_n: int = 64
    seed: int | None = None
    grammar: str | None = None
    json_schema: dict[str, Any] | str | None = None
    json_object: bool = False
    logprobs: int | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()

    def __post_init__(self) -> None:
        def finite(name: str, lo: float, hi: float) -> None:
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not lo <= v <= hi:  # NaN fails too
                raise ParamError(f"{name} must be a number in [{lo}, {hi}], got {_clip(v)}", name)

        finite("temperature", 0.0, 100.0)
        finite("top_p", 0.0, 1.0)
        finite("min_p", 0.0, 1.0)
        finite("repeat_penalty", 0.01, 100.0)
        finite("presence_penalty", -2.0, 2.0)
        finite("frequency_penalty", -2.0, 2.0)
        for name, hi in (("top_k", 1 << 31), ("penalty_last_n", 1 << 20)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= hi:
                raise ParamError(f"{name} must be an integer in [0, {hi}], got {_clip(v)}", name)
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)
                                      or not 0 <= self.seed < 0xFFFFFFFF):
            raise ParamError(f"seed must be an integer in [0, 2**32 - 2], got {_clip(self.seed)}", "seed")
        if self.logprobs is not None and (isinstance(self.logprobs, bool) or not isinstance(self.logprobs, int)
                                          or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise ParamError(f"logprobs must be an integer in [0, {MAX_LOGPROBS}], got {_clip(self.logprobs)}",
                             "logprobs")
        self._check_logit_bias()
        if not isinstance(self.json_object, bool):
            raise ParamError(f"json_object must be True or False, got {_clip(self.json_object)}", "json_object")
        if sum(x is not None and x is not False for x in (self.grammar, self.json_schema, self.json_object)) > 1:
            raise ParamError("give at most one of grammar, json_schema and json_object", "grammar")
        if self.grammar is not None and (not isinstance(self.grammar, str) or not self.grammar.strip()):
            raise ParamError("grammar must be non-empty GBNF text", "grammar")
        if self.grammar is not None:
            _check_gbnf(self.grammar, "grammar")
        if self.json_schema is not None:
            _check_gbnf(self.gbnf() or "", "json_schema")  # a schema refused fails here, where it was written

    @property
    def grammar_param(self) -> str:
        """The field a grammar came from, for an error that names it."""
        return "json_schema" if self.json_schema is not None else "json_object" if self.json_object else "grammar"

    def _check_logit_bias(self) -> None:
        bias = self.logit_bias
        if not isinstance(bias, tuple) or len(bias) > MAX_LOGIT_BIAS:
            many = f", got {len(bias)}" if isinstance(bias, tuple) else ""
            raise ParamError(f"logit_bias takes at most {MAX_LOGIT_BIAS} (token id, bias) entries{many}", "logit_bias")
        for pair in bias:
            ok = isinstance(pair, tuple) and len(pair) == 2
            token, value = pair if ok else (None, None)
            # Compared, never converted: an int too large for a float (JSON allows 1e400 written
            # out) raised OverflowError in math.isfinite; NaN fails the comparison as well.
            if (not ok or isinstance(token, bool) or not isinstance(token, int) or token < 0
                    or isinstance(value, bool) or not isinstance(value, (int, float))
                    or not -100 <= value <= 100):
                shown = _clip(pair)
                raise ParamError(f"logit_bias entries are a token id >= 0 and a bias in [-100, 100], got {shown}",
                                 "logit_bias")

    def check_vocab(self, n_vocab: int) -> None:
        """Token ids in ``logit_bias`` must be in the model's vocabulary (llama.cpp indexes by them):
        known only once a model is open, so not part of ``__post_init__``."""
        bad = [t for t, _ in self.logit_bias if t >= n_vocab]
        if bad:
            raise ParamError(f"logit_bias: token id {bad[0]} is outside the vocabulary (0..{n_vocab - 1})",
                             "logit_bias")

    @property
    def greedy(self) -> bool:
        """Plain argmax: no temperature, no penalty, no bias, no constraint (bmoe's own path)."""
        return (self.temperature == 0 and self.repeat_penalty == 1 and not self.presence_penalty
                and not self.frequency_penalty and not self.logit_bias and self.gbnf() is None)

    def gbnf(self) -> str | None:
        """The grammar that constrains the output, in GBNF, or None (converted once)."""
        return self._gbnf

    @cached_property
    def _gbnf(self) -> str | None:
        if self.grammar is not None:
            return self.grammar
        if self.json_object:
            from llama_cpp.llama_grammar import JSON_GBNF

            return _JSON_OBJECT_ROOT + "\n" + "\n".join(
                line for line in JSON_GBNF.strip().splitlines() if not line.startswith("root ")
            )
        if self.json_schema is not None:
            from llama_cpp.llama_grammar import json_schema_to_gbnf

            schema = self.json_schema
            try:
                text = schema if isinstance(schema, str) else _json.dumps(schema)
                _check_schema_counts(_json.loads(text))
                gbnf = json_schema_to_gbnf(text)
            except ParamError:
                raise
            except Exception as exc:  # noqa: BLE001 - the converter raises bare exceptions of many kinds
                raise ParamError(f"json_schema cannot be turned into a grammar: {exc}", "json_schema") from None
            for wrong, right in _SCHEMA_RULE_FIXES:
                gbnf = "\n".join(right + line[len(wrong):] if line.startswith(wrong) else line
                                 for line in gbnf.splitlines())
            return gbnf
        return None


GREEDY = SamplingParams()


def _check_gbnf(text: str, param: str) -> None:
    """Refuse grammar text llama.cpp's parser would die on or take long over (``MAX_GRAMMAR_*``)."""
    if len(text) > MAX_GRAMMAR_CHARS:
        raise ParamError(f"{param}: the grammar is {len(text)} characters; bmoe takes at most {MAX_GRAMMAR_CHARS}",
                         param)
    brackets = re.sub(r"[^()]", "", _GBNF_OPAQUE.sub("", text))
    depth = max(itertools.accumulate(1 if c == "(" else -1 for c in brackets), default=0)
    if depth > MAX_GRAMMAR_DEPTH:
        raise ParamError(f"{param}: the grammar nests {depth} groups deep; llama.cpp's parser takes at most "
                         f"{MAX_GRAMMAR_DEPTH} (deeper overflows its stack)", param)


def _schema_nodes(node: Any) -> Iterator[dict[str, Any]]:
    stack = [node]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            yield node
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)


def _check_schema_counts(schema: Any) -> None:
    """Length and count bounds (and a pattern's ``{m,n}``) above ``MAX_GRAMMAR_DEPTH`` are refused
    before conversion: the converter nests one group per unit, and builds the text first."""
    for node in _schema_nodes(schema):
        counts = [(k, node[k]) for k in _SCHEMA_COUNTS if isinstance(node.get(k), int | float)]
        pattern = node.get("pattern")
        if isinstance(pattern, str):
            counts += [("pattern", int(n)) for m in _PATTERN_COUNT.finditer(pattern) for n in m.groups() if n]
        for key, value in counts:
            if not isinstance(value, bool) and value > MAX_GRAMMAR_DEPTH:
                raise ParamError(f"json_schema: {key} {_clip(value)} is above {MAX_GRAMMAR_DEPTH}, the most a grammar "
                                 "can spell out (each unit is a nested group in llama.cpp's parser)", "json_schema")


def compile_grammar(vocab: Any, params: SamplingParams) -> Any:
    """llama.cpp's grammar sampler for ``params`` (the caller frees it), or a ``ParamError`` naming
    the field the grammar came from, with llama.cpp's own reason."""
    lib = llama_lib()
    gbnf = params.gbnf()
    if gbnf is None:
        return None
    grammar = None
    with stderr_kept(lambda: not grammar) as said:
        grammar = lib.llama_sampler_init_grammar(vocab, gbnf.encode(), b"root")
    if not grammar:
        why = said[0].removeprefix("parse: ") if said else ""
        raise ParamError("llama.cpp could not parse the grammar (GBNF)" + (f": {why}" if why else ""),
                         params.grammar_param)
    return grammar


def check_grammar(vocab: Any, params: SamplingParams) -> None:
    """Compile and free: a grammar llama.cpp cannot parse is refused when a request is prepared,
    naming its field, rather than at its turn."""
    grammar = compile_grammar(vocab, params)
    if grammar is not None:
        llama_lib().llama_sampler_free(grammar)


@dataclass(frozen=True)
class TokenLogprob:
    """A chosen token's log-probability and the top alternatives (token id, log-probability)."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...]


def _clip(value: Any, width: int = 40) -> str:
    """A refused value as an error shows it: its repr, cut to ``width`` characters (a JSON integer
    can have thousands of digits)."""
    try:
        text = repr(value)
    except ValueError:  # an int past Python's digit limit for str()
        return "a number too large to show"
    return text if len(text) <= width else f"{text[: width - 3]}..."


def logprobs_of(logits: np.ndarray, token: int, n: int) -> TokenLogprob:
    """Log-softmax of the raw logits: the chosen token's value and the ``n`` highest."""
    x = logits.astype(np.float64)
    lse = float(np.log(np.exp(x - x.max()).sum()) + x.max())
    top: tuple[tuple[int, float], ...] = ()
    if n:
        idx = np.argpartition(-x, n - 1)[:n] if n < len(x) else np.arange(len(x))
        idx = idx[np.argsort(-x[idx], kind="stable")]
        top = tuple((int(i), float(x[i] - lse)) for i in idx)
    return TokenLogprob(token, float(x[token] - lse), top)


_TOKEN_DATA = np.dtype([("id", np.int32), ("logit", np.float32), ("p", np.float32)])


class Sampler:
    """One generation's draw: argmax when greedy, else a llama.cpp sampler chain.

    The grammar sampler is kept outside the chain: the prompt is fed to the penalties (as llama.cpp's
    server does) but never to the grammar, which only ever sees generated tokens. Call ``sample``
    with the logits of the last decode, then ``accept`` the token that was kept; ``close`` frees the
    native samplers (and is safe to call twice).
    """

    def __init__(self, vocab: Any, n_vocab: int, params: SamplingParams, prompt: list[int]) -> None:
        self.params = params
        self._chain = self._grammar = None
        self._accepted = 0  # generated tokens the grammar has taken
        if params.greedy:
            return
        lib = self._lib = llama_lib()
        try:
            self._grammar = compile_grammar(vocab, params)
            self._chain = lib.llama_sampler_chain_init(lib.llama_sampler_chain_default_params())
            add = lambda s: lib.llama_sampler_chain_add(self._chain, s)  # noqa: E731
            if params.logit_bias:
                params.check_vocab(n_vocab)
                pairs = (lib.llama_logit_bias * len(params.logit_bias))(*params.logit_bias)
                add(lib.llama_sampler_init_logit_bias(n_vocab, len(pairs), pairs))
            if params.repeat_penalty != 1 or params.presence_penalty or params.frequency_penalty:
                add(lib.llama_sampler_init_penalties(
                    n_vocab, params.penalty_last_n, params.repeat_penalty, params.frequency_penalty,
                    params.presence_penalty,
                ))
            if params.temperature == 0:
                add(lib.llama_sampler_init_greedy())
            else:
                if params.top_k:
                    add(lib.llama_sampler_init_top_k(params.top_k))
                if params.top_p < 1:
                    add(lib.llama_sampler_init_top_p(params.top_p, 1))
                if params.min_p > 0:
                    add(lib.llama_sampler_init_min_p(params.min_p, 1))
                add(lib.llama_sampler_init_temp(params.temperature))
                seed = lib.LLAMA_DEFAULT_SEED if params.seed is None else params.seed
                add(lib.llama_sampler_init_dist(seed))
        except BaseException:
            self.close()
            raise
        for token in prompt[-params.penalty_last_n:] if params.penalty_last_n else ():
            lib.llama_sampler_accept(self._chain, token)
        self._data = np.zeros(n_vocab, _TOKEN_DATA)
        self._ids = np.arange(n_vocab, dtype=np.int32)
        self._ptr = self._data.ctypes.data_as(lib.llama_token_data_p)
        self._array = lib.llama_token_data_array(self._ptr, n_vocab, -1, False)
        self._array_p = ctypes.pointer(self._array)

    def sample(self, logits: np.ndarray) -> int:
        if self._chain is None:
            return int(np.argmax(logits))
        lib, arr = self._lib, self._array
        # llama.cpp's top-k, top-p and min-p sort and compact the array in place: every column is
        # rewritten each call, the ids too, or the next token's logits sit beside the last one's ids.
        self._data["id"] = self._ids
        self._data["logit"] = logits
        self._data["p"] = 0.0
        arr.data, arr.size, arr.selected, arr.sorted = self._ptr, len(self._data), -1, False
        if self._grammar is not None:
            lib.llama_sampler_apply(self._grammar, self._array_p)
            # A grammar that allows no token here (a character no token spells) leaves every logit
            # -inf; the chain would still pick one, and llama.cpp's grammar, accepting it, throws a
            # C++ exception that terminates the process.
            if not np.isfinite(self._data["logit"][: arr.size]).any():
                raise ParamError("the grammar allows no token of this model's vocabulary here "
                                 f"(after {self._accepted} generated tokens)", "grammar")
        lib.llama_sampler_apply(self._chain, self._array_p)
        if not 0 <= arr.selected < arr.size:
            raise ConfigError("the sampler chain selected no token (a grammar that allows none?)")
        return int(arr.data[arr.selected].id)

    def accept(self, token: int) -> None:
        if self._chain is None:
            return
        if self._grammar is not None:
            self._lib.llama_sampler_accept(self._grammar, token)
            self._accepted += 1
        self._lib.llama_sampler_accept(self._chain, token)

    def close(self) -> None:
        if self._grammar is not None:
            self._lib.llama_sampler_free(self._grammar)
            self._grammar = None
        if self._chain is not None:
            self._lib.llama_sampler_free(self._chain)
            self._chain = None
