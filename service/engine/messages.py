"""What records and chat rendering share: a conversation's turns and the error that names a bad record.

Its own module so that :mod:`service.engine.records` (which renders chat records through
:mod:`service.engine.chat`) and :mod:`service.engine.chat` (which takes these turns) need not
import each other.
"""

from __future__ import annotations

from dataclasses import dataclass


class RecordError(ValueError):
    """A record that cannot be used, with a message naming it."""


# The roles a chat message may have (OpenAI's and TRL's, Llama's "ipython" for tool output).
ROLES = ("system", "developer", "user", "assistant", "tool", "ipython")


@dataclass(frozen=True)
class Message:
    """One turn of a conversation."""

    role: str
    content: str
