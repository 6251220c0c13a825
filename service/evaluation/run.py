"""The ``evaluate`` and ``generate`` job bodies: run a variant and its base model on the user's probes.

A job loads the variant *as it was shipped* (the checkpoint directory, the delta on the base, or the
PEFT adapter on the base), so the numbers describe the artifact users download, not a recomputation.
An evaluation's result is stored content-addressed (``evaluations/<evaluation id>.json``), and the
same probes on the same variant are answered from it. Image probes on an image classifier's variant
are scored by :mod:`service.evaluation.classifier_run`.

Chat probes and a generation's ``messages`` are rendered by the job's bounded template process
(:mod:`service.jobs.templates`: ENGRAM_TEMPLATE_TIMEOUT_S / _MEMORY_BYTES / _MAX_CHARS, killed when
the job is cancelled), each probe once, before any model runs.

Every probe (each TOFU answer too) and a generation's prompt are bounded by what the model reads, the
smaller of its context and ENGRAM_MAX_LENGTH tokens, before they are tokenized
(:mod:`service.engine.probe_bound`): a prompt is cut on the left and counted in the result
(``truncated_probes``, ``prompt_truncated``), an answer past the bound fails the job naming the probe
and the setting. Forward passes hold at most ENGRAM_EVAL_BATCH_TOKENS padded tokens.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import load_file

from api_schemas.evaluation import (
    EvaluationResult,
    GeneratedText,
    GenerationResult,
    ProbeRecord,
    ProbeScore,
    ProbeSummary,
    Scored,
    Split,
    TofuModel,
    TofuReport,
)
from service.context import Context
from service.engine.chat import Renderer
from service.engine.checkpoint import load_model
from service.engine.evaluate import TextProbe, encoded, summarize
from service.engine.layout import is_causal_lm
from service.engine.model_file_descriptors import ModelFiles
from service.engine.probe_bound import ProbeBound, ProbeTooLong, probe_bound
from service.engine.teacher_forced import scored_in_chunks
from service.engine.tofu_scoring import (
    AnswerRefused,
    TofuProbe,
    encoded_tofu,
    merged_cuts,
    tofu_probe,
    tofu_statistics,
)
from service.errors import JobFailed
from service.evaluation.attacks import AttackContext, prepare_attacks, run_attacks
from service.evaluation.classifier_run import evaluate_classifiers
from service.evaluation.generation import bounded_prompt, prompt_room
from service.evaluation.provenance import evaluation_metadata
from service.evaluation.records import ProbeJson, StoredProbes, TofuOptions
from service.evaluation.retain_model import RetainModelRef
from service.evaluation.service import SPLITS
from service.evaluation.tofu_metrics import ModelReport, model_report, tofu_scores
from service.evaluation.tracking import track_evaluation
from service.jobs.progress import ProgressReporter
from service.jobs.records import EvaluatePayload, GeneratePayload, JobRecord
from service.jobs.templates import template_process
from service.models.loaded import check_model_unchanged, checked_model_files, loaded_model
from service.models.registry import get_model
from service.storage.base import scratch_dir
from service.storage.keys import evaluation_key, probes_key, variant_file_key
from service.variants.manifest import VariantManifest
from service.variants.service import find_variant_request, variant_manifest
from service.variants.spec import VariantRequest

_CHUNK = 16  # probes per progress tick (and per forward batch)


# ---------------------------------------------------------------- the loaded models


def loaded_variant(ctx: Context, variant_id: str) -> tuple[Any, Any, Any]:
    """``(base model, variant model, tokenizer)``, the variant loaded on first use and kept in the
    context's ``caches.variants`` (one at a time: a model-sized object each; the base in
    ``caches.models``, :func:`service.models.loaded.loaded_model`)."""
    request = find_variant_request(ctx, variant_id)
    manifest = variant_manifest(ctx, variant_id)
    if request is None or manifest is None:
        raise JobFailed(f"variant {variant_id} is not ready (deleted, or still building)")
    model_manifest = get_model(ctx, request.model_id)
    device = ctx.settings.torch_device
    base, tokenizer = loaded_model(ctx, model_manifest, device)

    def load() -> Any:
        with checked_model_files(ctx, model_manifest) as base_files:
            return _load_variant(ctx, variant_id, request, manifest, base_files, device)

    return base, ctx.caches.variants.get_or_load(variant_id, load), tokenizer


def _load_variant(
    ctx: Context, variant_id: str, request: VariantRequest, manifest: VariantManifest, base_dir: ModelFiles, device: str
) -> Any:
    """The variant as shipped: its checkpoint, the base plus its delta, or the base plus its adapter."""
    with scratch_dir("variant-load") as tmp:
        folder = Path(tmp)
        for entry in manifest.files:
            target = folder / entry.path
            target.parent.mkdir(parents=True, exist_ok=True)
            ctx.storage.download(variant_file_key(variant_id, entry.path), target)
        fmt = request.spec.format
        if fmt == "checkpoint":
            return load_model(folder, device=device)
        if fmt == "delta":
            return _base_plus_delta(base_dir, folder / "delta.safetensors", device)
        if fmt == "peft":
            from peft import PeftModel  # only this format needs it

            return PeftModel.from_pretrained(load_model(base_dir, device=device), str(folder)).eval()
    raise JobFailed(f"variant {variant_id} has format {fmt!r}, which cannot be evaluated")


def _base_plus_delta(base_dir: ModelFiles, delta_file: Path, device: str) -> Any:
    with safe_open(str(delta_file), framework="pt") as handle:
        untied = json.loads((handle.metadata() or {}).get("untied", "false"))
    model = load_model(base_dir, device=device, untie=untied)
    result = model.load_state_dict(load_file(str(delta_file), device=str(device)), strict=False)
    if result.unexpected_keys:
        raise JobFailed(f"the delta names tensors the model does not have: {result.unexpected_keys[:5]}")
    return model.eval()


def _causal(model: Any) -> None:
    if not is_causal_lm(model):
        raise JobFailed(f"evaluation and generation need a causal language model; this one is a {type(model).__name__}")


def _progress(ctx: Context, job: JobRecord, total: int) -> Any:
    return ProgressReporter(ctx, job.job_id, total)


# ---------------------------------------------------------------- job bodies


def run_evaluation(ctx: Context, job: JobRecord) -> EvaluationResult:
    """Per-probe answer NLL and greedy exact match on the base and the variant, with summaries."""
    payload = job.payload_of(EvaluatePayload)
    key = evaluation_key(payload.evaluation_id)
    cached = ctx.storage.find_json(key)
    if cached is not None:
        return EvaluationResult.model_validate({**cached, "reused": True})
    raw = StoredProbes.from_bytes(ctx.storage.get_bytes(probes_key(payload.probes_digest)), payload.probes_digest)
    if raw.classifier is not None:  # image probes on an image classifier's variant
        result = evaluate_classifiers(ctx, payload.variant_id, raw, loaded_variant, lambda total: _progress(ctx, job, total))
    else:
        result = _evaluate_text(ctx, job, payload.variant_id, raw)
    _check_base_unchanged(ctx, payload.variant_id)
    result = result.model_copy(update=evaluation_metadata(job, raw))  # who, when, why, which probes: not its ID
    stored = evaluation_json(result)
    ctx.storage.put_json(key, stored)
    tracked = track_evaluation(ctx, payload.evaluation_id, job.job_id, stored)  # after: a tracker never costs the result
    # the runner stores it as evaluation_json does: the fields the job set
    return result if tracked is None else result.model_copy(update={"tracking": tracked})


def evaluation_json(result: EvaluationResult) -> dict[str, Any]:
    """The result as it is stored and answered: the fields the job set (``tofu`` and ``retain_model``
    only with metrics or image probes; ``reused`` only when answered from storage)."""
    return result.model_dump(mode="json", exclude_unset=True)


def _evaluate_text(ctx: Context, job: JobRecord, variant_id: str, raw: StoredProbes) -> EvaluationResult:
    """Text probes: the base and the variant on every probe, and TOFU's suite when asked for."""
    probes: dict[Split, list[TextProbe]] = {
        "forget": [_probe(p) for p in raw.forget],
        "retain": [_probe(p) for p in raw.retain],
    }
    base, variant, tokenizer = loaded_variant(ctx, variant_id)
    _causal(base)
    bound = probe_bound(tokenizer, base.config, ctx.settings.max_length)
    with template_process(ctx, job.job_id) as renderer:  # one render process, ended before any model runs
        probes = _checked_probes(tokenizer, probes, renderer, bound)
        tofu_sets = encoded_sets(tokenizer, _tofu_sets(raw, raw.tofu), renderer, bound) if raw.tofu is not None else {}
        attacks = prepare_attacks(raw, tokenizer, probes, tofu_sets, renderer, bound)  # none unless asked
    retain_option = raw.tofu.retain_model if raw.tofu is not None else None
    attack_units = sum(a.units(3 if retain_option is not None else 2) for a in attacks)
    progress = _progress(ctx, job, 2 * sum(len(v) for v in probes.values()) + _tofu_units(raw) + attack_units)
    tokens = ctx.settings.eval_batch_tokens
    scores: dict[Scored, dict[Split, tuple[list[float], list[bool]]]] = {
        "base": _score(model=base, tokenizer=tokenizer, probes=probes, progress=progress, batch_tokens=tokens),
        "variant": _score(model=variant, tokenizer=tokenizer, probes=probes, progress=progress, batch_tokens=tokens),
    }
    cut: dict[str, list[bool]] = {split: [p.cut for p in items] for split, items in probes.items()}
    result = EvaluationResult(
        variant_id=variant_id,
        summary={name: {s: _summary(*per[s]) for s in SPLITS if probes[s]} for name, per in scores.items()},
        records=[
            ProbeRecord(
                split=split,
                index=i,
                base=ProbeScore(nll=scores["base"][split][0][i], exact_match=scores["base"][split][1][i]),
                variant=ProbeScore(nll=scores["variant"][split][0][i], exact_match=scores["variant"][split][1][i]),
            )
            for split in SPLITS
            for i in range(len(probes[split]))
        ],
    )
    if raw.tofu is not None:
        cut = merged_cuts(cut, tofu_sets)
        tofu, retain_model = _tofu_result(ctx, raw.tofu, tofu_sets, (base, variant, tokenizer), progress)
        result = result.model_copy(update={"tofu": tofu, "retain_model": retain_model})
    if attacks:  # each attack on each model, after the unattacked scores (service.evaluation.attacks)
        models: dict[TofuModel, Any] = {"base": lambda: base, "variant": lambda: variant}
        if retain_option is not None:
            models["retain"] = lambda: load_retain_model(ctx, retain_option, tokenizer)
        metrics = raw.tofu.metrics if raw.tofu is not None else None
        context = AttackContext(models, tokenizer, metrics, tokens, progress)
        result = result.model_copy(update={"attacks": run_attacks(attacks, context)})
    truncated = {name: sum(flags) for name, flags in cut.items() if any(flags)}
    if truncated:  # set only then: an evaluation that cut nothing keeps its shape
        result = result.model_copy(update={"truncated_probes": truncated})
    return result


