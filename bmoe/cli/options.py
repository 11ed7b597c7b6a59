"""The engine's option vocabulary: every flag that fills a ``RunConfig`` (or ``SamplingParams``)
field, declared once here with its name, value type and range (its one validator), default, help,
and the field it fills. ``run``, ``chat``, ``serve``, ``replay``, ``inspect`` and ``quality`` add
these ``Option`` values to their parsers (``add_options``) instead of spelling the flags
themselves, and a config is filled from the options a command declared (``fields_of``), never from
a second field/flag table. A ConfigError in a field's name is told in the flag's (``in_flags``).

A command may give one option another default or help where its meaning differs (``quality``
opens two sessions side by side, so its cache stays off unless asked); the name, the validator and
the field never differ."""

from __future__ import annotations

import argparse
import re
import shlex
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

from bmoe.argtypes import number, plain
from bmoe.engine.config import (
    DENSE_POLICIES,
    DRAFTS,
    MAX_CTX,
    MAX_DRAFT,
    MAX_PARALLEL,
    OPEN_MODES,
    PREFILLS,
    MiB,
)
from bmoe.errors import ConfigError

MAX_MIB = float(1 << 30)  # 1 PiB: beyond any machine; bounds the bytes computed from a budget
mib = number(float, 0, MAX_MIB, "a number of MiB")
tokens = number(int, 1, 1 << 20, "a number of tokens")


def budget_mib(text: str) -> float:
    """A cache size in MiB: 0 (off) or from 1 MiB up. Below 1 MiB is a units mistake (bytes, not
    MiB), refused here as RunConfig refuses it; 1e-9 used to run with the cache quietly off."""
    value = mib(text)
    if 0 < value < 1:
        raise argparse.ArgumentTypeError(f"expected 0 (off) or at least 1 MiB, got {text!r}")
    return value


def cache_mb(text: str) -> float | None:
    """``auto`` (None: sized at open) or a budget in MiB."""
    if text == "auto":
        return None
    try:
        return budget_mib(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"expected 'auto' or a number of MiB: 0 (off) or 1 MiB to {plain(MAX_MIB)}, "
                                         f"got {text!r}") from None


def _bytes(value: float | None) -> int | None:
    return None if value is None else int(value * MiB)


_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "\\": "\\", "'": "'", '"': '"'}


def escaped(text: str) -> str:
    """A flag's text with the escapes llama.cpp's command line processes (``\\n \\r \\t \\\\ \\' \\"``):
    the shell passes ``--stop "\\n\\n"`` as a backslash and an n, which no model writes."""
    return re.sub(r"\\(.)", lambda m: _ESCAPES.get(m.group(1), m.group(0)), text)


def _grammar(path: Path | None) -> str | None:
    if path is None:
        return None
    try:
        return path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"--grammar-file {path}: {getattr(exc, 'strerror', None) or exc}") from None


def _schema(text: str | None) -> dict | None:
    """``--json-schema``: JSON text, or a file holding it; a schema is an object."""
    import json

    if text is None:
        return None
    raw = text
    if not raw.lstrip().startswith(("{", "[")):
        try:
            raw = Path(text).read_text()
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"--json-schema {text}: neither JSON nor a readable file "
                              f"({getattr(exc, 'strerror', None) or exc})") from None
    try:
        schema = json.loads(raw)
    except ValueError as exc:
        raise ConfigError(f"--json-schema: not valid JSON ({exc})") from None
    if not isinstance(schema, dict):
        raise ConfigError(f"--json-schema: a schema is a JSON object, got {type(schema).__name__}")
    return schema


