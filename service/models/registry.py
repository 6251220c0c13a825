"""Models: reading registrations (:mod:`service.models.inspection` writes them) and the file fingerprint.

A registration is ``models/<quoted id>.json``: the source, the resolved folder, the content digest
of the files the service uses, their identity (size, mtime, inode and ctime of each, taken through the
descriptors the digest was read through: what every job compares, instead of hashing again; the
older ``fingerprint`` is sizes and mtimes only) and the checkpoint's layout (its editable layers).
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from functools import partial
from pathlib import Path
from typing import Any
from urllib.parse import unquote

from pydantic import ValidationError

from api_schemas import Model
from api_schemas.provenance import CreationMetadata
from service.context import Context
from service.engine.chat import folder_has_chat_template
from service.engine.layers import LayerSpec
from service.engine.model_file_descriptors import open_model_files
from service.engine.model_files import ModelSourceError, used_files
from service.errors import InvalidInput, NotFound, first_validation_error
from service.models.gguf_source import gguf_change
from service.models.record import MODEL_FORMAT_VERSION, ModelRecord
from service.models.stored import check_format
from service.storage.keys import MODELS, model_key
from service.storage.stored_json import UnreadableRecord, find_record, skip_unreadable


def file_fingerprint(path: Path) -> dict[str, list[int]]:
    """Sizes and mtimes of the files the service uses from a model folder (side files and shards,
    each resolved and checked to lie inside the folder: nothing outside is ever looked at), a cheap
    check that they did not change under us.

    Raises:
        ModelSourceError: a used file breaks a rule of :mod:`service.engine.model_files` (a link
            leading out of the folder, a bad shard name).
    """
    stats = {name: real.stat() for name, real in used_files(path).items()}
    return {name: [st.st_size, st.st_mtime_ns] for name, st in stats.items()}


def files_changed(manifest: ModelRecord) -> bool:
    """Whether a ``file://`` model's files are no longer the ones registered (their identities; only
    the index is read). Posting the same registration again then registers the folder anew, which
    is what a job failing with "re-register the model" asks for. A remote source's registration
    (its private copies are checked where they lie) and one without recorded identities never are.
    """
    registered = manifest.registered_identity()
    if registered is None or not manifest.is_local:
        return False
    path = Path(manifest.path)
    if manifest.gguf is not None:
        if gguf_change(manifest.gguf) is not None:
            return True
        if not path.is_dir():  # dequantized in a worker's cache, not this machine's: the file decides
            return False
    try:
        if path.resolve() != path:
            return True
        with open_model_files(path) as files:
            files.check(registered)
    except (ModelSourceError, OSError):
        return True
    return False


def model_record(key: str, data: dict[str, Any]) -> ModelRecord:
    """A stored registration, read (refused when it is of an older format: ``engram-service migrate``,
    or its fields do not fit: :class:`UnreadableRecord`, naming the first)."""
    current = check_format("model registration", key, data, MODEL_FORMAT_VERSION)
    try:
        return ModelRecord.model_validate(current)
    except ValidationError as exc:
        raise UnreadableRecord(key, f"not a model registration ({first_validation_error(exc)})") from None


def find_model(ctx: Context, model_id: str) -> ModelRecord | None:
    """The registration (None: not registered).

    Raises:
        UnmigratedRecord: it is stored in an older format (``engram-service migrate``).
        UnreadableRecord: what is stored under its key is not a registration (named).
    """
    key = model_key(model_id)
    data = find_record(ctx.storage, key)
    return None if data is None else model_record(key, data)


def get_model(ctx: Context, model_id: str) -> ModelRecord:
    manifest = find_model(ctx, model_id)
    if manifest is None:
        close = difflib.get_close_matches(model_id, registered_model_ids(ctx), n=3)
        hint = f" (did you mean {' or '.join(close)}?)" if close else ""
        raise NotFound(
            f"model {model_id} is not registered{hint}; GET /models lists the registered models",
            extensions={"close_matches": {model_id: close}} if close else None,
        )
    return manifest


def registered_model_ids(ctx: Context) -> list[str]:
    """The IDs of every registration, from the keys alone (no record is read)."""
    return [unquote(key[len(MODELS) : -len(".json")]) for key in ctx.storage.list(MODELS) if key.endswith(".json")]


def list_models(ctx: Context) -> list[ModelRecord]:
    """Every readable registration; one that cannot be read is left out with a warning naming it
    (reading it by ID refuses it)."""
    found = (skip_unreadable(k, partial(_stored_model, ctx, k)) for k in ctx.storage.list(MODELS) if k.endswith(".json"))
    return [model for model in found if model is not None]


def _stored_model(ctx: Context, key: str) -> ModelRecord | None:
    """The registration under ``key`` (None: deleted since it was listed)."""
    data = find_record(ctx.storage, key)
    return None if data is None else model_record(key, data)


def model_view(manifest: ModelRecord) -> dict[str, Any]:
    layout = manifest.layout
    layers = [_layer_view(spec) for spec in layout.layers]
    keys = ("model_id", "source", "digest", "architecture", "num_parameters")
    return {
        **manifest.model_dump(include=set(keys)),
        "layers": layers,
        "layers_not_in_checkpoint": layout.unstored_layers,
        "refused_layers": dict(layout.refused_layers),
        "kind": manifest.kind,
        "quantization": manifest.gguf.quantization if manifest.gguf is not None else None,
    }


def model_answer(manifest: ModelRecord, metadata: CreationMetadata | None = None) -> Model:
    """The model as the routes answer it: the contract's :class:`~api_schemas.Model`, with who
    registered it, when and why (:func:`service.models.provenance.model_metadata`) when given."""
    shown = metadata.model_dump() if metadata is not None else {}
    return Model.model_validate({**model_view(manifest), **shown})


def _layer_view(spec: LayerSpec) -> dict[str, Any]:
    """A layer as the model view shows it: a convolution with its kernel (how it reads its input)."""
    view: dict[str, Any] = {"name": spec.name, "in_features": spec.in_features, "out_features": spec.out_features}
    view["bias"] = spec.bias
    if spec.kernel is not None:
        view["kernel"] = spec.kernel.to_json()
    return view


def check_chat_templates(manifests: Mapping[str, ModelRecord], why: str) -> None:
    """Refuse (422) a model whose registered folder ships no chat template, read from its allowlisted
    tokenizer files (no tokenizer or model is loaded). A folder this process cannot read is left to
    the job, which fails saying the same.
    """
    for model_id, manifest in manifests.items():
        if folder_has_chat_template(Path(manifest.path)) is False:
            raise InvalidInput(
                f"model {model_id} has no chat template (chat_template.jinja, or chat_template in "
                f"tokenizer_config.json), which {why} need"
            )


def check_causal_lm(model: ModelRecord, what: str) -> None:
    """A 422 before any job when the registered model does not predict the next token (a masked or
    encoder model), as recorded at registration; a model registered before that was recorded is
    checked by the job itself when it loads the model."""
    if model.layout.causal_lm is False:
        raise InvalidInput(
            f"{what} need a model that predicts the next token; model {model.model_id} is a "
            f"{model.architecture} (a masked-language or encoder model)"
        )
