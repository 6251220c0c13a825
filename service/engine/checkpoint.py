"""Hugging Face model directories: their layout (which layers can be edited, where their weights
are stored: :class:`~service.engine.layout.ModelLayout`, inspected here), their digest, loading the
model and tokenizer, and reading single tensors.

Only safetensors weights are ever read; pickle weights and remote code are refused, because either
would run code a user sent us. Only the files :mod:`service.engine.model_files` names are read from a
model folder (side files from one allowlist, shards by checked plain names), each resolved and
checked to lie inside the folder first; see that module for the symlink policy. What a folder must
hold to be read at all is checked by :mod:`service.engine.model_checks`; variants are written by
:mod:`service.engine.checkpoint_write`.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO

import torch
from safetensors import safe_open
from torch import nn

from service.engine.compose import LayerWeights
from service.engine.editable import editable_layers, refused_layers
from service.engine.expert_keys import expert_storage, read_expert_slice
from service.engine.experts import find_fused_experts, unsupported_experts
from service.engine.key_renames import renamed_parameters
from service.engine.layers import LayerSpec, summarize_names
from service.engine.layout import ModelLayout, is_causal_lm
from service.engine.model_checks import check_weight_dtypes, validate_model_dir
from service.engine.model_file_descriptors import (
    ModelFiles,
    as_model_files,
    clean_view,
    model_files_of,
    open_model_files,
    open_without_links,
)
from service.engine.model_files import (
    PICKLE_SUFFIXES,
    ModelSourceError,
    allowed_dirs,
    check_links,
    check_shard_name,
    check_tokenizer_config,
    open_file,
    resolve_file,
)
from service.engine.safetensors_stream import read_header

if TYPE_CHECKING:  # transformers is imported where a model or tokenizer is built, not by importers
    import transformers

_HASH_CHUNK = 8 * 1024 * 1024


def directory_digest(path: Path, every_file: bool = False) -> str:
    """sha256 over the names and contents of the files the service uses from a model folder
    (:func:`~service.engine.model_files.used_files`: side files and shards, each checked to lie
    inside the folder), read through descriptors opened once (:func:`files_digest`).

    Args:
        path: the model folder.
        every_file: hash every top-level regular, non-pickle file that lies inside the folder
            instead, as registrations made before the allowlist did (links leading out are still
            refused, never read): only to recognise such a registration's digest.

    Raises:
        ModelSourceError: a used file breaks a rule of :mod:`service.engine.model_files`.
    """
    if not every_file:
        with open_model_files(path) as files:
            return files_digest(files)
    check_links(path)
    dirs = allowed_dirs(path)
    outer = hashlib.sha256()
    for entry in sorted(path.iterdir()):
        if entry.suffix in PICKLE_SUFFIXES or not entry.is_file():
            continue
        real = resolve_file(path, entry.name, dirs)
        fd = open_without_links(real, entry.name)
        with open(fd, "rb") as handle:
            outer.update(entry.name.encode() + b"\0" + _sha256_of(handle).encode() + b"\n")
    return outer.hexdigest()


def files_digest(files: ModelFiles) -> str:
    """sha256 over the names and contents of opened model files, read through their descriptors:
    the registration's digest."""
    return combined_digest(file_digests(files))


def file_digests(files: ModelFiles) -> dict[str, str]:
    """Each opened model file's sha256, read through its descriptor, by name."""
    sums = {}
    for name in files.names:
        with files.open(name) as handle:
            sums[name] = _sha256_of(handle)
    return sums


def combined_digest(sums: Mapping[str, str]) -> str:
    """The folder's digest from its files' (:func:`file_digests`), in name order."""
    outer = hashlib.sha256()
    for name in sorted(sums):
        outer.update(name.encode() + b"\0" + sums[name].encode() + b"\n")
    return outer.hexdigest()


def file_sha256(path: Path, nofollow: bool = False) -> str:
    """sha256 of a file's bytes (``nofollow``: ``path`` is resolved and must not be a link now)."""
    with open_file(path) if nofollow else path.open("rb") as handle:
        return _sha256_of(handle)


def _sha256_of(handle: BinaryIO) -> str:
    digest = hashlib.sha256()
    while chunk := handle.read(_HASH_CHUNK):
        digest.update(chunk)
    return digest.hexdigest()


