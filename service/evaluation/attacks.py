"""An evaluation's attacks (``attacks`` in the request: :mod:`api_schemas.attacks`), run in its job.

Each attack is applied to every model the evaluation scores (the base, the variant and, with
``retain_model``, the retain model), one model at a time in a copy that is dropped before the next,
and the attacked model is scored on the attack's probes (answer NLL and greedy exact match per split,
and TOFU's suite when asked) through the job's progress record:

* ``quantize:<type>``: :mod:`service.engine.attacks.quantize` on a copy; every probe scored.
* ``relearn``: :mod:`service.engine.attacks.relearn` on a copy, trained on the first
  ``train_probes`` forget probes (default half) or on ``texts``; scored on the rest of the forget
  probes and on the retain probes, with the unattacked models on the same probes and the recovered
  fraction of what was forgotten.
* ``rephrase:<form>``: the probes rendered another way (:mod:`service.engine.attacks.rephrase`),
  chat probes by the job's template process, on the unchanged models.

A copy is checked against the job's memory budget (``RLIMIT_DATA``, ENGRAM_JOB_MEMORY_BYTES) before it
is made, and refused naming the attack and the setting when it cannot fit.
"""

from __future__ import annotations

import contextlib
import math
import resource
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import TypeAdapter

from api_schemas.attacks import (
    Attack,
    AttackThreshold,
    QuantizeAttack,
    RelearnAttack,
    RephraseAttack,
    attack_name,
    relearn_rows,
)
from api_schemas.evaluation import AttackReport, ProbeSummary, Split, TofuModel, TofuReport
from service.engine.attacks.quantize import quantize_in_place, quantize_plan
from service.engine.attacks.relearn import TrainRow, probe_row, relearn_bytes, relearned, standalone_copy, text_row
from service.engine.attacks.rephrase import as_chat, as_plain, with_answer
from service.engine.chat import Renderer
from service.engine.evaluate import TextProbe, encoded, summarize
from service.engine.probe_bound import ProbeBound
from service.engine.teacher_forced import scored_in_chunks
from service.engine.tofu_scoring import TofuProbe, tofu_statistics
from service.errors import JobFailed
from service.evaluation.records import StoredProbes
from service.evaluation.tofu_metrics import ModelReport, model_report, tofu_scores

_CHUNK = 16  # probes per forward batch and progress tick, as the evaluation's own scoring
_ATTACKS: TypeAdapter[QuantizeAttack | RelearnAttack | RephraseAttack] = TypeAdapter(Attack)
_REPHRASE_TOFU = "TOFU's suite scores the probes as sent; it is not computed on rephrased probes"


@dataclass
class PreparedAttack:
    """An attack with everything it reads computed before any model runs."""

    name: str
    attack: QuantizeAttack | RelearnAttack | RephraseAttack
    probes: dict[Split, list[TextProbe]]
    tofu_sets: dict[str, list[TofuProbe]] = field(default_factory=dict)
    rows: list[TrainRow] = field(default_factory=list)  # relearn's training rows

    def units(self, models: int) -> int:
        """Progress units: every probe scored (and TOFU answer set) per model, and relearn's steps."""
        scored = sum(len(items) for items in self.probes.values()) * (2 if isinstance(self.attack, RelearnAttack) else 1)
        steps = self.attack.steps if isinstance(self.attack, RelearnAttack) else 0
        return models * (scored + sum(len(items) for items in self.tofu_sets.values()) + steps)


def prepare_attacks(
    raw: StoredProbes,
    tokenizer: Any,
    probes: dict[Split, list[TextProbe]],
    tofu_sets: dict[str, list[TofuProbe]],
    renderer: Renderer,
    bound: ProbeBound,
) -> list[PreparedAttack]:
    """The request's attacks, their probes encoded (a chat probe rendered by ``renderer``) within
    ``bound``; a probe an attack cannot score fails the job naming the attack and the probe."""
    prepared = []
    for stored in raw.attacks or []:
        attack = _ATTACKS.validate_python(stored)
        name = attack_name(attack)
        if isinstance(attack, RelearnAttack):
            prepared.append(prepare_relearn(name, attack, tokenizer, probes, tofu_sets, bound))
        elif isinstance(attack, RephraseAttack):
            sets = _rephrased(name, attack, raw, tokenizer, probes, renderer, bound)
            prepared.append(PreparedAttack(name, attack, sets))
        else:
            prepared.append(PreparedAttack(name, attack, probes, tofu_sets))
    return prepared


