"""The ``universe`` kind's helper, as the job table (:mod:`service.execution.kinds`) names it.

A universe build asks idle workers for help (``ctx.universe_helpers``); each helper message runs
this in a worker, through :func:`service.execution.runner.run_helper`: it claims and computes parts
(input groups, then members' engrams) nobody holds, then stops. A helper is not a job: it has no
record and its failure fails nothing (the runner logs it); whatever it could not do, because it
failed or its worker died and its lease expired, the job computes itself.
"""

from __future__ import annotations

from service.context import Context
from service.universes.build import help_build_universe


def help_universe(ctx: Context, universe_id: str, job_id: str) -> dict[str, int]:
    """Help job ``job_id`` build universe ``universe_id``.

    Returns:
        How many input groups and members this helper computed.

    Raises:
        JobCancelled: the job ended or was cancelled (checked between parts and layers).
    """
    return help_build_universe(ctx, universe_id, job_id)