def model_class(config: Mapping[str, Any]) -> type[transformers.PreTrainedModel] | type[transformers.AutoModel]:
    """The transformers class named by ``architectures``, else ``AutoModel``, which picks one itself."""
    import transformers

    for name in config.get("architectures") or []:
        # a class name from config.json: transformers may not have it (a newer architecture, a typo)
        cls = getattr(transformers, name, None)
        if isinstance(cls, type) and issubclass(cls, transformers.PreTrainedModel):
            return cls
    return transformers.AutoModel


def _empty_model(
    cls: type[transformers.PreTrainedModel] | type[transformers.AutoModel], config: transformers.PretrainedConfig
) -> transformers.PreTrainedModel:
    """The model of ``config`` (built under the caller's device context: ``meta``, no memory)."""
    import transformers

    if issubclass(cls, transformers.PreTrainedModel):
        model: transformers.PreTrainedModel = cls._from_config(config)  # type: ignore[no-untyped-call]  # untyped in transformers
    else:  # model_class's fallback: AutoModel picks the class from the config
        model = transformers.AutoModel.from_config(config)  # type: ignore[no-untyped-call]  # untyped in transformers
    return model


def inspect_model_dir(source: Path | ModelFiles) -> ModelLayout:
    """Validate a checkpoint and describe its editable layers without reading its weights.

    The model is built on the ``meta`` device (no memory) to learn its module tree and which
    parameters are tied; checkpoint keys come from the safetensors headers. Everything is read
    through the opened files (a folder is opened here, after its rules are checked by name).
    """
    if isinstance(source, Path):
        validate_model_dir(source)  # by name first: a folder's first problem is named as users expect
    with model_files_of(source) as files:
        return _inspect(files)


def _inspect(files: ModelFiles) -> ModelLayout:
    import transformers

    config_dict = validate_model_dir(files.folder, files)
    try:
        with clean_view(files) as view:
            config = transformers.AutoConfig.from_pretrained(str(view), trust_remote_code=False)
        cls = model_class(config_dict)
        with torch.device("meta"):
            model = _empty_model(cls, config)
    except ModelSourceError:
        raise
    except Exception as exc:  # transformers raises many types for unsupported configs
        raise ModelSourceError(f"transformers cannot build this model: {exc}") from None
    experts = unsupported_experts(model)
    if experts:
        raise ModelSourceError(
            f"mixture-of-experts layers in a layout the service does not edit: {summarize_names(experts)} "
            "cannot be edited, and an edit of the other layers alone would leave every expert unchanged; "
            "register a model whose experts are fused gate_up_proj [E, 2I, H] / down_proj [E, H, I] (transformers 5), "
            "or a dense model"
        )
    if getattr(config, "is_encoder_decoder", False):
        raise ModelSourceError(
            f"{type(model).__name__} is an encoder-decoder model, which the service does not edit: a concept's "
            "statistics come from one stream of tokens, and an encoder-decoder model reads two (its decoder "
            "needs targets of its own); register a decoder-only (causal LM) or an encoder-only model"
        )
    key_files = _checkpoint_keys(files)
    shapes = _stored_shapes(files)
    renamed = renamed_parameters(model, shapes)
    layout = _layout(model, key_files, renamed)
    layout.causal_lm = is_causal_lm(model)
    layout.refused_layers = refused_layers(model)  # shown, never edited (a grouped conv)
    _add_expert_layers(layout, model, shapes, renamed)
    in_checkpoint = {spec.name: layout.weight_keys[spec.name] for spec in layout.layers}
    check_weight_dtypes(files, in_checkpoint, key_files, [spec.name for spec in editable_layers(model)])
    return layout


def _checkpoint_keys(files: ModelFiles) -> dict[str, str]:
    """Every checkpoint key -> the shard holding it.

    Raises:
        ModelSourceError: an unreadable shard, or a tensor stored in two shards: transformers would
            load one copy and a variant would edit (or copy) each, so the two would disagree.
    """
    key_files: dict[str, str] = {}
    for name in files.shards:
        try:
            with safe_open(str(files.path(name)), framework="pt") as handle:
                keys = list(handle.keys())  # noqa: SIM118
        except Exception as exc:
            raise ModelSourceError(f"{name} is not a readable safetensors file: {exc}") from None
        for key in keys:
            if key in key_files:
                raise ModelSourceError(
                    f"the tensor {key!r} is stored in two shards, {key_files[key]} and {name}; a checkpoint "
                    "must store each tensor once: remove one copy (and fix model.safetensors.index.json)"
                )
            key_files[key] = name
    return key_files