def _summary(nll: list[float], em: list[bool]) -> ProbeSummary:
    values = summarize(nll, em)
    return ProbeSummary(mean_nll=values["mean_nll"], exact_match=values["exact_match"], n=int(values["n"]))


def _check_base_unchanged(ctx: Context, variant_id: str) -> None:
    """The base model's files as registered still (a shard rewritten in place while the job ran
    changed the mapped weights it used): checked before a result is kept or answered."""
    request = find_variant_request(ctx, variant_id)
    if request is not None:
        check_model_unchanged(ctx, get_model(ctx, request.model_id))


def _probe(raw: ProbeJson) -> TextProbe:
    if raw.get("messages") is not None:
        return TextProbe(messages=[{"role": m["role"], "content": m["content"]} for m in raw["messages"]])
    return TextProbe(raw["prompt"], raw["completion"])


def _checked_probes(
    tokenizer: Any, probes: dict[Split, list[TextProbe]], renderer: Renderer, bound: ProbeBound
) -> dict[Split, list[TextProbe]]:
    """Each probe with its token IDs within ``bound`` (a chat probe rendered once, by ``renderer``);
    a probe that cannot be scored, or a template past a bound (naming its setting), fails the job
    naming it."""
    checked: dict[Split, list[TextProbe]] = {}
    for split, items in probes.items():
        checked[split] = []
        for i, probe in enumerate(items):
            try:
                checked[split].append(encoded(tokenizer, probe, renderer, bound))
            except ValueError as exc:
                raise JobFailed(f"{_where(split, i, '', exc)}: {exc}") from None
    return checked


