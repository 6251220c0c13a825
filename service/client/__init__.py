"""Python client and `engram` CLI for the Engram Service HTTP API.

``from service.client import EngramClient``; the CLI is :mod:`service.client.cli` (console script ``engram``).
"""

from service.client.client import (
    DEFAULT_URL,
    EngramAPIError,
    EngramClient,
    EngramConnectionError,
    EngramDownloadError,
    EngramError,
    EngramJobError,
    EngramOutputExistsError,
    EngramTimeoutError,
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
]