def _stored_shapes(files: ModelFiles) -> dict[str, list[int]]:
    """Every checkpoint key -> its stored shape, from the safetensors headers (no tensor is read)."""
    return {key: entry.shape for name in files.shards for key, entry in read_header(files.path(name))[0].items()}


def _layout(model: nn.Module, key_files: dict[str, str], renamed: Mapping[str, str]) -> ModelLayout:
    """The editable layers whose weight (and bias) the checkpoint stores, under their parameter's
    name, a tied partner's, or a name transformers renames on load (``renamed``); the others are
    listed in ``unstored_layers``, never dropped unsaid."""
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

    def stored_key(names: list[str]) -> str | None:
        direct = next((n for n in names if n in key_files), None)
        return direct if direct is not None else next((renamed[n] for n in names if n in renamed), None)

    for spec in editable_layers(model):
        module = modules[spec.name]
        names = aliases[id(module.weight)]
        stored = stored_key(names)
        bias_key = stored_key(aliases[id(module.bias)]) if spec.bias else None
        if stored is None or (spec.bias and bias_key is None):
            # transformers initialises such a layer at random on load: there is no weight to edit.
            layout.unstored_layers.append(spec.name)
            continue
        if stored not in names:
            layout.renamed_layers.append(spec.name)
        own = f"{spec.name}.weight"
        if len(names) > 1:
            layout.own_keys[spec.name] = own
            layout.tied_partners[spec.name] = [n for n in names if n != own]
        if bias_key is not None:
            layout.bias_keys[spec.name] = bias_key
        layout.weight_keys[spec.name] = stored
        layout.layers.append(spec)
    return layout


def _add_expert_layers(
    layout: ModelLayout,
    model: transformers.PreTrainedModel,
    shapes: Mapping[str, list[int]],
    renamed: Mapping[str, str],
) -> None:
    """Each expert of every fused experts module as layers of its own, in module order, with the key
    (and for a fused key, the slice) holding its weight (:mod:`service.engine.experts`)."""
    experts = find_fused_experts(model)
    if not experts:
        return
    storage = expert_storage(model, experts, shapes, renamed)
    order = {name: index for index, (name, _) in enumerate(model.named_modules())}
    specs = [spec for module in experts for spec in module.layer_specs()]
    position = {spec.name: order[spec.name.rsplit(".", 2)[0]] for spec in specs}
    layout.layers = sorted([*layout.layers, *specs], key=lambda spec: position.get(spec.name, order.get(spec.name, 0)))
    layout.weight_keys.update(storage.weight_keys)
    layout.expert_slices.update(storage.slices)


def load_model(
    source: Path | ModelFiles,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | None = None,
    untie: bool = False,
    device_map: str | dict[str, Any] | None = None,
    max_memory: dict[Any, Any] | None = None,
) -> nn.Module:
    """Load a validated checkpoint (safetensors only, no remote code).

    transformers sees only the checked files, through their descriptors
    (:func:`~service.engine.model_file_descriptors.clean_view`).

    Args:
        source: the checkpoint directory, or its files opened by a job.
        device: where the model goes (ignored with a ``device_map``).
        dtype: override of the stored dtype.
        untie: load with ``tie_word_embeddings=False`` (a delta variant that edited a tied head
            carries the head's new values; the embedding stays as it was).
        device_map: accelerate's placement (``"auto"``: the GPUs in order, then the CPU, each
            module's weights where it runs or offloaded to the CPU); ``None``: all on ``device``.
            A placement that would need disk offload is refused by transformers (no offload folder).
        max_memory: with ``device_map``, accelerate's per-device budget (``{0: "10GiB", "cpu": …}``).
    """
    with model_files_of(source) as files:
        return _load_model(files, device, dtype, untie, device_map, max_memory)


def _load_model(
    files: ModelFiles,
    device: str | torch.device,
    dtype: torch.dtype | None,
    untie: bool,
    device_map: str | dict[str, Any] | None,
    max_memory: dict[Any, Any] | None,
) -> nn.Module:
    config = validate_model_dir(files.folder, files)
    cls = model_class(config)
    kwargs: dict[str, Any] = {"use_safetensors": True, "trust_remote_code": False}
    if dtype is not None:
        kwargs["dtype"] = dtype
    if untie:
        kwargs["tie_word_embeddings"] = False
    if device_map is not None:
        kwargs["device_map"] = device_map
        if max_memory is not None:
            kwargs["max_memory"] = max_memory
    with clean_view(files) as view:
        model: nn.Module = cls.from_pretrained(str(view), **kwargs)
    # set by accelerate only on a model loaded with a device_map
    devices = set((getattr(model, "hf_device_map", None) or {}).values())
    if "disk" in devices:
        # Disk-offloaded weights would be read at each forward through the private view, gone now.
        raise ModelTooLarge(
            "the model does not fit the GPUs and CPU memory of this worker (accelerate's device_map "
            "would offload part of it to disk, which collection does not do); use a worker with more memory"
        )
    placed = model if device_map is not None else model.to(device)
    return placed.eval()


