"""The chat-template render process: renders conversations with transformers' own renderer, bounded.

A chat template is a program from the model folder (``chat_template.jinja``, ``chat_template.json``,
``tokenizer_config.json``), run by jinja's sandbox, which stops escapes but bounds neither time nor
memory: ``{% for i in range(100000) %}{% for j in range(100000) %}`` runs for hours and
``{{ 'a' * 1500000000 }}`` takes gigabytes, and no sandbox hook can interrupt a loop or cap every way
a template can build a string (``~``, ``center``, ``format``, block ``set``). So templates are
rendered here, in a process of their own that :class:`service.engine.template_render.TemplateProcess`
starts, watches and kills:

- memory: ``RLIMIT_AS`` (``ENGRAM_TEMPLATE_MEMORY_BYTES``) makes an allocation past the bound a
  ``MemoryError`` here, never an out-of-memory kill of the job process;
- time and cancellation: the parent waits with a deadline (``ENGRAM_TEMPLATE_TIMEOUT_S``) and polls
  for cancellation, and kills this process when either comes first;
- size: ``*``, ``**`` and ``+`` are checked before they compute (``'a' * N`` is refused without
  allocating), and a render longer than ``ENGRAM_TEMPLATE_MAX_CHARS`` is refused.

Rendering is transformers' ``render_jinja_template`` (the function ``apply_chat_template`` calls),
with its environment class replaced by the bounded one below, so a render is the same string
``apply_chat_template(tokenize=False)`` gives. The process dies with its parent (``PR_SET_PDEATHSIG``).

Protocol, on stdin/stdout: frames of an 8-byte big-endian length and UTF-8 JSON. A request is
``{"template", "tokens", "messages", "prefixes": [[n, add_generation_prompt], …]}`` (``template``
null: the previous request's); the answer is
``{"renders": [str, …]}`` or ``{"error": "render" | "size" | "memory", "detail": str}``.
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import signal
import struct
import sys
from typing import IO, Any

HEADER = struct.Struct(">Q")
MAX_POWER_BITS = 4096  # an integer power past this many bits is no template's business


class TooLarge(Exception):
    """A render, or a value a template builds, over ``ENGRAM_TEMPLATE_MAX_CHARS``."""


def bounded_environment(max_chars: int) -> type:
    """transformers' environment class (jinja's immutable sandbox) with ``*``, ``**`` and ``+``
    checked before they compute."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class BoundedSandbox(ImmutableSandboxedEnvironment):
        intercepted_binops = frozenset({"*", "**", "+"})

        def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
            _check_binop(operator, left, right, max_chars)
            return super().call_binop(context, operator, left, right)

    return BoundedSandbox


def _check_binop(operator: str, left: Any, right: Any, max_chars: int) -> None:
    sized = (str, list, tuple)
    if operator == "*":
        for seq, times in ((left, right), (right, left)):
            if isinstance(seq, sized) and isinstance(times, int) and len(seq) * max(times, 0) > max_chars:
                raise TooLarge(f"the template repeats a value of length {len(seq)} {times} times")
    elif operator == "+":
        if isinstance(left, sized) and isinstance(right, sized) and len(left) + len(right) > max_chars:
            raise TooLarge(f"the template joins values of length {len(left)} and {len(right)}")
    elif (
        isinstance(left, int)
        and isinstance(right, int)
        and right > 0
        and abs(left) > 1
        and right * abs(left).bit_length() > MAX_POWER_BITS
    ):
        raise TooLarge(f"the template raises an integer to the power {right}")


def render(request: dict[str, Any], max_chars: int) -> list[str]:
    """Each prefix of the request's conversation rendered as ``apply_chat_template`` renders it."""
    from transformers.utils.chat_template_utils import render_jinja_template

    messages = request["messages"]
    renders = []
    for count, add_generation_prompt in request["prefixes"]:
        rendered: Any = render_jinja_template(
            conversations=[messages[:count]],
            chat_template=request["template"],
            add_generation_prompt=bool(add_generation_prompt),
            **request["tokens"],
        )[0][0]
        if len(rendered) > max_chars:
            raise TooLarge(f"the template rendered {len(rendered)} characters")
        renders.append(str(rendered))
    return renders


def answer(request: dict[str, Any], max_chars: int) -> dict[str, Any]:
    try:
        return {"renders": render(request, max_chars)}
    except TooLarge as exc:
        return {"error": "size", "detail": str(exc)}
    except MemoryError:
        return {"error": "memory", "detail": "the template needed more memory than allowed"}
    except RecursionError:
        return {"error": "render", "detail": "RecursionError: the template recursed too deeply"}
    except Exception as exc:  # jinja's TemplateError, raise_exception() inside the template, ...
        return {"error": "render", "detail": f"{type(exc).__name__}: {exc}"}


def read_frame(stream: IO[bytes]) -> Any:
    header = stream.read(HEADER.size)
    if len(header) < HEADER.size:
        return None
    return json.loads(stream.read(HEADER.unpack(header)[0]))


def write_frame(stream: IO[bytes], value: Any) -> None:
    body = json.dumps(value, ensure_ascii=False).encode("utf-8", "surrogatepass")
    stream.write(HEADER.pack(len(body)) + body)
    stream.flush()


def _die_with_parent() -> None:
    parent = os.getppid()
    with contextlib.suppress(Exception):  # Linux only; elsewhere the parent kills it on close
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:
        os._exit(1)


def main() -> None:
    max_chars, memory_bytes = int(sys.argv[1]), int(sys.argv[2])
    _die_with_parent()
    import transformers.utils.chat_template_utils as chat_template_utils

    # transformers compiles every template with this class (a module global); replacing it here, in
    # this process only, bounds every render without changing what a template renders.
    setattr(chat_template_utils, "ImmutableSandboxedEnvironment", bounded_environment(max_chars))  # noqa: B010
    if memory_bytes > 0:
        resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    write_frame(stdout, {"ready": True})
    template = None
    while (request := read_frame(stdin)) is not None:
        template = request["template"] = request["template"] if request["template"] is not None else template
        write_frame(stdout, answer(request, max_chars))


if __name__ == "__main__":
    main()
