"""Hugging Face model directories: validation, layout, loading, and writing edited variants.

Only safetensors weights are ever read; pickle weights and remote code are refused, because either
would run code a user sent us.

A variant is written without loading the model: each safetensors shard is read, the edited tensors
are replaced, and the shard is written again, so at most one shard is in memory. Tied weights are
never edited by accident: when an edited layer shares its weight with another parameter
(``lm_head`` tied to ``embed_tokens``), the variant *unties* them, writing the edited head under
its own key and setting ``tie_word_embeddings: false``; the embedding keeps its original values.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from collections.abc import Callable, Collection, Mapping
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch
import transformers
from safetensors import safe_open
from torch import nn

from service.engine.compose import LayerEdit, LayerWeights
from service.engine.layers import LayerSpec, editable_layers
from service.engine.safetensors_stream import Planned, TensorEntry, read_header, write_streaming

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt")
INDEX_FILE = "model.safetensors.index.json"
WEIGHTS_FILE = "model.safetensors"
_HASH_CHUNK = 8 * 1024 * 1024


class ModelSourceError(ValueError):
    """A model directory we refuse to use; the message says why."""


@dataclass
class ModelLayout:
    """What the service needs to know about a checkpoint, kept in the model's manifest.

    Attributes:
        architecture: the transformers class name (``LlamaForCausalLM``).
        num_parameters: distinct parameters (tied ones counted once).
        layers: every editable layer whose weight is in the checkpoint.
        weight_keys / bias_keys: layer -> checkpoint key holding its current weight / bias.
        own_keys: layer -> its own parameter key, for layers whose weight is tied to another key.
        tied_partners: layer -> the other parameter names sharing its weight (``embed_tokens``).
        key_files: checkpoint key -> shard file name.
    """

    architecture: str
    num_parameters: int
    layers: list[LayerSpec]
    weight_keys: dict[str, str]
    bias_keys: dict[str, str]
    own_keys: dict[str, str] = field(default_factory=dict)
    tied_partners: dict[str, list[str]] = field(default_factory=dict)
    key_files: dict[str, str] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["layers"] = [asdict(spec) for spec in self.layers]
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


def weight_files(path: Path) -> list[str]:
    """The safetensors shards of a model directory, from its index or the single file."""
    index = path / INDEX_FILE
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return sorted(set(weight_map.values()))
    if (path / WEIGHTS_FILE).is_file():
        return [WEIGHTS_FILE]
    return []


def validate_model_dir(path: Path) -> dict[str, Any]:
    """Check a directory is a safe Hugging Face checkpoint and return its ``config.json``.

    Raises:
        ModelSourceError: missing config, pickle-only weights, remote code, unreadable files.
    """
    if not path.is_dir():
        raise ModelSourceError(f"{path} is not a directory")
    config_path = path / "config.json"
    if not config_path.is_file():
        raise ModelSourceError(f"{path} has no config.json")
    try:
        config = json.loads(config_path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelSourceError(f"config.json is not valid JSON: {exc}") from None
    if not isinstance(config, dict):
        raise ModelSourceError("config.json is not a JSON object")
    if "auto_map" in config:
        raise ModelSourceError("the model needs remote code (config.json has auto_map), which is refused")
    if not weight_files(path):
        pickles = sorted(p.name for p in path.iterdir() if p.suffix in PICKLE_SUFFIXES)
        if pickles:
            raise ModelSourceError(f"pickle weights are refused ({', '.join(pickles)}); convert to safetensors")
        raise ModelSourceError(f"{path} has no safetensors weights")
    return config


def directory_digest(path: Path) -> str:
    """sha256 over the names and contents of every file a variant depends on (pickles excluded)."""
    outer = hashlib.sha256()
    for file in sorted(p for p in path.iterdir() if p.is_file() and p.suffix not in PICKLE_SUFFIXES):
        outer.update(file.name.encode() + b"\0" + file_sha256(file).encode() + b"\n")
    return outer.hexdigest()


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while chunk := handle.read(_HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def model_class(config: Mapping[str, Any]) -> type[nn.Module]:
    """The transformers class named by ``architectures``, else ``AutoModel``'s choice."""
    for name in config.get("architectures") or []:
        cls = getattr(transformers, name, None)
        if isinstance(cls, type) and issubclass(cls, transformers.PreTrainedModel):
            return cls
    return transformers.AutoModel  # type: ignore[return-value]