class ModelTooLarge(RuntimeError):
    """A ``device_map`` placement that would need disk offload."""


def load_tokenizer(source: Path | ModelFiles) -> transformers.PreTrainedTokenizerBase:
    """The checkpoint's tokenizer, read from the checked files only, through their descriptors (no
    remote code)."""
    import transformers

    with model_files_of(source) as files:
        check_tokenizer_config(files.folder, files)
        with clean_view(files) as view:
            return transformers.AutoTokenizer.from_pretrained(str(view), trust_remote_code=False)


# The files transformers builds a tokenizer from: a folder with none of them (weights for variants
# only) registers without a tokenizer.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "tokenizer.model",
    "spiece.model",
    "sentencepiece.bpe.model",
)
_VIEW_PATH = re.compile(r"\S*engram-model-view-\w+")


def check_tokenizer(files: ModelFiles) -> None:
    """Load the folder's tokenizer once, when it ships one: one transformers cannot build (broken
    files, a class it lacks) is then refused at registration, not the failure of every later job.

    Raises:
        ModelSourceError: transformers' error, with the private view's path replaced.
    """
    if not any(files.has(name) for name in TOKENIZER_FILES):
        return
    try:
        load_tokenizer(files)
    except ModelSourceError:
        raise
    except Exception as exc:  # transformers and tokenizers raise many types for broken files
        detail = _VIEW_PATH.sub("the model folder", f"{type(exc).__name__}: {exc}")[:500]
        raise ModelSourceError(f"transformers cannot load the tokenizer: {detail}") from None


class CheckpointReader:
    """Reads single tensors of a checkpoint by key.

    Each read maps the shard only while it copies the tensor out: a mapping kept open would leave
    every page read so far resident in this process, a whole model's worth after one variant.
    Shards are read through the descriptors of :class:`~service.engine.model_files.ModelFiles`
    (given, or opened once when the reader is made), never by their names in the folder.

    Raises:
        ModelSourceError: (at construction) a shard name or file that breaks a rule of
            :mod:`service.engine.model_files`.
    """

    def __init__(self, source: Path | ModelFiles, layout: ModelLayout) -> None:
        self.files = as_model_files(source)  # a job's checked files, or a folder's opened now
        self.path = self.files.folder
        self.layout = layout
        self._files = {name: self.files.path(check_shard_name(name)) for name in sorted(set(layout.key_files.values()))}

    def tensor(self, key: str) -> torch.Tensor:
        shard = self.layout.key_files[key]
        with safe_open(str(self._files[shard]), framework="pt") as handle:
            tensor: torch.Tensor = handle.get_tensor(key)
        self.files.check_unchanged(shard)  # not rewritten in place while it was read
        return tensor

    def stored_dtype(self, key: str) -> str:
        """A tensor's dtype as the file stores it (``F32``, ``BF16``, ``F64``…), from the header only."""
        with safe_open(str(self._files[self.layout.key_files[key]]), framework="pt") as handle:
            return str(handle.get_slice(key).get_dtype())

    def expert_slice(self, key: str, where: list[int]) -> torch.Tensor:
        """One expert's ``[out, in]`` weight from a fused experts key (``where``: expert, row range)."""
        shard = self.layout.key_files[key]
        with safe_open(str(self._files[shard]), framework="pt") as handle:
            sliced = read_expert_slice(handle, key, where)
        self.files.check_unchanged(shard)
        return sliced

    def layer_weights(self, spec: LayerSpec) -> LayerWeights:
        where = self.layout.expert_slices.get(spec.name)
        if where is not None:
            return LayerWeights(self.expert_slice(self.layout.weight_keys[spec.name], where), None)
        bias_key = self.layout.bias_keys.get(spec.name)
        return LayerWeights(
            self.tensor(self.layout.weight_keys[spec.name]),
            self.tensor(bias_key) if bias_key else None,
        )
