"""``engram evaluate --attack``: attacks on a variant's forgetting, written on the command line, and
their table.

An attack is ``quantize:TYPE`` (Q8_0, Q4_0, Q4_1, int8, nf4), ``relearn`` or
``relearn:steps=10,lr=2e-5,seed=0,train_probes=5``, or ``rephrase:FORM`` (chat_template,
no_template, paraphrased); the service checks the values and names what it refuses.
"""

from __future__ import annotations

from typing import Any

import typer

from api_schemas.evaluation import EvaluationResult
from engram_client.cli.output import stdout
from engram_client.cli.render import numeric_table

_RELEARN_FIELDS = {"steps": int, "lr": float, "seed": int, "train_probes": int}


def parse_attack(text: str) -> dict[str, Any]:
    """The request's attack for ``text`` (the module docstring's forms).

    Raises:
        typer.BadParameter: an unknown kind, or a relearn field that is not one or not a number.
    """
    kind, _, rest = text.strip().partition(":")
    if kind == "quantize" and rest:
        return {"kind": "quantize", "type": rest}
    if kind == "rephrase" and rest:
        return {"kind": "rephrase", "form": rest}
    if kind == "relearn":
        attack: dict[str, Any] = {"kind": "relearn"}
        for item in filter(None, rest.split(",")):
            name, _, value = item.partition("=")
            if name not in _RELEARN_FIELDS:
                raise typer.BadParameter(f"relearn takes {', '.join(_RELEARN_FIELDS)}, not {name!r}", param_hint="--attack")
            try:
                attack[name] = _RELEARN_FIELDS[name](value)
            except ValueError:
                raise typer.BadParameter(f"relearn's {name}={value!r} is not a number", param_hint="--attack") from None
        return attack
    raise typer.BadParameter(
        f"{text!r}: an attack is quantize:TYPE, relearn[:steps=N,lr=X,seed=N,train_probes=N] or rephrase:FORM",
        param_hint="--attack",
    )


def render_attacks(result: EvaluationResult) -> None:
    """One row per attack and model: forget and retain exact match (before -> after the attack where
    the attack changes the model) and relearn's recovered fraction."""
    attacks = result.attacks or {}
    rows = numeric_table("attack", "model", "forget exact", "retain exact", "forget NLL", "retain NLL")
    rows.columns[1].justify = "left"
    notes = []
    for name, report in attacks.items():
        for model, splits in report.summary.items():
            cells = []
            for split in ("forget", "retain"):
                score = splits.get(split)
                cells.append(f"{score.exact_match:.1%}" if score is not None else "-")
            nll = [f"{splits[s].mean_nll:.4g}" if s in splits else "-" for s in ("forget", "retain")]
            rows.add_row(name, model, *cells, *nll)
        if report.recovered_fraction is not None:
            notes.append(f"{name}: recovered fraction {report.recovered_fraction:.1%} of what was forgotten")
        notes += [f"{name}: {key} left out: {why}" for key, why in report.left_out.items()]
    stdout.print(rows)
    for note in notes:
        stdout.print(note)