def prepare_relearn(
    name: str,
    attack: RelearnAttack,
    tokenizer: Any,
    probes: dict[Split, list[TextProbe]],
    tofu_sets: dict[str, list[TofuProbe]],
    bound: ProbeBound,
) -> PreparedAttack:
    forget = probes["forget"]
    if attack.texts is not None:
        rows = [text_row(_text_ids(tokenizer, text, bound)) for text in attack.texts]
        trained = 0
    else:
        trained = relearn_rows(attack, len(forget))
        if not 1 <= trained < len(forget):
            raise JobFailed(f"attack {name} trains on {trained} of {len(forget)} forget probes: it needs one of each")
        rows = [probe_row(*_ids(p)) for p in forget[:trained]]
    held: dict[Split, list[TextProbe]] = {"forget": forget[trained:], "retain": probes.get("retain", [])}
    sets = {name_: (items[trained:] if name_ == "forget" else items) for name_, items in tofu_sets.items()}
    return PreparedAttack(name, attack, {s: items for s, items in held.items() if items}, sets, rows)


def _ids(probe: TextProbe) -> tuple[list[int], list[int]]:
    if probe.ids is None:
        raise JobFailed("a probe reached an attack before it was tokenized")
    return probe.ids


def _text_ids(tokenizer: Any, text: str, bound: ProbeBound) -> list[int]:
    """A relearn text's tokens: its first ``bound.chars`` characters, at most ``bound.tokens`` tokens."""
    ids = list(tokenizer(text[: bound.chars], add_special_tokens=True)["input_ids"])[: bound.tokens]
    if len(ids) < 2:
        raise JobFailed(f"attack relearn: the text {text[:60]!r} tokenizes to fewer than 2 tokens (nothing to learn)")
    return ids


def _rephrased(
    name: str,
    attack: RephraseAttack,
    raw: StoredProbes,
    tokenizer: Any,
    probes: dict[Split, list[TextProbe]],
    renderer: Renderer,
    bound: ProbeBound,
) -> dict[Split, list[TextProbe]]:
    """The probe sets asked another way: both sets in the other form, or the forget set paraphrased."""
    if attack.form == "paraphrased":
        if attack.probes is not None:
            forget = [TextProbe(p.prompt, p.completion) for p in attack.probes]
        else:
            forget = [
                with_answer(p, str(r["paraphrased_answer"])) for p, r in zip(probes["forget"], raw.forget, strict=True)
            ]
        sets: dict[Split, list[TextProbe]] = {"forget": forget, "retain": probes.get("retain", [])}  # retain as sent
    else:
        form = as_chat if attack.form == "chat_template" else as_plain
        sets = {split: [form(p) for p in items] for split, items in probes.items()}
    checked: dict[Split, list[TextProbe]] = {}
    for split, items in sets.items():
        checked[split] = []
        for i, probe in enumerate(items):
            try:
                checked[split].append(encoded(tokenizer, probe, renderer, bound))
            except ValueError as exc:
                raise JobFailed(f"attack {name}: {split}[{i}] cannot be scored in this form: {exc}") from None
    return {split: items for split, items in checked.items() if items}


# ---------------------------------------------------------------- running them


@dataclass
class AttackContext:
    """What every attack reads: the models by name (the retain model loaded on first use), the tokenizer,
    the metrics asked (None: no TOFU suite), the forward batch bound and the job's progress."""

    models: dict[TofuModel, Callable[[], Any]]
    tokenizer: Any
    metrics: str | list[str] | None
    batch_tokens: int
    progress: Any


def run_attacks(prepared: list[PreparedAttack], context: AttackContext) -> dict[str, AttackReport]:
    """Every attack's report, by name, in request order."""
    return {item.name: _run_attack(item, context) for item in prepared}


