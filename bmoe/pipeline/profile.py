"""Cache profiles: what a run learned about its model's routing, saved for the next run's cache.

A profile is a small JSON file (``--cache-profile FILE``), written when a streamed session closes
and read when the next one opens, so the cache policy starts from the model's measured
popularity instead of from nothing. Only the policy's ordering is seeded: which experts are read
and what the model computes never depend on it (a seeded run gives the cold run's tokens; gated
in ``tests/test_profile.py``). Format::

    {"format": "bmoe-cache-profile", "version": 1,
     "model": "<file name>", "n_layer": 48, "n_expert": 128, "tokens": 412, "visits": 824.0,
     "layers": {"0": [0.012, 0.0, ...], ...}}

``layers[il][e]``: the chance that layer ``il`` routes expert ``e`` on a token, as the run last
estimated it (a slowly decayed rate, bias-corrected for a short run: a layer's values sum to about
its top-k); ``tokens``: how many decode calls the run made; ``visits``: how many layer visits of
evidence the estimate holds (this run's and those of the profile it started from, the older ones
decayed), so the next run weighs it as that much routing and no more. Two runs sharing one
profile at once each start from it and the last to close replaces it (atomically: never a torn
file), so the other's learning is lost. A profile without
``visits`` (written before it existed) counts as ``tokens`` visits. Readers refuse a profile for
another shape, one that is not this format, or one larger than ``MAX_PROFILE_BYTES``, with one line.
"""

from __future__ import annotations

import json
import math
import os
import re
import stat
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from bmoe.errors import ConfigError

FORMAT = "bmoe-cache-profile"
VERSION = 1
MAX_PROFILE_BYTES = 64 << 20


@dataclass(frozen=True)
class Profile:
    """A profile as read: per layer, each expert's chance of being routed on a token, and how many
    layer visits of routing that estimate rests on."""

    usage: dict[int, np.ndarray]
    visits: float


def save_profile(path: str | os.PathLike[str], usage: Mapping[int, np.ndarray], *, model: str,
                 n_layer: int, n_expert: int, tokens: int, visits: float) -> None:
    """Write the profile atomically (a temporary file beside it, then a rename)."""
    doc = {
        "format": FORMAT, "version": VERSION, "model": model, "n_layer": n_layer, "n_expert": n_expert,
        "tokens": tokens, "visits": round(float(visits), 1),
        "layers": {str(il): [round(float(x), 5) for x in np.asarray(u)[:n_expert]] for il, u in sorted(usage.items())},
    }
    name = os.fspath(path)
    try:
        stream = not stat.S_ISREG(os.stat(name).st_mode)  # /dev/null, a pipe: written where it is
    except OSError:
        stream = False
    # A file goes through a temporary file renamed over it; a rename over a device would replace
    # the device (as root, /dev/null itself).
    target = name if stream else f"{name}.tmp-{os.getpid()}"
    try:
        with open(target, "w", encoding="utf-8") as f:
            json.dump(doc, f, separators=(",", ":"))
        if not stream:
            os.replace(target, name)
    except OSError as e:
        if not stream:
            try:
                os.unlink(target)
            except OSError:
                pass
        raise ConfigError(f"{name}: cannot write the cache profile: {e.strerror or e}") from e


def load_profile(path: str | os.PathLike[str], *, n_layer: int, n_expert: int) -> Profile:
    """The usage rates of a profile made for this shape of model, and the visits they rest on."""
    name = os.fspath(path)
    try:
        with open(name, "rb") as f:
            raw = f.read(MAX_PROFILE_BYTES + 1)
    except OSError as e:
        raise ConfigError(f"{name}: cannot read the cache profile: {e.strerror or e}") from e
    if len(raw) > MAX_PROFILE_BYTES:
        raise ConfigError(f"{name}: larger than {MAX_PROFILE_BYTES >> 20} MiB: not a cache profile")
    try:
        doc = json.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError):  # RecursionError: nested past Python's stack
        raise ConfigError(f"{name}: not a cache profile (not JSON, or nested too deep)") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT or doc.get("version") != VERSION:
        raise ConfigError(f"{name}: not a {FORMAT} v{VERSION} file")
    if (doc.get("n_layer"), doc.get("n_expert")) != (n_layer, n_expert):
        raise ConfigError(f"{name}: a profile for {doc.get('n_layer')} layers x {doc.get('n_expert')} experts, "
                          f"this model has {n_layer} x {n_expert}")
    layers = doc.get("layers")
    if not isinstance(layers, dict):
        raise ConfigError(f"{name}: no 'layers' object")
    visits = doc.get("visits", doc.get("tokens"))
    if not (isinstance(visits, (int, float)) and not isinstance(visits, bool) and math.isfinite(visits)
            and visits >= 0):
        raise ConfigError(f"{name}: 'visits' (or 'tokens') must be a number >= 0, got {visits!r}")
    out: dict[int, np.ndarray] = {}
    for key, values in layers.items():
        # ASCII digits written as the file writes them: "²" passed isdigit() and failed int(),
        # and "00" was layer 0 a second time.
        if not (isinstance(key, str) and re.fullmatch(r"0|[1-9][0-9]{0,8}", key) and int(key) < n_layer):
            raise ConfigError(f"{name}: layer {key!r} is not a layer number below n_layer={n_layer}")
        if (not isinstance(values, list) or len(values) != n_expert
                or not all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
                           and 0 <= v <= 1 for v in values)):
            raise ConfigError(f"{name}: layer {key}: expected {n_expert} rates in [0, 1]")
        out[int(key)] = np.asarray(values, dtype=np.float64)
    return Profile(out, float(visits))


def prewarm_order(usage: Mapping[int, np.ndarray], entry_bytes: Mapping[int, int], budget_bytes: int) -> list[tuple[int, int]]:
    """The (layer, expert) entries worth reading before they are routed: the most used first
    (a rate is a per-token chance of being routed, comparable across layers), as many as fit in
    ``budget_bytes``. Entries never seen used (rate 0) are not worth a read."""
    ranked = sorted(((float(rate), layer, int(e)) for layer, rates in usage.items() if layer in entry_bytes
                     for e, rate in enumerate(np.asarray(rates).tolist()) if rate > 0),
                    key=lambda t: (-t[0], t[1], t[2]))
    out: list[tuple[int, int]] = []
    room = budget_bytes
    for _, layer, e in ranked:
        need = entry_bytes[layer]
        if need <= room:
            out.append((layer, e))
            room -= need
    return out
