"""Candidates evaluated in memory: one model load, each candidate's weights swapped in from engrams.

A candidate ``(arm, α)`` is the unlearn variant ``W − α Σ_k f_l s_l E_k,l`` of the arm's layers
(``s_l`` its module type's strength, 1 but in a ``data_weighted`` arm). Its weights are computed by
the very functions a variant build uses (:func:`stored_engrams`, :func:`variant_scales`,
:func:`with_module_strengths` and :func:`stored_editor`: the same float32 sums and the same rounding to the
checkpoint's dtype), so a candidate's numbers are those of the checkpoint variant it stands for,
without writing one: each edited layer's parameters are copied into the loaded model, the probes are
scored, and the next candidate restores what it does not edit from the checkpoint.

Probes are bounded as evaluate bounds them (:mod:`service.engine.probe_bound`: each prompt cut on the
left to the smaller of the model's context and ENGRAM_MAX_LENGTH, an answer past it refused naming
the probe), and scored in batches of at most ENGRAM_EVAL_BATCH_TOKENS padded tokens.

The model is this job's own copy (a shared cached model would be edited under other jobs' feet),
loaded untied when a tied layer (``lm_head`` tied to ``embed_tokens``) may be edited, as a variant
unties it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from service.calibration.search import Arm, Outcome
from service.calibration.space import arm_layers
from service.engine.chat import Renderer
from service.engine.checkpoint import CheckpointReader, load_model, load_tokenizer
from service.engine.errors import EditError
from service.engine.evaluate import BATCH_TOKENS, encoded, summarize
from service.engine.evaluate import TextProbe as Probe
from service.engine.layers import LayerSpec, with_module_strengths
from service.engine.layout import ModelLayout, is_causal_lm
from service.engine.probe_bound import ProbeBound, ProbeTooLong, probe_bound
from service.engine.teacher_forced import nll_and_exact_match
from service.engrams.manifest import UniverseManifest
from service.engrams.store import stored_editor, stored_engrams
from service.errors import JobFailed
from service.variants.build import variant_scales

SPLITS = ("forget", "retain")
BATCH = 16  # probes per forward pass (results do not depend on it)


def parse_probe(raw: Mapping[str, Any]) -> Probe:
    """A stored probe (``{"prompt", "completion"}`` or ``{"messages"}``) as the engine's :class:`Probe`."""
    if raw.get("messages") is not None:
        return Probe(messages=[{"role": m["role"], "content": m["content"]} for m in raw["messages"]])
    return Probe(raw["prompt"], raw["completion"])


def score(
    model: nn.Module, tokenizer: Any, probes: Mapping[str, Sequence[Probe]], batch_tokens: int = BATCH_TOKENS
) -> dict[str, dict[str, float]]:
    """Mean answer NLL, exact match and count per split (as ``POST /variants/{id}/evaluate`` sums them),
    from one teacher-forced pass per probe (:mod:`service.engine.teacher_forced`: the greedy
    answer's exact match, without generating it)."""
    summary = {}
    for split, items in probes.items():
        nll, em = nll_and_exact_match(model, tokenizer, items, batch_size=BATCH, batch_tokens=batch_tokens)
        summary[split] = summarize(nll, em)
    return summary


def check_probes(
    tokenizer: Any, probes: Mapping[str, Sequence[Probe]], renderer: Renderer | None = None, bound: ProbeBound | None = None
) -> dict[str, list[Probe]]:
    """Each probe with its token IDs within ``bound`` (its prompt cut on the left), a chat probe
    rendered once (by ``renderer``: the job's bounded template process), so that no candidate's
    scoring runs a template. A probe whose prompt or completion tokenizes to nothing, whose answer
    passes the bound, or a template past a bound, is refused by split and index."""
    checked: dict[str, list[Probe]] = {}
    for split, items in probes.items():
        checked[split] = []
        for i, probe in enumerate(items):
            try:
                checked[split].append(encoded(tokenizer, probe, renderer, bound))
            except ValueError as exc:
                number = f" ({split} probe {i + 1})" if isinstance(exc, ProbeTooLong) else ""
                raise JobFailed(f"{split}[{i}]{number}: {exc}") from None
    return checked


def ratio(edited: float, base: float) -> float:
    """``edited / base``; a non-finite NLL (a broken edit) counts as infinitely worse."""
    if not math.isfinite(edited):
        return math.inf
    return edited / base if base > 0 else (math.inf if edited > 0 else 1.0)


@dataclass
class Measured:
    """One evaluation: the summaries per split and the ratios to the base model."""

    summary: dict[str, dict[str, float]]
    outcome: Outcome


