"""What a calibration's result warns about: a recommendation a user would not want to ship as is.

Each warning is one sentence naming what was measured and what to change:

* the recommended variant still answers more than :data:`WARN_FORGET_SHARE` × the base's share of
  the forget probes exactly (accuracy for an image classifier), on the searched or the held-out
  probes: the edit barely forgets;
* the search never went past the smallest ``α`` (the budget ran out on the first strength of every
  arm), or every stronger candidate broke a bound and the smallest is recommended: ``α_min`` may
  well be "no change";
* the recommendation breaks a bound on the held-out probes (every better-ranked candidate did too:
  it is recommended anyway, the broken bound named with its margin);
* the default objective had too few probes to hold any out: the choice is unchecked;
* the base answers none of the forget probes exactly (the default objective): exact match cannot
  show forgetting.
"""

from __future__ import annotations

from api_schemas.calibration import CalibrationResult
from api_schemas.calibration_default import WARN_FORGET_SHARE
from service.calibration.goal import GoalSpec


def result_warnings(result: CalibrationResult, goal: GoalSpec | None) -> list[str]:
    """The warnings of ``result`` (see the module docstring), in the order a user should read them."""
    warnings: list[str] = []
    warnings += _forget_kept(result, goal)
    warnings += _smallest_alpha(result)
    warnings += _held_out(result, goal)
    return warnings


def _forget_kept(result: CalibrationResult, goal: GoalSpec | None) -> list[str]:
    rec = result.recommended
    if rec is None:
        return []
    what = "accuracy" if goal is not None and goal.kind == "image" else "exact match"
    found: list[str] = []
    base = result.base["forget"].exact_match
    if base == 0 and goal is not None and goal.kind == "exact_match":
        found.append(
            "the base model answers none of the forget probes exactly: exact match cannot show forgetting, and the "
            "NLL ratios chose the recommendation; check that the probes are facts the model knows"
        )
    kept = result.candidates[rec.candidate].forget.exact_match
    if _too_close(kept, base):
        found.append(_kept_sentence("forget probes", what, kept, base))
    held = result.held_out
    if held is not None:
        name = "forget_accuracy" if goal is not None and goal.kind == "image" else "forget_exact_match"
        held_kept, held_base = held.recommended.get(name), held.base.get(name)
        if _too_close(held_kept, held_base):
            found.append(_kept_sentence("held-out forget probes", what, held_kept, held_base))
    return found


def _too_close(kept: float | None, base: float | None) -> bool:
    return kept is not None and base is not None and base > 0 and kept > WARN_FORGET_SHARE * base


def _kept_sentence(where: str, what: str, kept: float | None, base: float | None) -> str:
    return (
        f"the recommended variant keeps {_pct(kept)} {what} on the {where} (the base: {_pct(base)}), more than "
        f"{WARN_FORGET_SHARE:g} x the base's: it barely forgets; raise alpha_max or the budget, loosen the retain or "
        "perplexity bound, or add a reference of general text to the universe so that stronger edits stay selective"
    )


def _pct(value: float | None) -> str:
    return "?" if value is None else f"{100 * value:.0f}%"


def _smallest_alpha(result: CalibrationResult) -> list[str]:
    if not result.candidates:
        return []
    smallest = result.alpha_range[0]
    if all(c.options.alpha <= smallest for c in result.candidates):
        return [
            f"the search never went past the smallest alpha ({smallest:g}): its budget of {result.budget} "
            f"candidates ended on the first strength of the {len(result.arms)} arms; raise the budget, or search "
            "fewer module_sets and scalings"
        ]
    rec = result.recommended
    if rec is not None and rec.options.alpha <= smallest:
        return [
            f"the recommendation is the smallest alpha searched ({smallest:g}), which may barely change the model: "
            "every stronger candidate broke a bound; lower alpha_min, or loosen the bounds"
        ]
    return []


def _held_out(result: CalibrationResult, goal: GoalSpec | None) -> list[str]:
    held = result.held_out
    if held is None:
        if goal is not None and goal.kind == "exact_match" and result.recommended is not None:
            return [
                "no probes were held out (forget and retain need two probes each): the recommendation was not "
                "checked on probes it was not chosen on"
            ]
        return []
    if held.feasible:
        return []
    broken = {name: margin for name, margin in held.margins.items() if margin < 0}
    named = ", ".join(f"{name} by {-margin:.3g}" for name, margin in broken.items()) or "a bound"
    tried = len(held.rejected)
    return [
        f"on the held-out probes the recommendation breaks {named}: none of the {tried} best-ranked candidates "
        "met every bound there, and the best is recommended; evaluate it before shipping, or give more probes"
    ]
