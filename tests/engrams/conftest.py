"""Engine-heavy tests on tiny matrices run single-threaded, as tests/engine does."""

from __future__ import annotations

from tests.engine.conftest import single_thread

__all__ = ["single_thread"]