def _where(name: str, i: int, field: str, exc: Exception) -> str:
    """How a refused probe is named: ``forget[2].paraphrased_answer``, and for one past the probe
    bound also its 1-based number (``forget[2] (forget probe 3)``)."""
    where = f"{name}[{i}]{field}"
    return f"{where} ({name} probe {i + 1})" if isinstance(exc, ProbeTooLong) else where


def _score(
    model: Any, tokenizer: Any, probes: dict[Split, list[TextProbe]], progress: Any, batch_tokens: int
) -> dict[Split, tuple[list[float], list[bool]]]:
    """``split -> (per-probe NLL, per-probe exact match)``, reporting progress every chunk."""
    scores: dict[Split, tuple[list[float], list[bool]]] = {}
    for split, items in probes.items():
        # one teacher-forced pass per chunk gives both: the greedy answer's exact match without generating it
        nll, em = scored_in_chunks(model, tokenizer, items, _CHUNK, batch_tokens, progress.advance)
        scores[split] = (nll, em)
    return scores


# ---------------------------------------------------------------- TOFU's metrics (metrics: "tofu")


def _tofu_sets(raw: StoredProbes, options: TofuOptions) -> dict[str, list[TofuProbe]]:
    """The probe sets the suite reads, by name: forget, retain, holdout and each utility set."""
    sets = {"forget": raw.forget, "retain": raw.retain, "holdout": options.holdout, **options.utility}
    return {name: [tofu_probe(_plain(p)) for p in items] for name, items in sets.items() if items}


