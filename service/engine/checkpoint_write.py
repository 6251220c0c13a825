"""Writing a variant's checkpoint: the edited layers' tensors streamed into the checkpoint's own
layout (shards, keys, dtypes), every other tensor copied byte for byte, and the delta format (only
the changed tensors). :mod:`service.engine.checkpoint` reads and describes checkpoints.

A variant is written without loading the model: each safetensors shard is read, the edited tensors
are replaced, and the shard is written again, so at most one shard is in memory. Tied weights are
never edited by accident: when an edited layer shares its weight with another parameter
(``lm_head`` tied to ``embed_tokens``), the variant *unties* them, writing the edited head under
its own key and setting ``tie_word_embeddings: false``; the embedding keeps its original values.

Given a ``written`` record, each file is hashed as it is written (:class:`HashingSink`) and its size
and sha256 recorded under its name: a variant's manifest needs them, and reading the files back to
hash them would be a second pass over every byte.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Collection, Mapping
from functools import partial
from pathlib import Path
from typing import BinaryIO

import torch

from service.engine.checkpoint import CheckpointReader
from service.engine.compose import LayerEdit
from service.engine.expert_keys import fused_tensor_with_edits
from service.engine.layers import LayerSpec
from service.engine.layout import ModelLayout
from service.engine.model_file_descriptors import ModelFiles, model_files_of
from service.engine.model_files import INDEX_FILE, SIDE_FILES, target_file
from service.engine.safetensors_stream import (
    HashingSink,
    Planned,
    TensorEntry,
    WrittenFile,
    read_header,
    write_streaming,
)

_target_file = target_file  # write_delta's parameter of that name shadows it
_COPY_CHUNK = 8 << 20


class WrittenFiles(dict[str, WrittenFile]):
    """Each file written, by name (relative to the target): its size and sha256, as the sink its
    bytes were told to recorded them. :meth:`sink` makes a safetensors file's sink; a subclass can
    feed it to more than the hash (an upload of the file while it is written)."""

    def sink(self, name: str) -> HashingSink:
        """The sink ``name``'s bytes are told to as they are written."""
        return HashingSink()


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


def edited_tensors(edit: LayerEdit, layout: ModelLayout, original: Callable[[str], torch.Tensor]) -> dict[str, torch.Tensor]:
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

    # Experts held in fused keys are written by _expert_slice_plans, one fused tensor for them all.
    return [spec for spec in layout.layers if spec.name not in layout.expert_slices and touches(spec)]


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


def _shard_paths(files: ModelFiles) -> dict[str, Path]:
    """Shard name -> the path of its opened descriptor, in shard order."""
    return {shard: files.path(shard) for shard in files.shards}


def _all_entries(shards: Mapping[str, Path]) -> dict[str, TensorEntry]:
    entries: dict[str, TensorEntry] = {}
    for real in shards.values():
        entries.update(read_header(real)[0])
    return entries


def write_checkpoint(
    source: Path | ModelFiles,
    target: Path,
    layout: ModelLayout,
    edit_layer: Callable[[LayerSpec], LayerEdit | None],
    edited: Collection[str],
    on_layer: Callable[[], None] | None = None,
    written: WrittenFiles | None = None,
) -> None:
    """Write a loadable checkpoint directory with the edited layers, streaming tensor by tensor.

    Each shard's header is written first (an edit keeps dtypes and shapes), then its tensors:
    the edited layers' in layout order, each computed only when written, then every other tensor
    copied byte for byte from the source. Memory: one layer's edit, never a shard.

    Args:
        source: the base model directory, or its files opened by a job (read only through them).
        target: an empty directory to fill.
        layout: the base model's layout.
        edit_layer: computes one layer's edit (``None``: it turned out unchanged).
        edited: names of the layers to edit (they decide the keys, before any edit is computed).
        on_layer: progress callback, once per edited layer.
        written: given, each file written is recorded in it (name -> size and sha256, hashed as written).
    """
    with model_files_of(source) as files:
        _write_checkpoint(files, target, layout, edit_layer, edited, on_layer, written)


def _write_checkpoint(
    source: ModelFiles,
    target: Path,
    layout: ModelLayout,
    edit_layer: Callable[[LayerSpec], LayerEdit | None],
    edited: Collection[str],
    on_layer: Callable[[], None] | None,
    written: WrittenFiles | None,
) -> None:
    shards = _shard_paths(source)
    entries = _all_entries(shards)
    shard = ""

    def progress(spec: LayerSpec) -> None:  # a layer split over two shards counts in its weight's
        if on_layer is not None and layout.key_files[layout.weight_keys[spec.name]] == shard:
            on_layer()

    values = _LayerValues(edit_layer, layout, CheckpointReader(source, layout), progress)
    new_keys: dict[str, str] = {}
    for shard, real in shards.items():
        shard_entries, metadata = read_header(real)
        planned: list[Planned] = []
        for spec in (s for s in _layers_touching(shard, layout) if s.name in edited):
            for key, base_key, _role in edit_plan(spec, layout):
                if _shard_of(key, layout, spec) != shard:
                    continue  # written with the shard that holds it
                if key not in layout.key_files:
                    new_keys[key] = shard
                produce = partial(values.value, spec, key, base_key)
                planned.append(Planned(key, entries[base_key], real, produce))
        planned += _expert_slice_plans(shard_entries, real, layout, edit_layer, edited, values.reader, on_layer)
        claimed = {item.key for item in planned}
        planned += [Planned(key, entry, real) for key, entry in shard_entries.items() if key not in claimed]
        sink = None if written is None else written.sink(shard)
        write_streaming(target_file(target, shard), planned, {**metadata, "format": "pt"}, sink)
        if written is not None and sink is not None:
            written[shard] = sink.written()
    _copy_side_files(source, target, bool(new_keys), new_keys, written)
    # What was read must still be what was opened: a file rewritten in place during the write (a new
    # mtime or size; the descriptor sees the new bytes) fails the build instead of publishing a mix.
    source.check_unchanged()