@dataclass(frozen=True)
class Option:
    """One engine flag. ``action`` is argparse's (``store`` with ``parse`` as its type, or
    ``store_true``, ``append``, ``BooleanOptionalAction``); ``to_field`` turns the parsed value
    into the field's (MiB into bytes, ``--no-odirect`` into ``odirect=False``); ``streamed_only``:
    it does nothing with ``--resident``, which is said when it is given."""

    flags: tuple[str, ...]
    help: str
    field: str | None = None
    target: str = "run"  # "run": a RunConfig field; "sampling": a SamplingParams field
    parse: Callable[[str], Any] | None = None
    default: Any = None
    choices: tuple[str, ...] | None = None
    action: Any = "store"
    metavar: str | None = None
    to_field: Callable[[Any], Any] | None = None
    streamed_only: bool = False
    consts: tuple[tuple[str, str, str], ...] = ()  # (flag, value, help): a mutually exclusive set

    @property
    def name(self) -> str:
        """The flag as errors name it: the first spelling (``-t``, ``--io-threads``)."""
        return self.flags[0]

    @property
    def dest(self) -> str:
        if self.consts:
            return self.field or ""
        return max(self.flags, key=len).lstrip("-").replace("-", "_")

    def field_value(self, value: Any) -> Any:
        return self.to_field(value) if self.to_field is not None else value

    def add(self, p: argparse.ArgumentParser | argparse._ArgumentGroup, *, default: Any = ...,
            help: str | None = None) -> None:  # noqa: A002 - argparse's word
        """Declare this option on ``p``; ``default`` / ``help``: the command's own, where its
        meaning differs. Each action it adds is tagged with the option and records that it was
        given (``given``)."""
        default = self.default if default is ... else default
        if self.consts:
            group = p.add_mutually_exclusive_group()
            for flag, value, text in self.consts:
                _tag(group.add_argument(flag, dest=self.dest, action=_given_action(p, "store_const"), const=value,
                                        help=text), self)
            p.set_defaults(**{self.dest: default})
            return
        kw: dict[str, Any] = {"dest": self.dest, "default": default, "help": help or self.help,
                              "action": _given_action(p, self.action)}
        if self.parse is not None:
            kw["type"] = self.parse
        if self.choices is not None:
            kw["choices"] = self.choices
        if self.metavar is not None:
            kw["metavar"] = self.metavar
        _tag(p.add_argument(*self.flags, **kw), self)


def _tag(action: argparse.Action, option: Option) -> None:
    action.bmoe_option = option  # type: ignore[attr-defined] - what test_cli_options checks


def declared(action: argparse.Action) -> Option | None:
    """The vocabulary's option an argparse action was added for, or None (a command's own flag)."""
    return getattr(action, "bmoe_option", None)


_GIVEN = "_bmoe_given"


def _given_action(p: argparse.ArgumentParser | argparse._ArgumentGroup, action: Any) -> type[argparse.Action]:
    base = p._registry_get("action", action, action) if isinstance(action, str) else action  # noqa: SLF001

    class Given(base):  # type: ignore[valid-type, misc]
        def __call__(self, parser, namespace, values, option_string=None):  # noqa: ANN001, ANN204
            given = getattr(namespace, _GIVEN, None)
            if given is None:
                given = set()
                setattr(namespace, _GIVEN, given)
            given.add(self.dest)
            super().__call__(parser, namespace, values, option_string)

    return Given


def given(args: argparse.Namespace, option: Option) -> bool:
    """Whether the command line gave ``option`` (its default, typed out, counts as given)."""
    return option.dest in getattr(args, _GIVEN, ())


# --- the vocabulary --------------------------------------------------------------------------

MODE = Option(("--stream", "--resident"), "", field="mode", default="stream", consts=(
    ("--stream", "stream", "read routed experts from disk on demand (the default)"),
    ("--resident", "resident", "plain llama.cpp: the whole file mapped, nothing streamed"),
))
IO_THREADS = Option(("--io-threads",), "I/O lanes for expert reads", field="io_threads",
                    parse=number(int, 1, 64, "a number of I/O lanes"), default=2, metavar="N", streamed_only=True)
NO_ODIRECT = Option(("--no-odirect",), "buffered reads instead of O_DIRECT", field="odirect", action="store_true",
                    default=False, to_field=lambda v: not v, streamed_only=True)
CACHE_MB = Option(("--cache-mb",), "expert cache budget in MiB; auto (the default) sizes it at open from the memory "
                  "available; 0 turns it off (every routed expert read every time it is used)", field="cache_bytes", parse=cache_mb,
                  default=None, metavar="MIB|auto", to_field=_bytes, streamed_only=True)
