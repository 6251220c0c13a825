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
    """One turn of a conversation; ``name``: a participant's name, handed to the chat template."""

    role: str
    content: str
    name: str | None = None

    def as_dict(self) -> dict[str, str]:
        """The turn as a chat template and a stored record take it (``name`` only when given)."""
        turn = {"role": self.role, "content": self.content}
        if self.name is not None:
            turn["name"] = self.name
        return turn