def _plain(record: ProbeJson) -> dict[str, object]:
    if record.get("messages") is not None:
        messages = [{"role": m["role"], "content": m["content"]} for m in record["messages"]]
        return {**record, "messages": messages}
    return dict(record)


def encoded_sets(
    tokenizer: Any, sets: dict[str, list[TofuProbe]], renderer: Renderer, bound: ProbeBound | None
) -> dict[str, list[TofuProbe]]:
    """Every answer of every probe tokenized once, within ``bound`` (a chat probe rendered by
    ``renderer``); an answer that cannot be scored fails the job naming it."""
    encoded: dict[str, list[TofuProbe]] = {}
    for name, items in sets.items():
        encoded[name] = []
        for i, item in enumerate(items):
            try:
                encoded[name].append(encoded_tofu(tokenizer, item, renderer, bound))
            except AnswerRefused as exc:
                raise JobFailed(f"{_where(name, i, exc.where, exc.error)}: {exc}") from None
    return encoded


def _tofu_units(raw: StoredProbes) -> int:
    """The progress units of the TOFU suite: each probe of each set, once per model scored."""
    options = raw.tofu
    if options is None:
        return 0
    models = 3 if options.retain_model is not None else 2
    return models * sum(len(items) for items in _tofu_sets(raw, options).values())


def _report(model: Any, tokenizer: Any, sets: dict[str, list[TofuProbe]], batch_tokens: int, progress: Any) -> ModelReport:
    """One model's raw TOFU values on every set (the same tokens for every model: the base's tokenizer)."""
    stats = {}
    for name, items in sets.items():
        stats[name] = tofu_statistics(model, tokenizer, items, batch_size=_CHUNK, batch_tokens=batch_tokens)
        progress.advance(len(items))
    utility = {name: items for name, items in stats.items() if name not in ("forget", "retain", "holdout")}
    return model_report(stats["forget"], stats.get("retain"), utility, stats.get("holdout"))


def _tofu_result(
    ctx: Context,
    options: TofuOptions,
    sets: dict[str, list[TofuProbe]],
    loaded: tuple[Any, Any, Any],
    progress: Any,
) -> tuple[dict[TofuModel, TofuReport], str | None]:
    """The suite per model (``base``, ``variant`` and, given one, ``retain``) on the encoded ``sets``
    (:func:`encoded_sets`), each scored against the retain model and the base, and the retain model's
    id (None without one). ``loaded`` is ``(base, variant, tokenizer)``."""
    base, variant, tokenizer = loaded
    tokens = ctx.settings.eval_batch_tokens
    reports: dict[TofuModel, ModelReport] = {
        "base": _report(base, tokenizer, sets, tokens, progress),
        "variant": _report(variant, tokenizer, sets, tokens, progress),
    }
    retain_option = options.retain_model
    if retain_option is not None:
        retain_model = load_retain_model(ctx, retain_option, tokenizer)
        reports["retain"] = _report(retain_model, tokenizer, sets, tokens, progress)
    retain = reports.get("retain")
    wanted = options.metrics
    tofu = {name: _public_report(tofu_scores(report, retain, reports["base"]), wanted) for name, report in reports.items()}
    return tofu, retain_option.id if retain_option is not None else None