def inspect_model_dir(path: Path) -> ModelLayout:
    """Validate a checkpoint and describe its editable layers without reading its weights.

    The model is built on the ``meta`` device (no memory) to learn its module tree and which
    parameters are tied; checkpoint keys come from the safetensors headers.
    """
    config_dict = validate_model_dir(path)
    try:
        config = transformers.AutoConfig.from_pretrained(str(path), trust_remote_code=False)
        cls = model_class(config_dict)
        with torch.device("meta"):
            model = (
                cls._from_config(config)  # type: ignore[attr-defined]
                if cls is not transformers.AutoModel
                else transformers.AutoModel.from_config(config)
            )
    except Exception as exc:  # transformers raises many types for unsupported configs
        raise ModelSourceError(f"transformers cannot build this model: {exc}") from None
    key_files = _checkpoint_keys(path)
    return _layout(model, key_files)


def _checkpoint_keys(path: Path) -> dict[str, str]:
    key_files: dict[str, str] = {}
    for name in weight_files(path):
        try:
            with safe_open(str(path / name), framework="pt") as handle:
                key_files.update(dict.fromkeys(handle.keys(), name))  # noqa: SIM118
        except Exception as exc:
            raise ModelSourceError(f"{name} is not a readable safetensors file: {exc}") from None
    return key_files


def _layout(model: nn.Module, key_files: dict[str, str]) -> ModelLayout:
    aliases: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(param), []).append(name)
    modules = dict(model.named_modules())
    layout = ModelLayout(
        architecture=type(model).__name__,
        num_parameters=sum(p.numel() for p in model.parameters()),
        layers=[],
        weight_keys={},
        bias_keys={},
        key_files=key_files,
    )
    for spec in editable_layers(model):
        module = modules[spec.name]
        names = aliases[id(module.weight)]
        stored = next((n for n in names if n in key_files), None)
        if stored is None:
            continue  # not in this checkpoint (a different head class); cannot be edited safely
        own = f"{spec.name}.weight"
        if len(names) > 1:
            layout.own_keys[spec.name] = own
            layout.tied_partners[spec.name] = [n for n in names if n != own]
        if spec.bias:
            bias_key = next((n for n in aliases[id(module.bias)] if n in key_files), None)
            if bias_key is None:
                continue
            layout.bias_keys[spec.name] = bias_key
        layout.weight_keys[spec.name] = stored
        layout.layers.append(spec)
    return layout


def load_model(
    path: Path, device: str | torch.device = "cpu", dtype: torch.dtype | None = None, untie: bool = False
) -> nn.Module:
    """Load a validated checkpoint (safetensors only, no remote code).

    Args:
        path: the checkpoint directory.
        device: where the model goes.
        dtype: override of the stored dtype.
        untie: load with ``tie_word_embeddings=False`` (a delta variant that edited a tied head
            carries the head's new values; the embedding stays as it was).
    """
    config = validate_model_dir(path)
    cls = model_class(config)
    kwargs: dict[str, Any] = {"use_safetensors": True, "trust_remote_code": False}
    if dtype is not None:
        kwargs["dtype"] = dtype
    if untie:
        kwargs["tie_word_embeddings"] = False
    model = cls.from_pretrained(str(path), **kwargs)  # type: ignore[attr-defined]
    return model.to(device).eval()


def load_tokenizer(path: Path) -> Any:
    return transformers.AutoTokenizer.from_pretrained(str(path), trust_remote_code=False)


class CheckpointReader:
    """Reads single tensors of a checkpoint by key.

    Each read maps the shard only while it copies the tensor out: a mapping kept open would leave
    every page read so far resident in this process, a whole model's worth after one variant.
    """

    def __init__(self, path: Path, layout: ModelLayout) -> None:
        self.path = path
        self.layout = layout

    def tensor(self, key: str) -> torch.Tensor:
        with safe_open(str(self.path / self.layout.key_files[key]), framework="pt") as handle:
            return handle.get_tensor(key)

    def layer_weights(self, spec: LayerSpec) -> LayerWeights:
        bias_key = self.layout.bias_keys.get(spec.name)
        return LayerWeights(
            self.tensor(self.layout.weight_keys[spec.name]),
            self.tensor(bias_key) if bias_key else None,
        )