CACHE_CEIL_MB = Option(("--cache-ceil-mb",), "with --cache-mb auto: the most the budget may be, at open and as the "
                       "pressure guard grows it (default: no ceiling; does nothing with a fixed --cache-mb)",
                       field="cache_ceiling_bytes", parse=budget_mib, metavar="MIB", to_field=_bytes,
                       streamed_only=True)
CACHE_PROFILE = Option(("--cache-profile",), "seed the cache policy from this JSON profile if it exists, save what "
                       "the run learned to it at the end (lossless: only the eviction order changes; default: none)",
                       field="cache_profile", metavar="FILE", streamed_only=True)
PREWARM = Option(("--prewarm",), "with --cache-profile: read the profile's most used experts into the cache's free "
                 "room in the background from the first prompt on (lossless; real reads go first)", field="prewarm",
                 action="store_true", default=False, streamed_only=True)
FORCE = Option(("--force",), "run a --cache-mb that the memory model says cannot fit (warned, not refused)",
               field="force_cache", action="store_true", default=False)
NO_PRESSURE_GUARD = Option(("--no-pressure-guard",), "keep the budget fixed while running (default: shrink it under "
                           "memory pressure, grow it back after)", field="pressure_guard", action="store_true",
                           default=False, to_field=lambda v: not v)
NO_WARM_POOL = Option(("--no-warm-pool",), "fault the cache's pages in on the reads only (default: a background "
                      "thread faults them in while the session is idle, so a fresh cache's first misses land in "
                      "ready pages)", field="warm_pool", action="store_true", default=False, to_field=lambda v: not v)
DENSE_WEIGHTS = Option(("--dense-weights",), "mmap: dense weights stay in the file mapping; anon: copied into "
                       "anonymous memory (safe from page-cache churn)", field="dense_weights", choices=DENSE_POLICIES,
                       default="mmap")
OPEN_MODE = Option(("--open-mode",), "how a streamed model is opened (auto: the cheapest that works here)",
                   field="open_mode", choices=OPEN_MODES, default="auto", streamed_only=True)
PREFILL = Option(("--prefill",), "how a prompt runs: one batch, micro-batches of 8, token by token, expert-major (one "
                 "batch whose experts are read and computed group by group), or auto (one batch, or expert-major "
                 "where one batch's expert union would exceed the cache budget and the model allows it; never "
                 "chunks)", field="prefill", choices=PREFILLS, default="auto")
ROUTE_TRACE = Option(("--route-trace",), "write every routing decision to this file (default: none)",
                     field="route_trace", metavar="FILE")
OVERLAP = Option(("--overlap",), "read later projections while earlier expert matmuls compute (lossless)",
                 field="overlap", action="store_true", default=False)
PREFETCH = Option(("--prefetch",), "read the previous token's experts of the next K layers ahead (needs a cache; "
                  "0: off)", field="prefetch_layers", parse=number(int, 0, 64, "a number of layers"), default=0,
                  metavar="K")
PREDICT_PREFETCH = Option(("--predict-prefetch",), "predict the next layer's experts with its router and read them "
                          "ahead (needs a cache)", field="predict_prefetch", action="store_true", default=False)
PREDICT_PROMPT = Option(("--predict-prompt",), "the same for a batched prompt: read the next layer's predicted experts "
                        "while a layer computes (default: on when streaming with a cache)", field="predict_prompt",
                        action=argparse.BooleanOptionalAction)
THREADS = Option(("-t", "--threads"), "compute threads (default: every core this process may run on)",
                 field="n_threads", parse=number(int, 1, 512, "a thread count"), metavar="N")
CTX = Option(("-c", "--ctx"), "context length in tokens", field="n_ctx",
             parse=number(int, 16, MAX_CTX, "a context length"), default=2048, metavar="N")
PARALLEL = Option(("--parallel",), "sequences decoded together, one token of each per step (the context's cells "
                  "split evenly between them)", field="parallel",
                  parse=number(int, 1, MAX_PARALLEL, "a number of sequences"), default=1, metavar="N")
DRAFT = Option(("--draft",), "speculative decoding: ngram drafts tokens from the context's own repeated n-grams and "
               "verifies them in one step (greedy and seeded output unchanged); none: off", field="draft",
               choices=DRAFTS, default="none")