def load_retain_model(ctx: Context, option: RetainModelRef, tokenizer: Any) -> Any:
    """The retain model loaded (a registered model, or a variant as shipped), checked to be a causal
    LM with the base's vocabulary (the request checked it where the API could read the files)."""
    if option.kind == "variant":
        _, model, retain_tokenizer = loaded_variant(ctx, option.id)
    else:
        manifest = get_model(ctx, option.id)
        if manifest.digest != option.digest:
            raise JobFailed(f"retain_model {option.id} was registered again since this evaluation was asked for")
        model, retain_tokenizer = loaded_model(ctx, manifest, ctx.settings.torch_device)
    _causal(model)
    if retain_tokenizer is None or retain_tokenizer.get_vocab() != tokenizer.get_vocab():
        raise JobFailed(f"retain_model {option.id} has another tokenizer vocabulary than the base model")
    return model


def _public_report(report: ModelReport, wanted: str | list[str]) -> TofuReport:
    """Values (a non-finite one, log10 of a p-value of 0, as null) and left-out reasons; a list of
    metrics keeps only those."""
    values: dict[str, float | None] = {k: (v if math.isfinite(v) else None) for k, v in report.values.items()}
    left_out = dict(report.left_out)
    if isinstance(wanted, list):
        values = {k: v for k, v in values.items() if k in wanted}
        left_out = {k: v for k, v in left_out.items() if k in wanted}
    return TofuReport(values=values, left_out=left_out)


def run_generation(ctx: Context, job: JobRecord) -> GenerationResult:
    """Greedy continuation of the prompt by each requested model (stops at EOS), the prompt cut on the
    left to what the model reads (:mod:`service.evaluation.generation`)."""
    payload = job.payload_of(GeneratePayload)
    if isinstance(payload.prompt, list):  # submit_generation stores text (or None with messages)
        raise JobFailed("a generation's stored prompt is token IDs; only text (or messages) is answered")
    sent = payload.prompt
    base, variant, tokenizer = loaded_variant(ctx, payload.variant_id)
    _causal(base)
    models = {"base": base, "variant": variant}
    progress = _progress(ctx, job, len(payload.models))
    outputs: dict[Scored, GeneratedText] = {}
    messages = payload.messages
    if messages is None and payload.prompt is None:
        raise JobFailed("a generation needs a prompt or messages")
    bound = probe_bound(tokenizer, base.config, ctx.settings.max_length)
    room = prompt_room(bound, base.config, payload.max_new_tokens)
    if messages is not None:
        from service.engine.records import Message, RecordError

        try:
            with template_process(ctx, job.job_id) as renderer:
                turns = [Message(m["role"], m["content"]) for m in messages]
                prompt, truncated = bounded_prompt(tokenizer, room, bound, messages=turns, renderer=renderer)
        except RecordError as exc:
            raise JobFailed(f"messages: {exc}") from None
    else:
        prompt, truncated = bounded_prompt(tokenizer, room, bound, prompt=payload.prompt)
    for name in payload.models:
        outputs[_scored(name)] = greedy_generate(models[name], tokenizer, prompt, payload.max_new_tokens)
        progress.advance(1)
    _check_base_unchanged(ctx, payload.variant_id)
    result = GenerationResult(variant_id=payload.variant_id, prompt=sent, outputs=outputs)
    if messages is not None:
        result = result.model_copy(update={"messages": messages})
    if truncated:  # set only then: a generation that read its whole prompt keeps its shape
        result = result.model_copy(update={"prompt_truncated": True})
    return result  # the runner stores the fields it set: messages only when they were sent


def _scored(name: str) -> Scored:
    if name == "base":
        return "base"
    if name == "variant":
        return "variant"
    raise JobFailed(f"a generation's models are base and variant, not {name!r}")


def greedy_generate(model: Any, tokenizer: Any, prompt: str | list[int], max_new_tokens: int) -> GeneratedText:
    """The greedy continuation (text and token IDs), with ``generate``'s KV cache; stops at EOS.

    ``prompt`` is text (tokenized with special tokens) or token IDs (a rendered chat)."""
    device = next(model.parameters()).device
    if isinstance(prompt, str):
        inputs = tokenizer(prompt, return_tensors="pt").to(device)
    else:
        ids = torch.tensor([prompt], dtype=torch.long, device=device)
        inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    with torch.inference_mode():
        out = model.generate(
            **inputs, max_new_tokens=max_new_tokens, do_sample=False, num_beams=1, pad_token_id=pad, top_p=None, top_k=None
        )
    new_tokens = out[0, inputs["input_ids"].shape[1] :].tolist()
    return GeneratedText(text=tokenizer.decode(new_tokens, skip_special_tokens=True), token_ids=new_tokens)