def edit_plan(spec: LayerSpec, layout: ModelLayout) -> list[tuple[str, str, str]]:
    """What an edit of ``spec`` writes: ``(key, base key, role)``, role ``weight``, ``partner`` or ``bias``.

    A tied weight is untied: the edit goes under the layer's own key, and when the checkpoint
    stored the shared tensor under that very key, the original value is kept for the partners
    (``embed_tokens``) under their own names, so they never change. The base key names the tensor
    whose dtype, shape and original value the written one starts from.
    """
    name = spec.name
    stored = layout.weight_keys[name]
    plan = [(layout.own_keys.get(name, stored), stored, "weight")]
    if name in layout.own_keys and stored == layout.own_keys[name]:
        plan += [(p, stored, "partner") for p in layout.tied_partners.get(name, []) if p not in layout.key_files]
    bias_key = layout.bias_keys.get(name)
    if bias_key is not None:
        plan.append((bias_key, bias_key, "bias"))
        if name in layout.own_keys and f"{name}.bias" != bias_key:
            # Untying can also untie the bias (BERT's decoder.bias <-> predictions.bias): give the
            # layer's own bias key the edited value too, so both aliases agree however it loads.
            plan.append((f"{name}.bias", bias_key, "bias"))
    return plan


def edited_tensors(
    edit: LayerEdit, layout: ModelLayout, original: Callable[[str], torch.Tensor]
) -> dict[str, torch.Tensor]:
    """Checkpoint key -> new value for one layer's edit (see :func:`edit_plan`).

    Args:
        edit: the layer's new parameters.
        layout: the base checkpoint's layout.
        original: reads a base tensor by checkpoint key.
    """
    out: dict[str, torch.Tensor] = {}
    for key, base_key, role in edit_plan(edit.spec, layout):
        if role == "partner":
            out[key] = original(base_key).clone()
        elif role == "weight":
            out[key] = edit.weight
        elif edit.bias is not None:  # a second bias alias gets its own copy (no shared storage)
            out[key] = edit.bias if key == base_key else edit.bias.clone()
    return out


def _shard_of(key: str, layout: ModelLayout, spec: LayerSpec) -> str:
    """Where a written key lives: its own shard, or (a new, untied key) its weight's shard."""
    return layout.key_files.get(key) or layout.key_files[layout.weight_keys[spec.name]]


def _layers_touching(shard: str, layout: ModelLayout) -> list[LayerSpec]:
    """Layers with their weight or bias in ``shard`` (a layer split over two shards is in both)."""
    def touches(spec: LayerSpec) -> bool:
        keys = [layout.weight_keys[spec.name], layout.bias_keys.get(spec.name)]
        return any(key is not None and layout.key_files[key] == shard for key in keys)

    return [spec for spec in layout.layers if touches(spec)]


class _LayerValues:
    """Computes one layer's edit when its first tensor is written, and forgets the previous layer's."""

    def __init__(
        self,
        edit_layer: Callable[[LayerSpec], LayerEdit | None],
        layout: ModelLayout,
        reader: CheckpointReader,
        on_compute: Callable[[LayerSpec], None] | None = None,
    ) -> None:
        self.edit_layer, self.layout, self.reader, self.on_compute = edit_layer, layout, reader, on_compute
        self._name: str | None = None
        self._values: dict[str, torch.Tensor] = {}

    def value(self, spec: LayerSpec, key: str, base_key: str) -> torch.Tensor:
        if self._name != spec.name:
            edit = self.edit_layer(spec)
            self._name = spec.name
            self._values = {} if edit is None else edited_tensors(edit, self.layout, self.reader.tensor)
            if self.on_compute is not None:
                self.on_compute(spec)
        # A layer whose edit came out empty (scale 0) keeps its base values under the planned keys.
        return self._values[key] if key in self._values else self.reader.tensor(base_key)