DRAFT_MAX = Option(("--draft-max",), "with --draft ngram: the longest draft one step verifies", field="draft_max",
                   parse=number(int, 1, MAX_DRAFT, "a number of draft tokens"), default=8, metavar="N")

LOSSY_TITLE = "lossy levers (opt-in: the output is no longer the model's exact output)"
N_EXPERT_USED = Option(("--n-expert-used",), "use the top K experts per token instead of the file's own k (1..k; default: the file's k)",
                       field="n_expert_used", parse=number(int, 1, 1 << 16, "a number of experts"), metavar="K")
DROP_COLD = Option(("--drop-cold-experts",), "at decode, skip a routed expert that is a cache miss and weighs < F/k "
                   "(never the top one; needs a cache; default: off)", field="drop_cold_experts",
                   parse=number(float, 0, 1 << 16, "a fraction"), metavar="F")
DROP_NO_RENORM = Option(("--drop-no-renorm",), "with --drop-cold-experts: keep the survivors' weights (default: "
                        "renormalise)", field="drop_renorm", action="store_true", default=False, to_field=lambda v: not v)
DROP_PREFILL = Option(("--drop-prefill",), "with --drop-cold-experts: drop in prefill too", field="drop_prefill",
                      action="store_true", default=False)
ROUTE_AHEAD = Option(("--route-ahead",), "route each MoE layer from the hidden state N layers earlier and read its "
                     "experts that far ahead (needs a cache; excludes --prefetch/--predict-prefetch; default: off)",
                     field="route_ahead", parse=number(int, 0, 64, "a number of MoE layers"), metavar="N")

SAMPLING_TITLE = "sampling (greedy unless --temp > 0; run through llama.cpp's samplers)"
_s = {"target": "sampling"}
TEMP = Option(("--temp",), "temperature (0 = greedy)", field="temperature", parse=float, default=0.0, **_s)
TOP_K = Option(("--top-k",), "keep the k most likely tokens (0 = off)", field="top_k", parse=int, default=0, **_s)
TOP_P = Option(("--top-p",), "nucleus: keep tokens up to this mass (1 = off)", field="top_p", parse=float, default=1.0,
               **_s)
MIN_P = Option(("--min-p",), "drop tokens below this share of the top one (0 = off)", field="min_p", parse=float,
               default=0.0, **_s)
REPEAT_PENALTY = Option(("--repeat-penalty",), "penalise recent tokens (1 = off)", field="repeat_penalty", parse=float,
                        default=1.0, **_s)
PRESENCE_PENALTY = Option(("--presence-penalty",), "penalise tokens already present (0 = off)",
                          field="presence_penalty", parse=float, default=0.0, **_s)
FREQUENCY_PENALTY = Option(("--frequency-penalty",), "penalise tokens by their count (0 = off)",
                           field="frequency_penalty", parse=float, default=0.0, **_s)
SEED = Option(("--seed",), "seed of the draw (default, or -1: a fresh one each run)", field="seed", parse=int,
              to_field=lambda v: None if v == -1 else v, **_s)  # -1: a fresh one, as llama.cpp and the server spell it
GRAMMAR_FILE = Option(("--grammar-file",), "constrain the output with a GBNF grammar (default: none)", field="grammar",
                      parse=Path, to_field=_grammar, **_s)
JSON_SCHEMA = Option(("--json-schema",), "constrain the output to JSON matching this schema (JSON text, or a file "
                     "holding it; default: none)", field="json_schema", to_field=_schema, **_s)
STOP = Option(("--stop",), "stop before this text (repeatable); it is never printed; \\n \\t \\r \\\\ are escapes, as "
              "in llama.cpp's command line (default: none)", field="stop", target="stop", action="append", parse=escaped,
              metavar="TEXT")

# The sets the commands add, in --help's order.
ENGINE = (MODE, IO_THREADS, NO_ODIRECT, CACHE_MB, CACHE_CEIL_MB, CACHE_PROFILE, PREWARM, FORCE, NO_PRESSURE_GUARD,
          NO_WARM_POOL, DENSE_WEIGHTS, OPEN_MODE, PREFILL, ROUTE_TRACE, OVERLAP, PREFETCH, PREDICT_PREFETCH,
          PREDICT_PROMPT, THREADS, CTX, PARALLEL, DRAFT, DRAFT_MAX)
