"""The engine's exceptions, in a module that imports nothing heavy.

Processes that only route jobs or check requests (the API) catch or raise these without importing
torch or transformers.
"""

from __future__ import annotations


class EditError(ValueError):
    """The requested edit cannot be computed (missing statistics, non-finite result)."""


class CollectionCancelled(RuntimeError):
    """Raised between batches when the caller asked to stop."""
