"""An objective's metrics for one loaded model: TOFU's suite and the calibration's own ratios.

The TOFU values come from the functions ``evaluate`` runs (:func:`service.engine.tofu_scoring.tofu_statistics`,
then :func:`service.evaluation.tofu_metrics.model_report` and :func:`~service.evaluation.tofu_metrics.tofu_scores`
against the retain model's and the base model's reports on the same probes), so a candidate's
``overall`` is the number ``evaluate`` gives its built variant on these probes. The calibration's own
metrics (``forget_nll_ratio`` …) are computed from the NLL summaries as the NLL-ratio search's.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from api_schemas.calibration_default import GENERAL_SET
from service.calibration.candidates import ratio
from service.engine.chat import RenderedOnce, Renderer
from service.engine.probe_bound import ProbeBound
from service.engine.tofu_scoring import TofuProbe, tofu_statistics
from service.evaluation import tofu_metrics as tm
from service.evaluation.run import encoded_sets

OWN_SETS = ("forget", "retain", "holdout")  # the rest of a probe-set mapping are utility sets
BATCH = 16


def prime(
    tokenizer: Any, sets: Mapping[str, Sequence[TofuProbe]], renderer: RenderedOnce, bound: ProbeBound | None = None
) -> dict[str, list[TofuProbe]]:
    """Every answer of every probe tokenized once, within ``bound`` (evaluate's rule: the prompt cut
    on the left, an answer past it refused), rendering chat templates into ``renderer``; an answer
    that cannot be scored fails the job naming it. Returns the sets with their token IDs."""
    return encoded_sets(tokenizer, {name: list(items) for name, items in sets.items()}, renderer, bound)


def tofu_report(model: Any, tokenizer: Any, sets: Mapping[str, Sequence[TofuProbe]], renderer: Renderer) -> tm.ModelReport:
    """One model's raw TOFU values on the sets (forget, retain, holdout and utility sets by name)."""
    stats = {
        name: tofu_statistics(model, tokenizer, items, batch_size=BATCH, renderer=renderer)
        for name, items in sets.items()
        if items
    }
    utility = {name: items for name, items in stats.items() if name not in OWN_SETS}
    return tm.model_report(stats["forget"], stats.get("retain"), utility, stats.get("holdout"))


def own_metrics(summary: Mapping[str, Mapping[str, float]], base: Mapping[str, Mapping[str, float]]) -> dict[str, float]:
    """The calibration's own metrics from NLL/EM summaries (per split) and the base model's;
    ``perplexity_ratio`` on the ``general`` split when it was scored, else on the retain answers."""
    values: dict[str, float] = {}
    for split in ("forget", "retain"):
        values[f"{split}_nll_ratio"] = ratio(summary[split]["mean_nll"], base[split]["mean_nll"])
        values[f"{split}_mean_nll"] = float(summary[split]["mean_nll"])
        values[f"{split}_exact_match"] = float(summary[split]["exact_match"])
    text = GENERAL_SET if GENERAL_SET in summary and GENERAL_SET in base else "retain"
    values["perplexity_ratio"] = perplexity_ratio(summary[text]["mean_nll"], base[text]["mean_nll"])
    return values


def perplexity_ratio(edited_nll: float, base_nll: float) -> float:
    """Perplexity, edited / base: ``exp`` of the mean NLL's change (a non-finite NLL: infinitely worse)."""
    if not math.isfinite(edited_nll):
        return math.inf
    return math.exp(min(edited_nll - base_nll, 700.0))


def metrics(
    report: tm.ModelReport,
    retain: tm.ModelReport | None,
    base: tm.ModelReport,
    summary: Mapping[str, Mapping[str, float]],
    base_summary: Mapping[str, Mapping[str, float]],
) -> dict[str, float]:
    """Every metric of one model: TOFU's scores (against the retain and base reports) and the own."""
    scored = tm.tofu_scores(report, retain, base)
    return {**scored.values, **own_metrics(summary, base_summary)}


def public(values: Mapping[str, float]) -> dict[str, float | None]:
    """JSON has no infinity or NaN: a non-finite value (log10 of a p-value of 0) is null."""
    return {name: (float(v) if math.isfinite(v) else None) for name, v in sorted(values.items())}
