"""``engram evaluate --attack`` (issue 37): the command line's attack forms become the request's attacks,
a malformed one is refused naming the option, and the result's attacks are tabulated."""

from __future__ import annotations

import pytest
import typer

from api_schemas.attacks import QuantizeAttack, RelearnAttack, RephraseAttack
from api_schemas.evaluation import EvaluationResult
from engram_client.cli.attacks import parse_attack, render_attacks
from engram_client.cli.output import stdout


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("quantize:Q4_1", {"kind": "quantize", "type": "Q4_1"}),
        ("relearn", {"kind": "relearn"}),
        (
            "relearn:steps=5,lr=1e-4,seed=7,train_probes=3",
            {"kind": "relearn", "steps": 5, "lr": 1e-4, "seed": 7, "train_probes": 3},
        ),
        ("rephrase:chat_template", {"kind": "rephrase", "form": "chat_template"}),
    ],
)
def test_each_form_is_the_requests_attack(text: str, expected: dict[str, object]) -> None:
    attack = parse_attack(text)
    assert attack == expected
    model = {"quantize": QuantizeAttack, "relearn": RelearnAttack, "rephrase": RephraseAttack}[str(attack["kind"])]
    model.model_validate(attack)  # the wire contract takes it as it is


@pytest.mark.parametrize(
    ("text", "mentions"), [("quantize", "quantize:TYPE"), ("relearn:epochs=3", "epochs"), ("relearn:lr=fast", "lr")]
)
def test_a_malformed_attack_is_refused_naming_what(text: str, mentions: str) -> None:
    with pytest.raises(typer.BadParameter, match=mentions):
        parse_attack(text)


def test_the_attacks_table_shows_each_attack_and_the_recovered_fraction() -> None:
    scores = {
        "forget": {"mean_nll": 2.0, "exact_match": 0.5, "n": 4},
        "retain": {"mean_nll": 0.1, "exact_match": 1.0, "n": 4},
    }
    result = EvaluationResult.model_validate(
        {
            "variant_id": "v",
            "summary": {"base": scores, "variant": scores},
            "records": [],
            "attacks": {
                "relearn": {
                    "attack": {"kind": "relearn"},
                    "summary": {"variant": scores},
                    "recovered_fraction": 0.25,
                    "seconds": 1.0,
                },
            },
        }
    )
    with stdout.capture() as captured:
        render_attacks(result)
    text = captured.get()
    assert "relearn" in text and "50.0%" in text and "recovered fraction 25.0%" in text, text
