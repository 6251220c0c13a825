"""A text calibration's default objective: its defaults and the checks of a request without an objective.

Without an objective (and without ``max_retain_nll_ratio``, which asks for the older NLL-ratio search)
a text calibration minimises ``forget_exact_match`` with ``retain_exact_match`` at least
``min_retain_exact_match_ratio`` × the base's and ``perplexity_ratio`` (on the ``general`` utility
set, else on the retain probes' answers) at most ``max_perplexity_ratio``, the NLL ratios breaking
ties, and holds out ``held_out_fraction`` (default :data:`DEFAULT_HELD_OUT_FRACTION`) of the probes
to check the choice.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field

# A text calibration with no objective (and no max_retain_nll_ratio): the lowest forget exact match with
# the retain exact match at least this share of the base's, and the perplexity ratio on general text at
# most DEFAULT_MAX_PERPLEXITY_RATIO (the ×1.10 a user notices no change under); this share of the probes
# is held out to check the choice when the request sets no held_out_fraction.
DEFAULT_RETAIN_EXACT_MATCH_RATIO = 0.9
DEFAULT_MAX_PERPLEXITY_RATIO = 1.1
DEFAULT_HELD_OUT_FRACTION = 0.2
# The utility set holding general text (plain prose, as prompt + completion): the perplexity bound's set.
GENERAL_SET = "general"
# A recommendation whose forget exact match stays above this share of the base's is warned about.
WARN_FORGET_SHARE = 0.5

# The request's and the result's fields of the default objective (their home, api_schemas.calibration, is at
# its size limit).
MIN_RETAIN_EXACT_MATCH_RATIO_FIELD: Any = Field(
    default=DEFAULT_RETAIN_EXACT_MATCH_RATIO,
    gt=0.0,
    le=1.0,
    allow_inf_nan=False,
    description="text probes, no objective: the retain exact match at least this times the base's",
)
MAX_PERPLEXITY_RATIO_FIELD: Any = Field(
    default=DEFAULT_MAX_PERPLEXITY_RATIO,
    gt=1.0,
    le=1e6,
    allow_inf_nan=False,
    description="text probes, no objective: the perplexity on general text (utility.general; without it the "
    "retain probes' answers), variant / base, at most this",
)
WARNINGS_FIELD: Any = Field(
    default_factory=list,
    description="what the user should know before shipping the recommendation: forget exact match (accuracy) left "
    f"above {WARN_FORGET_SHARE} x the base's, a search that never went past the smallest alpha, a bound broken on "
    "the held-out probes, no held-out check, retain probes that are the universe's own records",
)
RETAIN_PROBES_IN_REFERENCE_FIELD: Any = Field(
    default=None,
    exclude_if=lambda v: v is None,
    description="text probes: reference concept -> the retain probes that are its records (the edit is built to spare "
    "them, so a retain floor measured on them is optimistic; a warning says so); absent when no retain probe is one",
)
TRUNCATED_PROBES_FIELD: Any = Field(
    default=None,
    exclude_if=lambda v: v is None,
    description="probe set -> probes whose prompt was cut on the left to fit what the model reads (the smaller "
    "of its context and ENGRAM_MAX_LENGTH tokens; held-out probes count in their set), as evaluate's; absent "
    "when none was",
)
PERPLEXITY_ON_FIELD: Any = Field(
    default=None,
    exclude_if=lambda v: v is None,
    description="the exact-match default objective: the probes perplexity_ratio is measured on (utility.general, "
    "or the retain probes' answers when none was given)",
)


def check_default_objective(request: Any) -> None:
    """A text request without an objective: the options it may set for the default objective (or for
    the older NLL-ratio search, with ``max_retain_nll_ratio``).

    Raises:
        ValueError: an option that serves neither, naming it.
    """
    if "max_retain_nll_ratio" in request.model_fields_set:  # the older NLL-ratio search
        newer = ("utility", "held_out_fraction", "min_retain_exact_match_ratio", "max_perplexity_ratio")
        given = [name for name in newer if name in request.model_fields_set and getattr(request, name)]
        if given:
            raise ValueError(
                f"{', '.join(given)} serve the exact-match default objective, which max_retain_nll_ratio "
                "replaces by the NLL-ratio search: leave out max_retain_nll_ratio"
            )
        return
    other = sorted(set(request.utility) - {GENERAL_SET})
    if other:
        raise ValueError(
            f"utility sets {other}: without an objective the only utility set is {GENERAL_SET!r} (general text, "
            "the perplexity bound's); name an objective to score others"
        )
    if request.held_out_fraction is not None and (len(request.forget) < 2 or len(request.retain) < 2):
        raise ValueError("held_out_fraction needs two forget and two retain probes (one searched, one held out)")


def check_no_default_bounds(request: Any) -> None:
    """A request with an objective sets none of the default objective's bounds (constraints say them)."""
    given = [n for n in ("min_retain_exact_match_ratio", "max_perplexity_ratio") if n in request.model_fields_set]
    if given:
        raise ValueError(f"{', '.join(given)} bound the default objective; with an objective use constraints")
