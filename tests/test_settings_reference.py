"""docs/settings.md, the settings reference, against ``service.config.Settings`` as the code has it now.

The reference is generated (``make api-docs``, scripts/gen_settings_docs.py) from each field's type,
default and bounds and from the comment that describes it in service/config.py; a setting added,
renamed, re-defaulted or left without a description fails here.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import pytest

from service.config import Settings

REPO_ROOT = Path(__file__).resolve().parents[1]
REFERENCE = REPO_ROOT / "docs" / "settings.md"


@pytest.fixture(scope="module")
def generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gen_settings_docs", REPO_ROOT / "scripts" / "gen_settings_docs.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_committed_reference_is_what_the_settings_class_renders(generator: ModuleType) -> None:
    assert REFERENCE.read_text() == generator.render(), "docs/settings.md is stale: run `make api-docs` and commit it"


def test_every_setting_is_in_the_reference_with_a_description(generator: ModuleType) -> None:
    assert generator.undocumented() == [], "describe these settings in service/config.py (a comment above the field)"
    text = REFERENCE.read_text()
    for name in Settings.model_fields:
        assert f"`ENGRAM_{name.upper()}`" in text


def test_a_field_without_a_comment_takes_its_groups_heading_and_a_lone_one_has_none(generator: ModuleType) -> None:
    source = """
class Settings:
    model_config = {}

    # Heading of the group.
    first: int = 1
    second: int = 2
    # Its own.
    third: int = 3

    alone: int = 4
"""
    assert generator.comments_above(source) == {
        "first": "Heading of the group.",
        "second": "Heading of the group.",
        "third": "Its own.",
    }
