"""The ``engram`` command line: register models, upload concepts, unlearn, download, evaluate and map.

Results (tables, or JSON with ``--json``) go to stdout; progress, status lines and errors go to
stderr, so ``engram --json unlearn ... | jq`` works while the build is being watched. On a terminal,
progress is a rich progress bar; anywhere else (pipes, CI logs) it is one plain line per change::

    collect job 3f2a…e1 120/300 tokens (40%) running

Errors print the service's problem (title and detail) in red and exit 1; an interrupted watch exits
130 and leaves the job running. ``--url``/``ENGRAM_URL`` and ``--api-key``/``ENGRAM_API_KEY`` say
which service to talk to and how to authenticate.

This module assembles the command tree, in the order ``engram --help`` lists it; the parts are:

- :mod:`~engram_client.cli.root`: the Typer app, the global options and the client session;
- :mod:`~engram_client.cli.output`, :mod:`~engram_client.cli.render`, :mod:`~engram_client.cli.progress`:
  stdout and stderr, the tables, the progress of jobs and downloads;
- :mod:`~engram_client.cli.options`, :mod:`~engram_client.cli.files`: shared options, local files;
- one module per command or group: ``models``, ``concepts``, ``edits`` (unlearn, compose),
  ``evaluation`` (evaluate, generate, map), ``calibration``, ``jobs``, ``variants``, ``universes``,
  ``deltas`` (apply-delta: a delta variant applied to its base folder, locally), ``verify`` (a
  downloaded variant folder against its receipt, offline).
"""

from __future__ import annotations

from engram_client.cli.calibration import calibrate_command
from engram_client.cli.concepts import concepts_app
from engram_client.cli.deltas import apply_delta_command
from engram_client.cli.edits import compose, unlearn
from engram_client.cli.evaluation import engram_map, evaluate, generate
from engram_client.cli.jobs import jobs_app
from engram_client.cli.models import models_app
from engram_client.cli.root import app
from engram_client.cli.universes import universes_app
from engram_client.cli.variants import variants_app
from engram_client.cli.verify import verify_command

app.add_typer(models_app, name="models")
app.add_typer(concepts_app, name="concepts")
app.add_typer(jobs_app, name="jobs")
app.add_typer(variants_app, name="variants")
app.add_typer(universes_app, name="universes")
app.command()(unlearn)
app.command()(compose)
app.command()(evaluate)
app.command()(generate)
app.command("map")(engram_map)
app.command("calibrate")(calibrate_command)
app.command("apply-delta")(apply_delta_command)
app.command("verify")(verify_command)

__all__ = ["app"]