def _copy_side_files(
    source: ModelFiles, target: Path, untied: bool, new_keys: dict[str, str], written: WrittenFiles | None = None
) -> None:
    """Copy the :data:`SIDE_FILES` the source has (only those: never a README or any other file),
    untying the config and adding the new keys to the index when the edit untied a weight."""
    for name in source.names:
        if name not in SIDE_FILES:
            continue  # a shard: written above
        out = target_file(target, name)
        sink = HashingSink()
        with out.open("xb") as dst:
            if name == "config.json" and untied:
                config = source.read_json(name)
                config["tie_word_embeddings"] = False
                _write_hashed(dst, json.dumps(config, indent=2).encode(), sink)
            elif name == INDEX_FILE and new_keys:
                index = source.read_json(name)
                index["weight_map"].update(new_keys)
                _write_hashed(dst, json.dumps(index, indent=2).encode(), sink)
            else:
                with source.open(name) as src:
                    while chunk := src.read(_COPY_CHUNK):
                        _write_hashed(dst, chunk, sink)
        if written is not None:
            written[name] = sink.written()


def _write_hashed(out: BinaryIO, data: bytes, sink: HashingSink) -> None:
    sink.update(data)
    out.write(data)


def write_delta(
    source: Path | ModelFiles,
    target_file: Path,
    layout: ModelLayout,
    edit_layer: Callable[[LayerSpec], LayerEdit | None],
    edited: Collection[str],
    metadata: dict[str, str],
    on_layer: Callable[[], None] | None = None,
    written: WrittenFiles | None = None,
) -> None:
    """Write only the changed tensors (their new values, under checkpoint keys) to one file,
    streaming layer by layer like :func:`write_checkpoint`.

    Loading: read the base model, then ``model.load_state_dict(delta, strict=False)``; when the
    metadata says ``untied``, untie the embeddings first (``config.tie_word_embeddings = False``).
    """
    with model_files_of(source) as files:
        entries = _all_entries(_shard_paths(files))
        reader = CheckpointReader(files, layout)
        values = _LayerValues(edit_layer, layout, reader, on_layer and (lambda _spec: on_layer()))
        planned = _delta_plan(files, entries, layout, edit_layer, edited, values, on_layer)
        untied = any(key not in layout.key_files for key in planned)
        out = _target_file(target_file.parent, target_file.name)  # refuses a path leaving its directory
        sink = None if written is None else written.sink(out.name)
        write_streaming(out, list(planned.values()), {**metadata, "untied": json.dumps(untied)}, sink)
        if written is not None and sink is not None:
            written[out.name] = sink.written()
        files.check_unchanged()  # as write_checkpoint: nothing rewritten in place meanwhile


def _delta_plan(
    files: ModelFiles,
    entries: Mapping[str, TensorEntry],
    layout: ModelLayout,
    edit_layer: Callable[[LayerSpec], LayerEdit | None],
    edited: Collection[str],
    values: _LayerValues,
    on_layer: Callable[[], None] | None,
) -> dict[str, Planned]:
    """The delta's tensors by key: each edited layer's (computed when written), then fused experts'."""
    planned: dict[str, Planned] = {}
    for spec in (s for s in layout.layers if s.name in edited and s.name not in layout.expert_slices):
        for key, base_key, _role in edit_plan(spec, layout):
            produce = partial(values.value, spec, key, base_key)
            # never copied (``produce`` is set): the source path is only the planned entry's origin
            planned.setdefault(key, Planned(key, entries[base_key], files.folder, produce))
    for item in _expert_slice_plans(entries, files.folder, layout, edit_layer, edited, values.reader, on_layer):
        planned[item.key] = item
    return planned


def _expert_slice_plans(
    entries: Mapping[str, TensorEntry],
    source: Path,
    layout: ModelLayout,
    edit_layer: Callable[[LayerSpec], LayerEdit | None],
    edited: Collection[str],
    reader: CheckpointReader,
    on_layer: Callable[[], None] | None,
) -> list[Planned]:
    """The fused experts keys among ``entries`` that hold edited experts, each produced as its stored
    tensor with those experts' slices replaced (every other expert byte for byte as stored).
    Memory: one fused tensor and one expert's edit."""
    held: dict[str, list[tuple[LayerSpec, list[int]]]] = {}
    for spec in layout.layers:
        where = layout.expert_slices.get(spec.name)
        if where is not None and spec.name in edited and layout.weight_keys[spec.name] in entries:
            held.setdefault(layout.weight_keys[spec.name], []).append((spec, where))

    def edited_weight(spec: LayerSpec) -> torch.Tensor | None:
        edit = edit_layer(spec)
        if on_layer is not None:
            on_layer()
        return None if edit is None else edit.weight

    def produce(key: str) -> torch.Tensor:
        return fused_tensor_with_edits(reader.tensor(key), held[key], edited_weight)

    return [Planned(key, entries[key], source, partial(produce, key)) for key in held]