def _run_attack(item: PreparedAttack, context: AttackContext) -> AttackReport:
    started = time.monotonic()
    attack = item.attack
    summary: dict[TofuModel, dict[Split, ProbeSummary]] = {}
    before: dict[TofuModel, dict[Split, ProbeSummary]] = {}
    reports: dict[TofuModel, ModelReport] = {}
    plan_counts: dict[TofuModel, dict[str, int]] = {}
    kept: dict[TofuModel, dict[str, str]] = {}
    for model_name, load in context.models.items():
        model = load()
        if isinstance(attack, QuantizeAttack):
            plan = quantize_plan(model, attack.type)
            plan_counts[model_name], kept[model_name] = plan.counts(), dict(plan.kept)
        if isinstance(attack, RelearnAttack):
            before[model_name] = summaries(model, item.probes, context)
        attacked = attacked_copy(item, model, model_name, context)
        summary[model_name] = summaries(attacked, item.probes, context)
        if context.metrics is not None and item.tofu_sets:
            reports[model_name] = _tofu_report(attacked, item.tofu_sets, context)
        del attacked  # one attacked copy at a time
    report = AttackReport(
        attack=attack.model_dump(mode="json", exclude_none=True), summary=summary, seconds=time.monotonic() - started
    )
    update: dict[str, Any] = {}
    if isinstance(attack, QuantizeAttack):
        update.update(quantized=plan_counts, kept=kept)
    if isinstance(attack, RelearnAttack):
        update.update(unattacked=before, **_recovered(before, summary))
    if attack.thresholds:
        update.update(passed_thresholds(attack.thresholds, summary["variant"], update.get("recovered_fraction")))
    if context.metrics is not None:
        if reports:
            update["tofu"] = _public_reports(reports, context.metrics)
        elif isinstance(attack, RephraseAttack):
            update["left_out"] = {**update.get("left_out", {}), "tofu": _REPHRASE_TOFU}
    return report.model_copy(update=update)


def attacked_copy(item: PreparedAttack, model: Any, model_name: str, context: AttackContext) -> Any:
    """``model`` under the attack: a quantized or relearned copy (``model`` itself untouched), or, for
    rephrasing (which changes the probes), ``model``; refused naming the attack and the model where it
    cannot apply or cannot fit in the job's memory."""
    attack = item.attack
    if isinstance(attack, RephraseAttack):
        return model
    if isinstance(attack, RelearnAttack):
        return _relearned(item, attack, model, model_name, context)
    _check_memory(item.name, model, copies=1)
    attacked = standalone_copy(model)
    try:
        quantize_in_place(attacked, quantize_plan(model, attack.type))
    except ValueError as exc:
        raise JobFailed(f"attack {item.name} on the {model_name} model: {exc}") from None
    return attacked


def passed_thresholds(
    thresholds: list[AttackThreshold], variant: dict[Split, ProbeSummary], recovered: float | None
) -> dict[str, Any]:
    """``passed`` (every threshold met by the attacked variant; an unmeasured value fails) and ``margins``
    (per bound, how far inside it the value is)."""
    values: dict[str, float] = {"recovered_fraction": recovered if recovered is not None else math.nan}
    for split, scored in variant.items():
        values[f"{split}_exact_match"], values[f"{split}_mean_nll"] = scored.exact_match, scored.mean_nll
    margins: dict[str, float] = {}
    passed = True
    for threshold in thresholds:
        value = values.get(threshold.metric, math.nan)
        for side, bound in (("min", threshold.min), ("max", threshold.max)):
            if bound is None:
                continue
            if not math.isfinite(value):
                passed = False
                continue
            margin = value - bound if side == "min" else bound - value
            margins[f"{side}_{threshold.metric}"] = round(margin, 6)
            passed = passed and margin >= 0
    return {"passed": passed, "margins": margins}


def _relearned(item: PreparedAttack, attack: RelearnAttack, model: Any, model_name: str, context: AttackContext) -> Any:
    _check_memory(item.name, model, copies=4)
    pad = context.tokenizer.pad_token_id
    pad_id = int(pad if pad is not None else (context.tokenizer.eos_token_id or 0))
    try:
        return relearned(
            model,
            item.rows,
            attack.steps,
            attack.lr,
            attack.seed,
            pad_id,
            on_step=lambda _step, _loss: context.progress.advance(1),
        )
    except ValueError as exc:
        raise JobFailed(f"attack {item.name} on the {model_name} model: {exc}") from None


