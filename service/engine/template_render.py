"""Chat templates rendered in a child process with bounds on time, memory and size, and cancellable.

Why a process and not a hardened sandbox in the job process: a sandbox can refuse the operators it
sees (``'a' * N``), but no jinja hook interrupts a loop that calls nothing
(``{% for a in messages %}{% for b in messages %}``), and a template has many ways to build a large
string (``~`` doubling a namespace value, ``center``, ``format``, a block ``set``). A process of its
own is bounded whatever the template does: ``RLIMIT_AS`` for memory, a deadline and a kill for time
and cancellation. It costs one round trip per conversation (tens of microseconds: every render of a
conversation goes in one request), and the process is started once per collection and reused.
What the child does and how it renders: :mod:`service.engine.template_child`.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import IO, TYPE_CHECKING, Any

from service.engine.errors import CollectionCancelled
from service.engine.messages import Message, RecordError
from service.engine.template_child import HEADER

if TYPE_CHECKING:  # annotations only: a tokenizer is loaded by the caller
    from transformers import PreTrainedTokenizerBase

_POLL_S = 0.1  # how often a wait checks for cancellation
_START_TIMEOUT_S = 120.0  # the child imports transformers' renderer before it answers (seconds on a busy host)


@dataclass(frozen=True)
class TemplateLimits:
    """The bounds of one render request (every render of one conversation).

    Attributes:
        max_chars: the longest render, and the longest value a template may build with ``*``/``+``.
        memory_bytes: the render process's address space (``RLIMIT_AS``); 0: unbounded.
        timeout_s: wall-clock seconds for one conversation's renders.
    """

    max_chars: int = 32 << 20
    memory_bytes: int = 1 << 30
    timeout_s: float = 10.0


class TemplateOverBudget(RecordError):
    """A template exceeded a bound; the message names the setting."""


class TemplateProcess:
    """Renders conversations in a child process (:mod:`service.engine.template_child`).

    Use as a context manager: the child starts with the first render and is killed on exit.
    ``should_stop`` is polled while a render runs; when it returns True the child is killed and
    :class:`CollectionCancelled` raised, so a cancellation is honoured within :data:`_POLL_S`.
    """

    def __init__(self, limits: TemplateLimits, should_stop: Callable[[], bool] | None = None) -> None:
        self.limits = limits
        self.should_stop = should_stop
        self._child: subprocess.Popen[bytes] | None = None
        self._template: str | None = None  # the template the running child holds (sent once)

    def __enter__(self) -> TemplateProcess:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    def close(self) -> None:
        child, self._child = self._child, None
        if child is not None and child.poll() is None:
            child.kill()
        if child is not None:
            child.wait()
            for stream in (child.stdin, child.stdout):
                with contextlib.suppress(OSError):
                    stream.close() if stream is not None else None

    @property
    def pid(self) -> int | None:
        """The render process's pid while it runs (tests measure it)."""
        return self._child.pid if self._child is not None and self._child.poll() is None else None

    def render(
        self, tokenizer: PreTrainedTokenizerBase, messages: Sequence[Message], prefixes: Sequence[tuple[int, bool]]
    ) -> list[str]:
        """``messages[:n]`` rendered by the tokenizer's chat template for each ``(n, add_generation_prompt)``.

        Raises:
            TemplateOverBudget: a bound was passed (the message names its setting).
            RecordError: the template fails on these messages.
            CollectionCancelled: ``should_stop`` said so while the template rendered.
        """
        template = tokenizer.get_chat_template()
        child_has_it = template == self._template and self.pid is not None
        request = {
            "template": None if child_has_it else template,
            "tokens": _json_safe(tokenizer.special_tokens_map),
            "messages": [m.as_dict() for m in messages],
            "prefixes": [[n, bool(add)] for n, add in prefixes],
        }
        reply = self._ask(request)
        self._template = template if self._child is not None else None
        if "error" in reply:
            raise self._problem(reply["error"], reply["detail"])
        renders: list[str] = reply["renders"]
        return renders

    def _problem(self, kind: str, detail: str) -> RecordError:
        if kind == "size":
            return TemplateOverBudget(
                f"the chat template built more than {self.limits.max_chars} characters (ENGRAM_TEMPLATE_MAX_CHARS): {detail}"
            )
        if kind == "memory":
            self.close()  # a process that ran out of memory is not trusted with the next record
            return TemplateOverBudget(
                f"the chat template needed more than {self.limits.memory_bytes} bytes of memory "
                "(ENGRAM_TEMPLATE_MEMORY_BYTES)"
            )
        return RecordError(f"the chat template cannot render this conversation: {detail}")

    def _ask(self, request: dict[str, Any]) -> dict[str, Any]:
        child = self._start()
        stdin, _ = _pipes(child)
        body = json.dumps(request, ensure_ascii=False).encode("utf-8")
        try:
            stdin.write(HEADER.pack(len(body)) + body)
            stdin.flush()
        except (BrokenPipeError, OSError):
            return self._died()
        return self._read(child, time.monotonic() + self.limits.timeout_s, "timeout")

    def _start(self) -> subprocess.Popen[bytes]:
        if self._child is not None and self._child.poll() is None:
            return self._child
        self._child = child = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "service.engine.template_child",
                str(self.limits.max_chars),
                str(self.limits.memory_bytes),
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=_child_env(),
        )
        self._read(child, time.monotonic() + _START_TIMEOUT_S, "start")
        return child

    def _read(self, child: subprocess.Popen[bytes], deadline: float, waiting_for: str) -> dict[str, Any]:
        """One frame from the child, polling for cancellation until ``deadline`` (then it is killed)."""
        _, stdout = _pipes(child)
        fd = stdout.fileno()
        while not select.select([fd], [], [], _POLL_S)[0]:
            if self.should_stop is not None and self.should_stop():
                self.close()
                raise CollectionCancelled("collection cancelled while a chat template rendered")
            if time.monotonic() > deadline:
                self.close()
                if waiting_for == "start":
                    raise RuntimeError("the chat template process did not start")
                raise TemplateOverBudget(
                    f"the chat template did not render this conversation within {self.limits.timeout_s:g} s "
                    "(ENGRAM_TEMPLATE_TIMEOUT_S)"
                )
        header = stdout.read(HEADER.size)
        if len(header) < HEADER.size:
            return self._died()
        reply: dict[str, Any] = json.loads(stdout.read(HEADER.unpack(header)[0]))
        return reply

    def _died(self) -> dict[str, Any]:
        code = self._child.wait() if self._child is not None else None
        self.close()
        how = f"killed by signal {-code}" if code is not None and code < 0 else f"exit code {code}"
        return {"error": "memory" if code == -9 else "render", "detail": f"the render process died ({how})"}


def _pipes(child: subprocess.Popen[bytes]) -> tuple[IO[bytes], IO[bytes]]:
    """The render process's stdin and stdout (it is started with both as pipes)."""
    if child.stdin is None or child.stdout is None:
        raise RuntimeError("the chat template process was started without its pipes")
    return child.stdin, child.stdout


def _child_env() -> dict[str, str]:
    """This environment, with the folder holding the ``service`` package first on the path (the
    child runs ``-m service.engine.template_child`` wherever the job process was started from)."""
    root = str(Path(__file__).resolve().parents[2])
    path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path, "TRANSFORMERS_VERBOSITY": "error"}


def _json_safe(value: Any) -> Any:
    """The special-tokens map as the template sees it (strings, lists of strings)."""
    if isinstance(value, dict):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value if isinstance(value, (str, int, float, bool)) or value is None else str(value)
