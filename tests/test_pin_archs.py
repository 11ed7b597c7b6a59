"""The supported architectures are exactly the pin's MoE architectures less those the README
names as left out: a pin bump that adds one (``bmoe/io/pin_archs.py`` re-read from its sources)
fails here until it gets a recipe or a reason."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from bmoe.io.pin_archs import LEFT_OUT, PIN_MOE_ARCHS
from bmoe.io.recipes import RECIPES

pytestmark = pytest.mark.pure
README = Path(__file__).resolve().parent.parent / "README.md"


def supported_section() -> str:
    text = README.read_text()
    start = text.index("## Supported architectures")
    return text[start:text.index("\n## ", start + 1)]


def test_supported_is_the_pins_moe_list_less_what_is_left_out() -> None:
    assert set(LEFT_OUT) <= set(PIN_MOE_ARCHS), set(LEFT_OUT) - set(PIN_MOE_ARCHS)
    assert set(RECIPES) == set(PIN_MOE_ARCHS) - set(LEFT_OUT), (
        f"recipes the pin does not list: {sorted(set(RECIPES) - set(PIN_MOE_ARCHS))}; "
        f"pin archs with neither a recipe nor a reason: {sorted(set(PIN_MOE_ARCHS) - set(RECIPES) - set(LEFT_OUT))}")


def test_the_readme_names_every_arch_left_out_and_every_supported_one() -> None:
    section = supported_section()
    named = set(re.findall(r"`([\w.-]+)`", section))
    assert set(LEFT_OUT) <= named, sorted(set(LEFT_OUT) - named)
    assert set(RECIPES) <= named, sorted(set(RECIPES) - named)


def test_a_new_pin_arch_without_a_reason_fails() -> None:
    """The negative control: an architecture added by a pin bump is caught by the same rule."""
    bumped = set(PIN_MOE_ARCHS) | {"newmoe"}
    assert set(RECIPES) != bumped - set(LEFT_OUT)