class CandidateWeights:
    """One loaded model whose edited layers take each candidate's weights in turn (the engram
    arithmetic of a variant build); what is scored on it is the subclass's.

    Args:
        model_dir: the checked model folder.
        layout: the model's layout.
        universe: the built universe's manifest.
        term_prefixes: the statistics prefix of each concept removed.
        device: where the model runs.
        union: every layer some arm edits (only these are ever written).
    """

    def __init__(
        self,
        ctx: Any,
        model_dir: Any,
        layout: ModelLayout,
        universe: UniverseManifest,
        term_prefixes: Sequence[str],
        device: str,
        union: Sequence[LayerSpec],
    ) -> None:
        self.ctx, self.layout, self.universe = ctx, layout, universe
        self.prefixes = list(term_prefixes)  # one per concept: two names of one dataset count twice, as in a variant
        self.reader = CheckpointReader(model_dir, layout)
        untie = any(spec.name in layout.tied_partners for spec in union)
        self.model = load_model(model_dir, device=device, untie=untie)
        self.check_loaded(self.model)
        self.modules = {spec.name: self._module(spec) for spec in union}
        self._scales: dict[tuple[Arm, float], dict[str, float]] = {}
        self._edited: set[str] = set(self.modules)  # untied or not, every layer is set from the checkpoint first

    def check_loaded(self, model: nn.Module) -> None:
        """Refuse a model the subclass cannot score (a JobFailed naming its class)."""

    def base_model(self) -> nn.Module:
        """The model with every layer at the checkpoint's weights."""
        return self._restored(set())

    def _module(self, spec: LayerSpec) -> nn.Module:
        try:
            module = self.model.get_submodule(spec.name)
        except AttributeError:
            module = None
        weight = getattr(module, "weight", None)
        if module is None or not isinstance(weight, torch.Tensor):
            raise JobFailed(
                f"layer {spec.name} is no module of the loaded model (an expert of a fused parameter?); "
                "calibration edits whole modules: leave it out with module_sets"
            )
        return module

    def applied(self, arm: Arm, alpha: float) -> nn.Module:
        """The model with the candidate's weights swapped in (nothing scored)."""
        return self._apply(arm, alpha)

    def scales(self, arm: Arm, alpha: float) -> dict[str, float]:
        """The candidate's per-layer ``f_l · s_l``, computed as its variant computes them (W-Norm over
        the arm's layers, from the engram of the request's terms, then the module types' strengths:
        exactly the variant's numbers)."""
        key = (arm, float(alpha))
        if key not in self._scales:
            layers = arm_layers(self.layout.layers, arm)
            source = stored_engrams(self.ctx, self.universe, self._terms(alpha))
            try:
                scales = variant_scales(layers, source, self.universe, arm.scaling, self.reader)
                self._scales[key] = with_module_strengths(scales, dict(arm.strengths))
            except EditError as exc:
                raise JobFailed(str(exc)) from None
        return self._scales[key]

    def _terms(self, alpha: float) -> dict[str, float]:
        """Statistics prefix -> coefficient of the unlearn request: ``−α`` per concept."""
        terms: dict[str, float] = {}
        for prefix in self.prefixes:
            terms[prefix] = terms.get(prefix, 0.0) - float(alpha)
        return terms

    def _apply(self, arm: Arm, alpha: float) -> nn.Module:
        layers = arm_layers(self.layout.layers, arm)
        scales = self.scales(arm, alpha)
        source = stored_engrams(self.ctx, self.universe, self._terms(alpha))
        edit_layer = stored_editor(source, self.reader.layer_weights, scales)
        edited = set()
        for spec in layers:
            try:
                edit = edit_layer(spec)
            except EditError as exc:
                raise JobFailed(str(exc)) from None
            if edit is None:
                continue
            self._set(spec.name, edit.weight, edit.bias)
            edited.add(spec.name)
        return self._restored(edited)

    def _restored(self, keep: set[str]) -> nn.Module:
        """The model with every layer edited before, and not by the current candidate, back to the checkpoint's."""
        for name in sorted(self._edited - keep):
            weights = self.reader.layer_weights(self.layout.layer(name))
            self._set(name, weights.weight, weights.bias)
        self._edited = set(keep)
        return self.model

    @torch.no_grad()
    def _set(self, name: str, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        module = self.modules[name]
        loaded = module.get_parameter("weight")
        if tuple(loaded.shape) != tuple(weight.shape):
            shapes = f"the loaded weight is {tuple(loaded.shape)}, the edit {tuple(weight.shape)}"
            raise JobFailed(f"layer {name}: {shapes}")
        loaded.copy_(weight)
        if bias is not None:
            module.get_parameter("bias").copy_(bias)


class InMemoryCandidates(CandidateWeights):
    """Evaluates candidates of one universe's engrams on one loaded causal LM (answer NLL, exact match).

    Args:
        probes: forget and retain probes.
        renderer: what renders chat probes' template, once each (the job's bounded template process).
        (the others: :class:`CandidateWeights`'s)
    """

    def __init__(
        self,
        ctx: Any,
        model_dir: Any,
        layout: ModelLayout,
        universe: UniverseManifest,
        term_prefixes: Sequence[str],
        probes: Mapping[str, Sequence[Probe]],
        device: str,
        union: Sequence[LayerSpec],
        renderer: Renderer | None = None,
    ) -> None:
        super().__init__(ctx, model_dir, layout, universe, term_prefixes, device, union)
        self.tokenizer = load_tokenizer(model_dir)
        self.bound = probe_bound(self.tokenizer, self.model.config, ctx.settings.max_length)
        self.batch_tokens = ctx.settings.eval_batch_tokens
        self.probes = probes = check_probes(self.tokenizer, probes, renderer, self.bound)
        self.base = score(self.base_model(), self.tokenizer, probes, self.batch_tokens)

    def check_loaded(self, model: nn.Module) -> None:
        if not is_causal_lm(model):
            raise JobFailed(f"calibration needs a causal language model; this one is a {type(model).__name__}")

    def truncated(self) -> dict[str, list[bool]]:
        """Per split, whether each probe's prompt was cut to the probe bound."""
        return {split: [probe.cut for probe in items] for split, items in self.probes.items()}

    def measure(self, arm: Arm, alpha: float) -> Measured:
        """Swap in the candidate's weights, score the probes, and say how they compare to the base."""
        model = self._apply(arm, alpha)
        summary = score(model, self.tokenizer, self.probes, self.batch_tokens)
        outcome = Outcome(
            ratio(summary["forget"]["mean_nll"], self.base["forget"]["mean_nll"]),
            ratio(summary["retain"]["mean_nll"], self.base["retain"]["mean_nll"]),
        )
        return Measured(summary, outcome)
