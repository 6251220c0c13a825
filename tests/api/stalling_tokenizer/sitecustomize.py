"""Test-only: a collection phase stuck where no cancellation check runs, for a test server started
with this folder on PYTHONPATH (``tests/api/test_cancel_phases.py``).

Every phase of a collection checks cancellation, but a call into native code (a tokenizer on a
huge input, a model load, a blocking read) cannot be interrupted from Python, and no input this
service accepts makes one last long enough to test on purpose. So a record whose text starts with
``STALL-IN-NATIVE-CODE`` stands for one: cutting it to its budget (``service.engine.record_budget.cut``,
called for every record before it is tokenized) sleeps for an hour, in ``time.sleep``, which like a
native call holds no Python frame a check could run in. Every other record runs for real.
"""

from __future__ import annotations

import time

MARKER = "STALL-IN-NATIVE-CODE"

try:
    import service.engine.record_budget as _budget
except ImportError:  # not the service's interpreter
    _budget = None

if _budget is not None:
    _cut = _budget.cut

    def _stalling_cut(text: str, budget: int | None) -> tuple[str, str]:
        if text.startswith(MARKER):
            time.sleep(3600)
        return _cut(text, budget)

    _budget.cut = _stalling_cut
