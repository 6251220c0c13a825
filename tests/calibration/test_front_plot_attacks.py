"""The front PNG draws the attack gate (issue 37): an attacked candidate's scores are metrics named
``<attack>.<metric>`` (``?y=quantize:Q4_1.forget_exact_match``), and the gate's bound is a line."""

from __future__ import annotations

from typing import Any

import numpy as np

from service.calibration.plot import candidate_values, front_figure, plottable_metrics

Q4_FORGET = "quantize:Q4_1.forget_exact_match"


def candidate(retain: float, forget: float, attacked: float | None) -> dict[str, Any]:
    row: dict[str, Any] = {
        "options": {"module_set": "all", "scaling": "uniform", "alpha": 1.0, "layers": None},
        "retain": {"exact_match": retain},
        "forget": {"exact_match": forget},
        "pareto": False,
    }
    if attacked is not None:
        row["attacked"] = {"quantize:Q4_1": {"forget_exact_match": attacked, "retain_exact_match": None}}
    return row


def test_attacked_scores_are_plottable_metrics_and_the_gate_bound_is_drawn() -> None:
    rows = [candidate(1.0, 0.9, None), candidate(0.9, 0.2, 0.4), candidate(0.8, 0.1, 0.2)]
    gate = {"constraints": [{"attack": "quantize:Q4_1", "metric": "forget_exact_match", "max": 0.25, "base": 1.0}]}
    result = {"model_id": "m", "concepts": ["c"], "evaluations": 3, "candidates": rows, "recommended": None}
    result["attack_gate"] = gate
    assert candidate_values(rows[1])[Q4_FORGET] == 0.4
    assert "quantize:Q4_1.retain_exact_match" not in candidate_values(rows[1])  # null: not measured, not drawn
    assert Q4_FORGET in plottable_metrics(result)
    ax = front_figure(result, "retain_exact_match", Q4_FORGET).axes[0]
    labels = [line.get_label() for line in ax.get_lines()]
    assert f"max {Q4_FORGET} 0.25" in labels
    drawn = sorted(float(y) for collection in ax.collections for y in np.asarray(collection.get_offsets())[:, 1])
    assert drawn == [0.2, 0.4]  # the two attacked candidates only
