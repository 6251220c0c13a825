"""Attacks an evaluation may run on a variant (issue 37): does the forgetting survive a platform's
quantization, a few fine-tuning steps on related data, or the same questions asked another way?

Each attack is applied to the variant and, for comparison, to its base model and (with
``retain_model``) the retain model; every metric the request asks for is reported per attack,
keyed by the attack's stable name (:func:`attack_name`: ``quantize:Q4_1``, ``relearn``,
``rephrase:no_template``). The reports are :class:`api_schemas.evaluation.AttackReport`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, Any, Literal

from pydantic import Field, StrictInt, model_validator
from pydantic.json_schema import SkipJsonSchema

from api_schemas.common import Strict

# The gguf package's (0.19.0) quantizers that llama.cpp users pick for a whole model, and the torch
# roundings bitsandbytes applies on GPUs (LLM.int8's per-row absmax int8, 4-bit NF4 in blocks of 64).
GGUF_QUANT_TYPES = ("Q8_0", "Q4_0", "Q4_1")
# Relearning trains on every row at once (one batch a step: the plainest loop, which a test can write
# again): a "small set", so that its activations stay a small multiple of one evaluation batch.
MAX_RELEARN_ROWS = 256
TORCH_QUANT_TYPES = ("int8", "nf4")
QuantType = Literal["Q8_0", "Q4_0", "Q4_1", "int8", "nf4"]
RephraseForm = Literal["chat_template", "no_template", "paraphrased"]


# What an attacked model is measured on: per split greedy exact match and mean answer NLL, and
# relearn's recovered fraction of what was forgotten (a calibration's attack gate bounds the same).
AttackMetric = Literal[
    "forget_exact_match", "retain_exact_match", "forget_mean_nll", "retain_mean_nll", "recovered_fraction"
]
_Bound = Annotated[float, Field(allow_inf_nan=False, ge=-1e12, le=1e12)]


class AttackThreshold(Strict):
    """A bound the variant meets after the attack, on the probes the attack scores."""

    metric: AttackMetric = Field(description="recovered_fraction: relearn only")
    # The bounds sit on the float (inside _Bound): on the optional type they would be compared with a null.
    min: _Bound | SkipJsonSchema[None] = Field(default=None, description="the value at least this")
    max: _Bound | SkipJsonSchema[None] = Field(default=None, description="the value at most this")

    @model_validator(mode="after")
    def _bounded(self) -> AttackThreshold:
        if self.min is None and self.max is None:
            raise ValueError(f"the threshold on {self.metric} has no bound: min or max")
        if self.min is not None and self.max is not None and self.min > self.max:
            raise ValueError(f"the threshold on {self.metric} has min {self.min} above max {self.max}")
        return self


class _Thresholded(Strict):
    thresholds: Annotated[list[AttackThreshold], Field(min_length=1, max_length=8)] | SkipJsonSchema[None] = Field(
        default=None,
        description="evaluate: the variant passes this attack when each holds for it after the attack, on the probes "
        "the attack scores (the report's passed and margins, stored with the evaluation)",
    )


class QuantizeAttack(_Thresholded):
    """The variant's weights quantized and dequantized (a round trip), then scored."""

    kind: Literal["quantize"]
    type: QuantType = Field(
        description="Q8_0, Q4_0, Q4_1: the gguf package's quantizers on the tensors llama.cpp quantizes (every "
        "2-D weight of the decoder layers; the token embedding and output head as llama.cpp's default for the "
        "type). int8: per-output-channel absmax int8, nf4: 4-bit NormalFloat in blocks of 64 (what bitsandbytes "
        "quantizes: every Linear weight except the output head)"
    )


class RelearnAttack(_Thresholded):
    """A few AdamW steps of full fine-tuning on part of the forget set (or on related texts), then the
    rest of the forget probes scored."""

    kind: Literal["relearn"]
    steps: int = Field(default=10, ge=1, le=200, description="optimizer steps, each on the whole training set")
    lr: float = Field(default=2e-5, gt=0, le=1e-2, description="AdamW's learning rate (betas 0.9/0.999, no weight decay)")
    seed: StrictInt = Field(default=0, ge=0, le=2**31 - 1, description="torch's seed: the same seed, the same numbers")
    # The bounds sit on the int (inside Annotated): on the optional type they would be compared with a null.
    train_probes: Annotated[int, Field(ge=1, le=MAX_RELEARN_ROWS)] | SkipJsonSchema[None] = Field(
        default=None,
        description="train on the first train_probes forget probes (their answers) and score the rest; default: "
        f"the first half (rounded down), at most {MAX_RELEARN_ROWS}. Not with texts",
    )
    texts: (
        Annotated[list[Annotated[str, Field(min_length=1, max_length=20000)]], Field(min_length=1, max_length=64)]
        | (SkipJsonSchema[None])
    ) = Field(default=None, description="related texts to train on (every token) instead; then every forget probe is scored")