def _recovered(
    before: dict[TofuModel, dict[Split, ProbeSummary]], after: dict[TofuModel, dict[Split, ProbeSummary]]
) -> dict[str, Any]:
    """``recovered_fraction`` = (attacked variant − variant) / (base − variant) on forget exact match,
    or ``left_out`` saying why it is undefined."""
    base, variant, attacked = before["base"]["forget"], before["variant"]["forget"], after["variant"]["forget"]
    fraction = recovered_fraction(base.exact_match, variant.exact_match, attacked.exact_match)
    if isinstance(fraction, str):
        return {"left_out": {"recovered_fraction": fraction}}
    return {"recovered_fraction": fraction}


def recovered_fraction(base: float, variant: float, attacked: float) -> float | str:
    """(attacked − variant) / (base − variant), forget exact matches on the same probes; where the
    variant forgot nothing the base knew, the reason it is undefined."""
    forgotten = base - variant
    if not forgotten > 0:
        return (
            f"the base answers {base:.3f} of these forget probes, the variant {variant:.3f}: nothing was forgotten "
            "to recover"
        )
    return (attacked - variant) / forgotten


def summaries(model: Any, probes: dict[Split, list[TextProbe]], context: AttackContext) -> dict[Split, ProbeSummary]:
    """Per split: mean answer NLL and greedy exact match, as the evaluation's own summary."""
    out: dict[Split, ProbeSummary] = {}
    for split, items in probes.items():
        nll, em = scored_in_chunks(model, context.tokenizer, items, _CHUNK, context.batch_tokens, context.progress.advance)
        values = summarize(nll, em)
        out[split] = ProbeSummary(mean_nll=values["mean_nll"], exact_match=values["exact_match"], n=int(values["n"]))
    return out


def _tofu_report(model: Any, sets: dict[str, list[TofuProbe]], context: AttackContext) -> ModelReport:
    stats = {}
    for name, items in sets.items():
        stats[name] = tofu_statistics(model, context.tokenizer, items, batch_size=_CHUNK, batch_tokens=context.batch_tokens)
        context.progress.advance(len(items))
    utility = {name: items for name, items in stats.items() if name not in ("forget", "retain", "holdout")}
    return model_report(stats["forget"], stats.get("retain"), utility, stats.get("holdout"))


def _public_reports(reports: dict[TofuModel, ModelReport], wanted: str | list[str]) -> dict[TofuModel, TofuReport]:
    """Each attacked model's TOFU values scored against the attacked retain model and the attacked base
    (a non-finite value as null; a list of metrics keeps only those)."""
    public: dict[TofuModel, TofuReport] = {}
    for name, report in reports.items():
        scored = tofu_scores(report, reports.get("retain"), reports.get("base"))
        values: dict[str, float | None] = {k: (v if math.isfinite(v) else None) for k, v in scored.values.items()}
        left_out = dict(scored.left_out)
        if isinstance(wanted, list):
            values = {k: v for k, v in values.items() if k in wanted}
            left_out = {k: v for k, v in left_out.items() if k in wanted}
        public[name] = TofuReport(values=values, left_out=left_out)
    return public


# ---------------------------------------------------------------- the memory budget


def _data_bytes() -> int | None:
    """This process's data (``VmData``, what RLIMIT_DATA bounds), or None where it cannot be read."""
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmData:"):
                return int(line.split()[1]) * 1024
    return None


def _check_memory(name: str, model: Any, copies: int) -> None:
    """Refuse an attack whose copy (``copies`` times the model's weights: 1 for a quantized copy, 4 for
    relearning's weights, gradients and AdamW moments) cannot fit in what the job process has left
    under its data limit (ENGRAM_JOB_MEMORY_BYTES).

    Raises:
        JobFailed: naming the attack, the bytes it needs, those left and the setting.
    """
    limit, _ = resource.getrlimit(resource.RLIMIT_DATA)
    held = _data_bytes()
    if limit == resource.RLIM_INFINITY or held is None:
        return
    need = relearn_bytes(model) // 4 * copies
    left = limit - held
    if need > left:
        what = "weights, gradients and AdamW's two moments" if copies == 4 else "a copy of the weights"
        raise JobFailed(
            f"attack {name} needs ~{need >> 20} MiB ({what}) but the job process has {max(left, 0) >> 20} MiB left "
            f"under its memory limit of {limit >> 20} MiB (ENGRAM_JOB_MEMORY_BYTES): raise ENGRAM_JOB_MEMORY_BYTES, "
            f"or evaluate without {name}"
        )
