"""A registered checkpoint's layout: which layers can be edited and where their weights are stored.

Pure data, no torch: the API reads it from a model's manifest to check requests against the model's
layers. :func:`service.engine.checkpoint.inspect_model_dir` makes it (on the ``meta`` device).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from service.engine.layers import LayerSpec


@dataclass
class ModelLayout:
    """What the service needs to know about a checkpoint, kept in the model's manifest.

    Attributes:
        architecture: the transformers class name (``LlamaForCausalLM``).
        num_parameters: distinct parameters (tied ones counted once).
        layers: every editable layer whose weight is in the checkpoint.
        unstored_layers: editable layers of the model whose weight (or bias) the checkpoint does not
            store under any name transformers loads: it initialises them at random, so there is
            nothing to edit; shown to the user, never edited.
        renamed_layers: layers whose weight the checkpoint stores under a name transformers renames
            on load (:mod:`service.engine.key_renames`); versions before 2026-11 did not edit them.
        weight_keys / bias_keys: layer -> checkpoint key holding its current weight / bias.
        own_keys: layer -> its own parameter key, for layers whose weight is tied to another key.
        tied_partners: layer -> the other parameter names sharing its weight (``embed_tokens``).
        key_files: checkpoint key -> shard file name.
        causal_lm: whether the model predicts the next token (:func:`is_causal_lm`), which
            evaluation, generation and calibration need; None in a layout recorded before this was.
        expert_slices: expert layer -> ``[expert, first row, row stop]`` of its fused weight key
            (:mod:`service.engine.experts`); experts stored one key each are ordinary layers here.
        refused_layers: layer -> why the service does not edit it (a grouped or depthwise
            convolution, a ``Conv3d``: :func:`service.engine.conv.conv_refusal`); shown to the user,
            never edited. Empty in a layout recorded before this was.
    """

    architecture: str
    num_parameters: int
    layers: list[LayerSpec]
    weight_keys: dict[str, str]
    bias_keys: dict[str, str]
    own_keys: dict[str, str] = field(default_factory=dict)
    tied_partners: dict[str, list[str]] = field(default_factory=dict)
    key_files: dict[str, str] = field(default_factory=dict)
    expert_slices: dict[str, list[int]] = field(default_factory=dict)
    unstored_layers: list[str] = field(default_factory=list)
    renamed_layers: list[str] = field(default_factory=list)
    causal_lm: bool | None = None
    refused_layers: dict[str, str] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["layers"] = [_layer_json(spec) for spec in self.layers]
        return data

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> ModelLayout:
        fields = dict(data)
        fields["layers"] = [LayerSpec(**spec) for spec in data["layers"]]
        return cls(**fields)

    def layer(self, name: str) -> LayerSpec:
        for spec in self.layers:
            if spec.name == name:
                return spec
        raise KeyError(name)


def _layer_json(spec: LayerSpec) -> dict[str, Any]:
    """A layer as the layout stores it: ``kernel`` only for a convolution, so a Linear layer's entry
    reads as it did before convolutions were layers."""
    data = asdict(spec)
    if spec.kernel is None:
        del data["kernel"]
    else:
        data["kernel"] = spec.kernel.to_json()
    return data


def is_causal_lm(model: Any) -> bool:
    """Whether ``model`` predicts the next token of a text it reads: a generating model that is not
    an encoder-decoder. By behaviour, not by class name: GPT-2's ``GPT2LMHeadModel`` is one, and so
    is a vision-language ``…ForConditionalGeneration`` given text alone; BERT's masked LM is not."""
    # any torch module may come here; only transformers models have config and can_generate
    config = getattr(model, "config", None)
    can_generate = getattr(model, "can_generate", None)
    return bool(callable(can_generate) and can_generate()) and not getattr(config, "is_encoder_decoder", False)
