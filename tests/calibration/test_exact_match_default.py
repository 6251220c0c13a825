"""The text calibration's default objective (issue 36): the lowest forget exact match with the retain
exact match at least 0.9 × the base's and the perplexity ratio at most 1.1, the NLL ratios breaking
ties; and the warnings a result carries. On made-up candidate scores: no model runs, but for the
last test, which checks on a small random Llama that the teacher-forced exact match the calibration
scores by is the greedy answer's.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
import typer
from transformers import LlamaForCausalLM

from api_schemas import CalibrateRequest
from api_schemas.calibration import CalibrationResult, HeldOutCheck
from engram_client.cli.calibration import cost_estimate, general_probes
from engram_fixtures.demo import tiny_llama_config, train_tokenizer
from service.calibration.goal import exact_match_goal_spec, goal_spec
from service.calibration.goal_run import margins
from service.calibration.goal_scoring import own_metrics
from service.calibration.goal_search import GoalSettings, goal_search, recommend_for_goal
from service.calibration.search import Arm, Candidate, Outcome
from service.calibration.warnings import result_warnings
from service.engine.evaluate import TextProbe as Probe
from service.engine.evaluate import greedy_exact_match, greedy_tokens
from service.engine.teacher_forced import nll_and_exact_match

PAIR = {"prompt": "Q: a? A:", "completion": " b"}
BASE = {"forget_exact_match": 1.0, "retain_exact_match": 1.0, "perplexity_ratio": 1.0}


def request(**changes: Any) -> CalibrateRequest:
    return CalibrateRequest(**{"concepts": ["c"], "forget": [PAIR, PAIR], "retain": [PAIR, PAIR], **changes})


def test_a_request_without_objective_minimises_forget_exact_match_under_the_retain_floor_and_perplexity() -> None:
    spec = goal_spec(request(), None)
    assert spec is not None and spec.kind == "exact_match"
    assert (spec.objective, spec.sense, spec.held_out_fraction) == ("forget_exact_match", "minimize", 0.2)
    goal = spec.goal(BASE)
    bounds = {b.metric: (b.min, b.max) for b in goal.bounds}
    assert bounds == {"retain_exact_match": (0.9, None), "perplexity_ratio": (None, 1.1)}
    tighter = exact_match_goal_spec(request(min_retain_exact_match_ratio=0.5, max_perplexity_ratio=1.3))
    assert {b.metric: (b.min, b.max) for b in tighter.goal({**BASE, "retain_exact_match": 0.8}).bounds} == {
        "retain_exact_match": (0.4, None),
        "perplexity_ratio": (None, 1.3),
    }


def test_an_explicit_max_retain_nll_ratio_keeps_the_nll_ratio_search() -> None:
    assert goal_spec(request(max_retain_nll_ratio=2.0), None) is None
    with pytest.raises(ValueError, match="max_perplexity_ratio serve the exact-match default objective"):
        request(max_retain_nll_ratio=2.0, max_perplexity_ratio=1.2)
    with pytest.raises(ValueError, match="only utility set is 'general'"):
        request(utility={"world": [PAIR]})
    with pytest.raises(ValueError, match="with an objective use constraints"):
        request(objective={"minimize": "forget_exact_match"}, max_perplexity_ratio=1.2)


def _metrics(alpha: float) -> dict[str, float]:
    """A made-up edit: forget answers fall fast with α, retain answers and perplexity later."""
    return {
        "forget_exact_match": max(0.0, 1.0 - alpha),  # 0 from α = 1
        "retain_exact_match": 1.0 if alpha <= 1.5 else 0.5,
        "perplexity_ratio": 1.0 + 0.05 * alpha,  # ≤ 1.1 up to α = 2
        "forget_nll_ratio": 1.0 + alpha,
        "retain_nll_ratio": 1.0 + 0.01 * alpha,
    }


def test_the_default_goal_recommends_the_lowest_forget_exact_match_within_both_bounds() -> None:
    goal = exact_match_goal_spec(request()).goal(BASE)
    arms = [Arm("all", None, None, "uniform")]
    found = goal_search(arms, lambda arm, alpha: _metrics(alpha), goal, GoalSettings(budget=20, alpha_min=0.05, alpha_max=4))
    best = recommend_for_goal(goal, found.candidates)
    assert best is not None
    assert best.metrics["forget_exact_match"] == 0.0
    # forget EM ties at 0 from α = 1 to the retain floor at α = 1.5: the higher forget NLL ratio wins,
    # so the search closes on the floor, not on the gentlest α that reaches 0
    assert 1.3 < best.alpha <= 1.5
    assert all(c.alpha > 1.5 for c in found.candidates if not c.feasible)


def candidate(i: int, alpha: float, **metrics: float) -> Candidate:
    outcome = Outcome(metrics.get("forget_nll_ratio", math.nan), metrics.get("retain_nll_ratio", math.nan))
    return Candidate(i, Arm("all", None, None, "uniform"), alpha, outcome, True, "coarse", metrics)


def test_ties_on_forget_exact_match_go_to_the_higher_retain_exact_match_then_the_nll_ratios() -> None:
    goal = exact_match_goal_spec(request()).goal(BASE)
    common = {"retain_exact_match": 1.0, "perplexity_ratio": 1.0}
    rows = [
        candidate(0, 0.5, forget_exact_match=0.25, forget_nll_ratio=9.0, retain_nll_ratio=1.0, **common),
        candidate(1, 1.0, forget_exact_match=0.0, forget_nll_ratio=3.0, retain_nll_ratio=1.2, **common),
        candidate(2, 2.0, forget_exact_match=0.0, forget_nll_ratio=3.0, retain_nll_ratio=1.1, **common),
        candidate(3, 0.7, forget_exact_match=0.0, forget_nll_ratio=2.0, retain_nll_ratio=1.0, **common),
        candidate(4, 3.0, forget_exact_match=0.0, forget_nll_ratio=9.0, retain_nll_ratio=1.3, perplexity_ratio=1.0,
                  retain_exact_match=0.9),
    ]  # fmt: skip
    best = recommend_for_goal(goal, rows)
    # EM 0 beats 0.25 whatever its ratio; then the retain EM (1.0 beats 0.9); then ×3 > ×2; then 1.1 < 1.2
    assert best is not None and best.index == 2


def test_perplexity_is_on_general_text_when_given_else_on_the_retain_answers() -> None:
    def split(nll: float) -> dict[str, float]:
        return {"mean_nll": nll, "exact_match": 1.0, "n": 2}

    base = {"forget": split(1.0), "retain": split(1.0), "general": split(3.0)}
    edited = {"forget": split(2.0), "retain": split(1.5), "general": split(3.1)}
    assert own_metrics(edited, base)["perplexity_ratio"] == pytest.approx(math.exp(0.1))
    no_general = {k: v for k, v in edited.items() if k != "general"}
    assert own_metrics(no_general, base)["perplexity_ratio"] == pytest.approx(math.exp(0.5))


def result(alphas: list[float], forget_em: float, held: HeldOutCheck | None = None) -> CalibrationResult:
    def row(i: int, alpha: float) -> dict[str, Any]:
        options = {"alpha": alpha, "scaling": "uniform", "module_set": "all", "modules": None, "layers": None}
        scores = {"mean_nll": 1.0, "n": 4, "nll_ratio": 1.0}
        return {
            "index": i,
            "options": options,
            "forget": {**scores, "exact_match": forget_em},
            "retain": {**scores, "exact_match": 1.0},
            "feasible": True,
            "pareto": True,
            "stage": "coarse",
        }

    rows = [row(i, a) for i, a in enumerate(alphas)]
    base = {"mean_nll": 1.0, "exact_match": 1.0, "n": 4}
    recommended = {
        "candidate": len(rows) - 1,
        "options": rows[-1]["options"],
        "forget_nll_ratio": 1.0,
        "retain_nll_ratio": 1.0,
        "variant_id": "v" * 32,
        "format": "checkpoint",
    }
    return CalibrationResult.model_validate(
        {
            "calibration_id": "c" * 32,
            "model_id": "m",
            "concepts": ["c"],
            "universe_id": "u" * 32,
            "reference": [],
            "constraint": {},
            "base": {"forget": base, "retain": base},
            "candidates": rows,
            "pareto_front": [],
            "recommended": recommended,
            "evaluations": len(rows),
            "budget": len(rows),
            "stopped": "budget",
            "arms": ["all/uniform"],
            "pruned_arms": [],
            "unexplored_arms": [],
            "skipped_module_sets": [],
            "alpha_range": [0.05, 4.0],
            "grid_equivalent": 10,
            "front_png": "/x",
            "held_out": held.model_dump() if held is not None else None,
        }
    )


def held_check(feasible: bool, forget_em: float) -> HeldOutCheck:
    values: dict[str, float | None] = {"forget_exact_match": forget_em, "retain_exact_match": 0.8}
    values["perplexity_ratio"] = 1.02
    base: dict[str, float | None] = {**BASE}
    goal = exact_match_goal_spec(request()).goal(BASE)
    return HeldOutCheck(
        probes={"forget": 2, "retain": 2},
        candidate=0,
        rejected=[0, 1] if not feasible else [],
        margins=margins(goal, {k: v for k, v in values.items() if v is not None}),
        constraints=[],
        feasible=feasible,
        base=base,
        recommended=values,
    )


def test_a_recommendation_that_barely_forgets_or_never_left_the_smallest_alpha_is_warned_about() -> None:
    spec = exact_match_goal_spec(request())
    quiet = result([0.05, 1.0], forget_em=0.25, held=held_check(True, 0.0))
    assert result_warnings(quiet, spec) == []
    kept = result_warnings(result([0.05, 1.0], forget_em=0.75, held=held_check(True, 0.6)), spec)
    assert len(kept) == 2 and "75%" in kept[0] and "forget probes" in kept[0] and "held-out forget" in kept[1]
    stuck = result_warnings(result([0.05, 0.05], forget_em=0.25, held=held_check(True, 0.0)), spec)
    assert len(stuck) == 1 and "never went past the smallest alpha (0.05)" in stuck[0]
    smallest = result_warnings(result([1.0, 0.05], forget_em=0.25, held=held_check(True, 0.0)), spec)
    assert len(smallest) == 1 and "is the smallest alpha searched" in smallest[0]


def test_a_bound_broken_on_held_out_probes_is_named_with_its_margin_and_no_held_out_check_is_warned() -> None:
    spec = exact_match_goal_spec(request())
    broken = result_warnings(result([0.05, 1.0], forget_em=0.0, held=held_check(False, 0.0)), spec)
    assert len(broken) == 1 and "min_retain_exact_match by 0.1" in broken[0], broken
    unchecked = result_warnings(result([0.05, 1.0], forget_em=0.0), spec)
    assert len(unchecked) == 1 and "no probes were held out" in unchecked[0]


def test_teacher_forced_exact_match_is_the_greedy_answer_s_exact_match() -> None:
    torch.manual_seed(0)
    words = ["alpha beta gamma delta", "one two three four five", "red green blue"] * 20
    tokenizer = train_tokenizer(words, vocab_size=300)
    model = LlamaForCausalLM(tiny_llama_config(len(tokenizer), hidden=32, layers=2, heads=2, intermediate=64)).eval()
    prompts = ["alpha beta", "one two", "red", "three four", "green blue"]
    probes: list[Probe] = []
    for prompt in prompts:
        ids = tokenizer(prompt)["input_ids"]
        answer = greedy_tokens(model, tokenizer, [Probe(prompt, " x y z", ids=(ids, [0, 0, 0]))])[0]
        probes.append(Probe(prompt, "-", ids=(ids, answer)))  # the model's own greedy answer
        wrong = [answer[0], (answer[1] + 1) % len(tokenizer), answer[2]]
        probes.append(Probe(prompt, "-", ids=(ids, wrong)))  # its second token is not the model's
    nll, teacher = nll_and_exact_match(model, tokenizer, probes)
    assert teacher == greedy_exact_match(model, tokenizer, probes)
    assert teacher == [True, False] * len(prompts)
    assert all(math.isfinite(x) for x in nll)


def test_the_cli_estimates_the_cost_by_its_stated_rule_and_reads_general_text(tmp_path: Path) -> None:
    # 40 probes, 20% held out: 32 searched by 12 candidates and the base, 8 held out checked up to 5 times
    assert "about 456 probe passes" in cost_estimate(12, 40, 0.2)
    assert "about 520 probe passes" in cost_estimate(12, 40, None)
    text = tmp_path / "general.txt"
    text.write_text("The river rose in spring.\n\n  Bread is baked at dawn  \n")
    assert general_probes(text) == [
        {"prompt": "The", "completion": " river rose in spring."},
        {"prompt": "Bread", "completion": " is baked at dawn"},
    ]
    text.write_text("Alone\n")
    with pytest.raises(typer.BadParameter, match="at least two words"):
        general_probes(text)


def test_a_base_that_answers_no_probe_exactly_gets_a_floor_of_zero_and_a_warning() -> None:
    spec = exact_match_goal_spec(request())
    goal = spec.goal({**BASE, "retain_exact_match": 0.0, "forget_exact_match": 0.0})  # no JobFailed
    assert {b.metric: b.min for b in goal.bounds}["retain_exact_match"] == 0.0
    blind = result([0.05, 1.0], forget_em=0.0, held=held_check(True, 0.0))
    unknown = blind.base["forget"].model_copy(update={"exact_match": 0.0})
    blind = blind.model_copy(update={"base": {**blind.base, "forget": unknown}})
    warned = result_warnings(blind, spec)
    assert len(warned) == 1 and "answers none of the forget probes exactly" in warned[0]
