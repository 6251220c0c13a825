"""Python client and `engram` CLI for the Engram Service HTTP API.

``from engram_client import EngramClient``; the CLI is :mod:`engram_client.cli` (console script ``engram``).
"""

from engram_client.client import (
    DEFAULT_URL,
    EngramAPIError,
    EngramClient,
    EngramConnectionError,
    EngramDownloadError,
    EngramError,
    EngramJobError,
    EngramOutputExistsError,
    EngramTimeoutError,
    Page,
)

__all__ = [
    "DEFAULT_URL",
    "EngramAPIError",
    "EngramClient",
    "EngramConnectionError",
    "EngramDownloadError",
    "EngramError",
    "EngramJobError",
    "EngramOutputExistsError",
    "EngramTimeoutError",
    "Page",
]