LOSSY = (N_EXPERT_USED, DROP_COLD, DROP_NO_RENORM, DROP_PREFILL, ROUTE_AHEAD)
SAMPLING = (TEMP, TOP_K, TOP_P, MIN_P, REPEAT_PENALTY, PRESENCE_PENALTY, FREQUENCY_PENALTY, SEED, GRAMMAR_FILE,
            JSON_SCHEMA, STOP)
VOCABULARY = (*ENGINE, *LOSSY, *SAMPLING)

_OPTIONS = "_bmoe_options"


def add_options(p: argparse.ArgumentParser, options: Iterable[Option], title: str | None = None) -> None:
    """Declare ``options`` on the command ``p`` (in an argument group titled ``title``, if given),
    and remember them: ``fields_of`` fills a config from exactly these."""
    options = tuple(options)
    where = p.add_argument_group(title) if title else p
    for option in options:
        option.add(where)
    remember(p, options)


def remember(p: argparse.ArgumentParser, options: Iterable[Option]) -> None:
    """Count ``options``, added by the command itself (with its own default or help), as declared."""
    known = p.get_default(_OPTIONS) or ()
    p.set_defaults(**{_OPTIONS: (*known, *options)})


def options_of(args: argparse.Namespace) -> tuple[Option, ...]:
    return getattr(args, _OPTIONS, ())


def fields_of(args: argparse.Namespace, target: str = "run") -> dict[str, Any]:
    """The ``target``'s fields (``run``: RunConfig's, ``sampling``: SamplingParams') that the
    options the command declared fill, from the parsed ``args``."""
    return {o.field: o.field_value(getattr(args, o.dest)) for o in options_of(args)
            if o.target == target and o.field is not None}


# --- errors in the flags' words --------------------------------------------------------------

# Besides each option's field: the words of a field that no single flag fills.
_EXTRA_WORDS = {"mode='stream'": "streaming (no --resident)", "mode='resident'": "--resident",
                "json_object": "a JSON object", "max_tokens": "-n"}
# A field spelt as one plain word is a flag in an error only where the errors use it as a name
# ("prefill 'expert' reads..."); "grammar" is also llama.cpp's word for the thing it parses.
_WORD_FIELDS = ("overlap", "seed", "stop", "prefill", "prewarm", "parallel", "draft", "temperature")
FLAG_OF = {**{o.field: o.name for o in VOCABULARY
              if o.field and not o.consts and ("_" in o.field or o.field in _WORD_FIELDS)}, **_EXTRA_WORDS}
_FLAG_WORDS = re.compile("|".join(rf"(?<![\w-]){re.escape(k)}(?![\w-])" for k in sorted(FLAG_OF, key=len, reverse=True)))


def in_flags(exc: ConfigError) -> ConfigError:
    """The same error in the command line's words (``cache_bytes`` -> ``--cache-mb``): RunConfig
    and SamplingParams name the API's fields (a Python caller's words)."""
    return type(exc)(_FLAG_WORDS.sub(lambda m: FLAG_OF[m.group(0)], str(exc)))


# --- a lever string (quality --lossy "FLAGS") ------------------------------------------------


class _LeverParser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise ConfigError(f"--lossy: {message}")


def parse_lossy(text: str) -> dict[str, object]:
    """RunConfig fields from a flag string like ``"--n-expert-used 4"``, read by the same options
    run and chat declare; a bad one is a ConfigError."""
    parser = _LeverParser(prog="--lossy", add_help=False)
    add_options(parser, LOSSY)
    try:
        words = shlex.split(text)
    except ValueError as e:  # an unbalanced quote: it was an internal error
        raise ConfigError(f"--lossy {text!r}: {e}") from None
    fields = fields_of(parser.parse_args(words))
    if all(fields[o.field] is None for o in (N_EXPERT_USED, DROP_COLD, ROUTE_AHEAD)):
        raise ConfigError(f"--lossy {text!r} turns no lossy lever on")
    return fields
