"""Models: registering a checkpoint (its layout, digest and file fingerprint) and reading registrations.

A registration is ``models/<quoted id>.json``: the source, the resolved folder, the content digest
of the files the service uses, their sizes and mtimes (a cheap check that they did not change under
us) and the checkpoint's layout (its editable layers).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from service.context import Context
from service.engine.chat import folder_has_chat_template
from service.engine.checkpoint import directory_digest, inspect_model_dir
from service.engine.model_files import ModelSourceError, used_files
from service.errors import Conflict, InvalidInput, NotFound
from service.jobs.store import utc_now
from service.models.sources import local_model_dir
from service.storage.keys import MODELS, model_key


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


def register_model(ctx: Context, model_id: str, source: str) -> tuple[dict[str, Any], bool]:
    """Register a checkpoint; returns (manifest, created). Same registration twice is a no-op."""
    existing = find_model(ctx, model_id)
    if existing is not None:
        if existing["source"] != source:
            raise Conflict(f"model {model_id} is already registered with source {existing['source']}")
        return existing, False
    path = local_model_dir(source, ctx.settings.model_root_paths, ctx.cache_dir, ctx.settings.s3_endpoint_url)
    try:
        # Refuses links leading out of the folder and shard names that are not plain file names
        # in it (service.engine.model_files), before any of those files is opened.
        layout = inspect_model_dir(path)
        digest, fingerprint = directory_digest(path), file_fingerprint(path)
    except ModelSourceError as exc:
        raise InvalidInput(str(exc)) from None
    if not layout.layers:
        raise InvalidInput("the model has no editable Linear or Conv1D layers in its safetensors weights")
    manifest = {
        "model_id": model_id,
        "source": source,
        "path": str(path),
        "digest": digest,
        "fingerprint": fingerprint,
        "architecture": layout.architecture,
        "num_parameters": layout.num_parameters,
        "layout": layout.to_json(),
        "registered_at": utc_now(),
    }
    with ctx.lock:
        again = find_model(ctx, model_id)
        if again is not None:
            return register_model(ctx, model_id, source)
        ctx.storage.put_json(model_key(model_id), manifest)
    return manifest, True


def find_model(ctx: Context, model_id: str) -> dict[str, Any] | None:
    return ctx.storage.find_json(model_key(model_id))


def get_model(ctx: Context, model_id: str) -> dict[str, Any]:
    manifest = find_model(ctx, model_id)
    if manifest is None:
        raise NotFound(f"model {model_id} is not registered")
    return manifest


def list_models(ctx: Context) -> list[dict[str, Any]]:
    return [ctx.storage.get_json(k) for k in ctx.storage.list(MODELS) if k.endswith(".json")]


def model_view(manifest: dict[str, Any]) -> dict[str, Any]:
    layers = [{k: spec[k] for k in ("name", "in_features", "out_features", "bias")} for spec in manifest["layout"]["layers"]]
    keys = ("model_id", "source", "digest", "architecture", "num_parameters")
    unstored = manifest["layout"].get("unstored_layers", [])
    return {**{k: manifest[k] for k in keys}, "layers": layers, "layers_not_in_checkpoint": unstored}


def check_chat_templates(manifests: dict[str, dict[str, Any]], why: str) -> None:
    """Refuse (422) a model whose registered folder ships no chat template, read from its allowlisted
    tokenizer files (no tokenizer or model is loaded). A folder this process cannot read is left to
    the job, which fails saying the same.
    """
    for model_id, manifest in manifests.items():
        if folder_has_chat_template(Path(manifest.get("path", ""))) is False:
            raise InvalidInput(
                f"model {model_id} has no chat template (chat_template.jinja, or chat_template in "
                f"tokenizer_config.json), which {why} need"
            )
