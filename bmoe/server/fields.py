"""Which fields of a completion request the server takes, ignores or refuses.

As the OpenAI API does, a field it does not know is refused (400, ``Unrecognized request argument
supplied: NAME``, ``param`` the name): a misspelt ``max_token`` or ``temprature`` was silently
dropped and the answer was not the one asked for. Three kinds are accepted:

- the fields the request schemas declare (``bmoe.server.schemas``): honoured, or refused by name
  by the engine when bmoe cannot do what they ask (``echo``, ``best_of`` > 1, a sampler bmoe has not);
- ``IGNORED``: fields that change nothing in the tokens generated (who the user is, where OpenAI
  stores the reply, llama-server's slot and timing bookkeeping): accepted and ignored, as
  llama-server ignores them;
- ``OFF_ONLY``: llama-server's samplers bmoe has none for (DRY, XTC, dynamic temperature...),
  accepted at the value that leaves them off (llama-server's web page sends them so) and refused
  by name at any other.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

IGNORED = frozenset({
    # OpenAI: bookkeeping, or choices with one answer only here
    "user", "metadata", "store", "service_tier", "parallel_tool_calls", "prompt_cache_key",
    "safety_identifier", "modalities", "prediction", "reasoning_effort", "verbosity", "web_search_options",
    # llama-server: slots, timings and what the reply carries besides the text
    "id_slot", "timings_per_token", "return_tokens", "return_progress", "post_sampling_probs",
    "response_fields", "t_max_predict_ms", "t_max_prompt_ms", "n_indent", "n_keep", "n_discard", "n_cmpl",
    "samplers", "min_keep", "penalize_nl", "lora",
})

OFF_ONLY: dict[str, Any] = {
    "dry_multiplier": 0, "dry_base": None, "dry_allowed_length": None, "dry_penalty_last_n": None,
    "dry_sequence_breakers": None, "xtc_probability": 0, "xtc_threshold": None, "top_n_sigma": -1,
    "dynatemp_range": 0, "dynatemp_exponent": None,
}  # None: a setting of a sampler that is off unless its first field is set: any value is inert


class FieldError(Exception):
    def __init__(self, message: str, param: str, code: str | None = None) -> None:
        super().__init__(message)
        self.param, self.code = param, code


def check_fields(body: Mapping[str, Any], declared: frozenset[str] | set[str]) -> None:
    """Raise FieldError for the first field that is neither declared, ignored nor off."""
    for name, value in body.items():
        if name in declared or name in IGNORED:
            continue
        if name in OFF_ONLY:
            off = OFF_ONLY[name]
            if off is None or value is None or (
                    isinstance(value, int | float) and not isinstance(value, bool) and value == off):
                continue
            raise FieldError(f"{name} is not supported (only {off}, which leaves it off)", name)
        shown = name if len(name) <= 80 else name[:80] + "..."
        raise FieldError(f"Unrecognized request argument supplied: {shown}", shown, "unknown_parameter")
