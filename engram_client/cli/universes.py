"""``engram universes build | list | show | delete | usage``: the sets of concept statistics edits are relative to.

A universe is built once (a ``universe`` job: each input group decomposed, every member's engrams
stored); after that every variant of it is arithmetic on stored engrams. Building one makes it the
model's current universe; ``unlearn --universe ID`` pins one.
"""

from __future__ import annotations

from typing import Annotated

import typer

from engram_client.cli.options import CallbackOpt, CursorOpt, JsonFlag, LimitOpt, NoWait, RcondOpt
from engram_client.cli.output import emit, job_failed, note_next_page, stderr
from engram_client.cli.progress import watch
from engram_client.cli.render import render_universe, render_universe_usage, render_universes
from engram_client.cli.root import session

universes_app = typer.Typer(help="Build and inspect universes (what an edit is relative to).", no_args_is_help=True)


@universes_app.command("build")
def universes_build(
    ctx: typer.Context,
    model: Annotated[str, typer.Argument(help="A registered model.")],
    concept: Annotated[
        list[str] | None, typer.Option("--concept", "-c", help="A member (repeat; default: every ready concept).")
    ] = None,
    rcond: RcondOpt = None,
    callback_url: CallbackOpt = None,
    no_wait: NoWait = False,
    as_json: JsonFlag = False,
) -> None:
    """Build a universe and make it the model's current one (one already built answers at once)."""
    with session(ctx) as client:
        submission = client.create_universe(model, concept or None, rcond, callback_url)
        universe = submission.universe
        if universe.status == "ready":
            stderr.print(f"universe {universe.universe_id} is built; it is the current universe of {model}")
        elif no_wait:
            hint = f"; engram jobs watch {submission.job.job_id}" if submission.job else ""
            stderr.print(f"universe {universe.universe_id}: {universe.status}{hint}")
        else:
            stderr.print(f"building universe {universe.universe_id}")
            if submission.job is not None:
                job = watch(client, [submission.job.job_id])[0]
                if job.status != "succeeded":
                    job_failed(job)
            universe = client.get_universe(universe.universe_id)
    emit(ctx, as_json, universe, lambda: render_universe(universe))


@universes_app.command("list")
def universes_list(
    ctx: typer.Context,
    model: Annotated[str, typer.Argument(help="A registered model.")],
    limit: LimitOpt = None,
    cursor: CursorOpt = None,
    as_json: JsonFlag = False,
) -> None:
    """A model's universes, oldest first; the current one (what requests use) is marked (every page
    unless --limit/--cursor)."""
    with session(ctx) as client:
        universes = client.list_universes(model, limit=limit, cursor=cursor)
    emit(ctx, as_json, universes, lambda: render_universes(universes))
    note_next_page(universes.next_cursor)


@universes_app.command("show")
def universes_show(ctx: typer.Context, universe_id: str, as_json: JsonFlag = False) -> None:
    """A universe: members, status, input groups decomposed, bytes, last use."""
    with session(ctx) as client:
        universe = client.get_universe(universe_id)
    emit(ctx, as_json, universe, lambda: render_universe(universe))


@universes_app.command("delete")
def universes_delete(ctx: typer.Context, universe_id: str) -> None:
    """Delete a universe and its stored factors and engrams (an admin key; variants built from it stay)."""
    with session(ctx) as client:
        client.delete_universe(universe_id)
    stderr.print(f"deleted universe {universe_id}")


@universes_app.command("usage")
def universes_usage(
    ctx: typer.Context,
    model: Annotated[str | None, typer.Option("--model", "-m", help="Only this model's universes.")] = None,
    as_json: JsonFlag = False,
) -> None:
    """Bytes the universes store, against the service's budget (ENGRAM_UNIVERSE_BYTES_BUDGET)."""
    with session(ctx) as client:
        usage = client.universe_usage(model)
    emit(ctx, as_json, usage, lambda: render_universe_usage(usage))