class ParaphrasedProbe(Strict):
    """A forget probe asked in other words."""

    prompt: str = Field(min_length=1, max_length=20000)
    completion: str = Field(min_length=1, max_length=20000)


class RephraseAttack(_Thresholded):
    """The forget and retain probes asked another way, on the unchanged models."""

    kind: Literal["rephrase"]
    form: RephraseForm = Field(
        description="chat_template: prompt/completion probes as a user turn and the assistant's answer through the "
        "model's chat template; no_template: chat probes as plain text (the turns' contents, one a line); "
        "paraphrased: the probes given here (or, without them, each forget probe with its paraphrased_answer)"
    )
    probes: Annotated[list[ParaphrasedProbe], Field(min_length=1, max_length=10000)] | SkipJsonSchema[None] = Field(
        default=None, description="paraphrased: the forget probes in other words (scored instead of the forget set)"
    )


Attack = Annotated[QuantizeAttack | RelearnAttack | RephraseAttack, Field(discriminator="kind")]


def attack_name(attack: QuantizeAttack | RelearnAttack | RephraseAttack) -> str:
    """The attack's stable key in a result: ``quantize:<type>``, ``relearn``, ``rephrase:<form>``."""
    if isinstance(attack, QuantizeAttack):
        return f"quantize:{attack.type}"
    if isinstance(attack, RephraseAttack):
        return f"rephrase:{attack.form}"
    return "relearn"


def check_attacks(attacks: Sequence[QuantizeAttack | RelearnAttack | RephraseAttack], forget: Sequence[Any]) -> None:
    """Refuse attacks that cannot apply to the request's forget probes (text probes: ``prompt``,
    ``messages``, ``paraphrased_answer`` read by attribute).

    Raises:
        ValueError: naming the attack and what to change.
    """
    names = [attack_name(a) for a in attacks]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ValueError(f"attacks {twice} are named twice: each attack once per request")
    for attack, name in zip(attacks, names, strict=True):
        if not forget:
            raise ValueError(f"attack {name} needs forget probes: attacks measure whether the forgetting holds")
        recovered = any(t.metric == "recovered_fraction" for t in attack.thresholds or [])
        if recovered and not isinstance(attack, RelearnAttack):
            raise ValueError(f"attack {name}: recovered_fraction is relearn's; bound forget_exact_match instead")
        if isinstance(attack, RelearnAttack):
            _check_relearn(attack, len(forget))
        if isinstance(attack, RephraseAttack):
            _check_rephrase(attack, forget)


def relearn_rows(attack: RelearnAttack, n_forget: int) -> int:
    """The forget probes relearning trains on: ``train_probes``, else half of them (at most
    :data:`MAX_RELEARN_ROWS`)."""
    return attack.train_probes if attack.train_probes is not None else min(n_forget // 2, MAX_RELEARN_ROWS)


def _check_relearn(attack: RelearnAttack, n_forget: int) -> None:
    if attack.texts is not None:
        if attack.train_probes is not None:
            raise ValueError("attack relearn: give train_probes or texts, not both")
        return
    train = relearn_rows(attack, n_forget)
    if train < 1 or train >= n_forget:
        raise ValueError(
            f"attack relearn trains on {train} of {n_forget} forget probes and scores the rest: it needs at least "
            "one of each (send 2 or more forget probes, set train_probes below their count, or send texts)"
        )


def _check_rephrase(attack: RephraseAttack, forget: Sequence[Any]) -> None:
    where = f"attack rephrase:{attack.form}"
    if attack.probes is not None and attack.form != "paraphrased":
        raise ValueError(f"{where}: probes are for the paraphrased form only")
    if attack.form == "chat_template" and not any(getattr(p, "prompt", None) is not None for p in forget):
        raise ValueError(f"{where}: every forget probe is a chat probe already; send prompt/completion probes")
    if attack.form == "no_template" and not any(getattr(p, "messages", None) is not None for p in forget):
        raise ValueError(f"{where}: no forget probe is a chat probe (prompt/completion probes have no template)")
    if attack.form == "paraphrased" and attack.probes is None:
        missing = [i for i, p in enumerate(forget) if getattr(p, "paraphrased_answer", None) is None]
        if missing:
            raise ValueError(
                f"{where}: forget probes {missing[:10]} have no paraphrased_answer; give them one, or send the "
                "paraphrased probes in the attack's probes"
            )