def _all_entries(source: Path) -> dict[str, TensorEntry]:
    entries: dict[str, TensorEntry] = {}
    for shard in weight_files(source):
        entries.update(read_header(source / shard)[0])
    return entries


def write_checkpoint(
    source: Path,
    target: Path,
    layout: ModelLayout,
    edit_layer: Callable[[LayerSpec], LayerEdit | None],
    edited: Collection[str],
    on_layer: Callable[[], None] | None = None,
) -> None:
    """Write a loadable checkpoint directory with the edited layers, streaming tensor by tensor.

    Each shard's header is written first (an edit keeps dtypes and shapes), then its tensors:
    the edited layers' in layout order, each computed only when written, then every other tensor
    copied byte for byte from the source. Memory: one layer's edit, never a shard.

    Args:
        source: the base model directory.
        target: an empty directory to fill.
        layout: the base model's layout.
        edit_layer: computes one layer's edit (``None``: it turned out unchanged).
        edited: names of the layers to edit (they decide the keys, before any edit is computed).
        on_layer: progress callback, once per edited layer.
    """
    entries = _all_entries(source)
    shard = ""

    def progress(spec: LayerSpec) -> None:  # a layer split over two shards counts in its weight's
        if on_layer is not None and layout.key_files[layout.weight_keys[spec.name]] == shard:
            on_layer()

    values = _LayerValues(edit_layer, layout, CheckpointReader(source, layout), progress)
    new_keys: dict[str, str] = {}
    for shard in weight_files(source):
        shard_entries, metadata = read_header(source / shard)
        planned: list[Planned] = []
        for spec in (s for s in _layers_touching(shard, layout) if s.name in edited):
            for key, base_key, _role in edit_plan(spec, layout):
                if _shard_of(key, layout, spec) != shard:
                    continue  # written with the shard that holds it
                if key not in layout.key_files:
                    new_keys[key] = shard
                produce = partial(values.value, spec, key, base_key)
                planned.append(Planned(key, entries[base_key], source / shard, produce))
        claimed = {item.key for item in planned}
        planned += [Planned(key, entry, source / shard) for key, entry in shard_entries.items() if key not in claimed]
        write_streaming(target / shard, planned, {**metadata, "format": "pt"})
    _copy_side_files(source, target, bool(new_keys), new_keys)


def _copy_side_files(source: Path, target: Path, untied: bool, new_keys: dict[str, str]) -> None:
    for file in source.iterdir():
        if not file.is_file() or file.suffix in PICKLE_SUFFIXES or file.suffix == ".safetensors":
            continue
        if file.name == "config.json" and untied:
            config = json.loads(file.read_text())
            config["tie_word_embeddings"] = False
            (target / file.name).write_text(json.dumps(config, indent=2))
        elif file.name == INDEX_FILE and new_keys:
            index = json.loads(file.read_text())
            index["weight_map"].update(new_keys)
            (target / file.name).write_text(json.dumps(index, indent=2))
        else:
            shutil.copyfile(file, target / file.name)


def write_delta(
    source: Path,
    target_file: Path,
    layout: ModelLayout,
    edit_layer: Callable[[LayerSpec], LayerEdit | None],
    edited: Collection[str],
    metadata: dict[str, str],
    on_layer: Callable[[], None] | None = None,
) -> None:
    """Write only the changed tensors (their new values, under checkpoint keys) to one file,
    streaming layer by layer like :func:`write_checkpoint`.

    Loading: read the base model, then ``model.load_state_dict(delta, strict=False)``; when the
    metadata says ``untied``, untie the embeddings first (``config.tie_word_embeddings = False``).
    """
    entries = _all_entries(source)
    values = _LayerValues(edit_layer, layout, CheckpointReader(source, layout), on_layer and (lambda _spec: on_layer()))
    planned: dict[str, Planned] = {}
    for spec in (s for s in layout.layers if s.name in edited):
        for key, base_key, _role in edit_plan(spec, layout):
            produce = partial(values.value, spec, key, base_key)
            planned.setdefault(key, Planned(key, entries[base_key], source, produce))
    untied = any(key not in layout.key_files for key in planned)
    write_streaming(target_file, list(planned.values()), {**metadata, "untied": json.dumps(untied)})
