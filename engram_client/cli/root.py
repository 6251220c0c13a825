"""The ``engram`` command itself: the Typer app, its global options, and the client they configure.

The global options (``--url``, ``--api-key``, ``--json``, ``--timeout``) are parsed once here and
handed to every command as :class:`State` in the typer context; :func:`session` turns them into an
:class:`EngramClient` and every client error into a red message and an exit code, so that no
command has to handle errors of its own.
"""

from __future__ import annotations

import importlib.metadata
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Annotated

import typer

from engram_client.cli.output import fail, job_failed, stdout
from engram_client.client import (
    DEFAULT_URL,
    EngramAPIError,
    EngramClient,
    EngramConnectionError,
    EngramError,
    EngramJobError,
    EngramOutputExistsError,
)

# What the CLI user does about a missing or weak key (the service's words are for any HTTP client).
KEY_HINTS = {
    401: "; pass the key with --api-key or set ENGRAM_API_KEY",
    403: "; use a key with that scope (--api-key or ENGRAM_API_KEY)",
}

app = typer.Typer(
    name="engram",
    help="Make transformers models forget concepts with closed-form AI Engram edits (Engram Service client).",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


@dataclass
class State:
    """The global options, handed to every command through the typer context."""

    url: str
    api_key: str | None
    json: bool
    timeout: float


def _package_version() -> str:
    try:
        return importlib.metadata.version("engram-client")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown"


def _positive_timeout(value: float) -> float:
    """0 would fail every request as unreachable, a negative value with a traceback: refuse both here."""
    if not value > 0:
        raise typer.BadParameter(f"{value:g} is not a number of seconds above 0", param_hint="--timeout")
    return value


def _print_version(value: bool) -> None:
    if value:
        stdout.print(f"engram {_package_version()}")
        raise typer.Exit()


@app.callback()
def main(
    ctx: typer.Context,
    url: Annotated[str, typer.Option(envvar="ENGRAM_URL", help="The service's base URL.")] = DEFAULT_URL,
    api_key: Annotated[
        str | None, typer.Option(envvar="ENGRAM_API_KEY", help="API key (sent as a Bearer token).", show_default=False)
    ] = None,
    json_output: Annotated[bool, typer.Option("--json", help="Print machine-readable JSON on stdout.")] = False,
    timeout: Annotated[
        float, typer.Option(callback=_positive_timeout, help="Seconds to wait for each HTTP answer (above 0).")
    ] = 60.0,
    version: Annotated[
        bool, typer.Option("--version", callback=_print_version, is_eager=True, help="Print the version and exit.")
    ] = False,
) -> None:
    """Engram Service client: every command talks to the service at --url (ENGRAM_URL)."""
    ctx.obj = State(url=url, api_key=api_key or None, json=json_output, timeout=timeout)


@contextmanager
def session(ctx: typer.Context) -> Iterator[EngramClient]:
    """A client for the command; every client error becomes a red message on stderr and exit code 1."""
    state: State = ctx.obj
    try:
        with EngramClient(state.url, state.api_key, timeout=state.timeout) as client:
            yield client
    except EngramAPIError as exc:
        hint = KEY_HINTS.get(exc.status, "")
        fail(f"{exc.title} ({exc.status})", f"{exc.detail}{hint}")
    except EngramJobError as exc:
        job_failed(exc.job)
    except EngramConnectionError as exc:
        if exc.timed_out:
            fail("Connection error", f"{exc}; give it longer with --timeout (now {state.timeout:g} s), or check --url")
        fail("Connection error", f"{exc}; check --url or ENGRAM_URL")
    except EngramOutputExistsError as exc:
        fail("Error", f"{exc}; choose a new directory or pass --force to replace it")
    except EngramError as exc:
        fail("Error", str(exc))
    except OSError as exc:  # a local file: the dataset to upload, the download directory
        fail("Error", str(exc))
