"""``engram calibrate`` prints each warning styled, never as a raw ``[bold yellow]`` tag (the CLI's consoles
print without markup, since server text may hold brackets), and keeps the server's brackets as written."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from engram_client.cli import calibration

pytestmark = pytest.mark.fast


def test_a_warning_is_styled_and_its_brackets_kept(capsys: pytest.CaptureFixture[str]) -> None:
    result = SimpleNamespace(seconds={}, evaluations=3, warnings=["the search stayed at alpha_min [0.05]"])
    calibration._render_warnings(result)
    printed = capsys.readouterr().out
    assert printed.strip() == "warning: the search stayed at alpha_min [0.05]", printed
