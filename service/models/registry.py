"""Models: reading registrations (:mod:`service.models.inspection` writes them) and the file fingerprint.

A registration is ``models/<quoted id>.json``: the source, the resolved folder, the content digest
of the files the service uses, their identity (size, mtime, inode and ctime of each, taken through the
descriptors the digest was read through: what every job compares, instead of hashing again; the
older ``fingerprint`` is sizes and mtimes only) and the checkpoint's layout (its editable layers).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from service.context import Context
from service.engine.chat import folder_has_chat_template
from service.engine.model_files import FileIdentity, ModelSourceError, open_model_files, used_files
from service.errors import InvalidInput, NotFound
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


def registered_identity(manifest: dict[str, Any]) -> dict[str, FileIdentity] | None:
    """The identity of each file recorded at registration; ``None`` for a registration made before
    identities were recorded (or one whose record is not readable: it is then checked by content)."""
    recorded = manifest.get("identity")
    if not isinstance(recorded, dict) or not recorded:
        return None
    identity = {name: FileIdentity.from_json(value) for name, value in recorded.items()}
    if any(value is None for value in identity.values()):
        return None
    return {name: value for name, value in identity.items() if value is not None}


def files_changed(manifest: dict[str, Any]) -> bool:
    """Whether a ``file://`` model's files are no longer the ones registered (their identities; only
    the index is read). Posting the same registration again then registers the folder anew, which
    is what a job failing with "re-register the model" asks for. A remote source's registration
    (its private copies are checked where they lie) and one without recorded identities never are.
    """
    registered = registered_identity(manifest)
    if registered is None or not str(manifest.get("source", "")).startswith("file://"):
        return False
    path = Path(manifest["path"])
    try:
        if path.resolve() != path:
            return True
        with open_model_files(path) as files:
            files.check(registered)
    except (ModelSourceError, OSError):
        return True
    return False


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


def check_causal_lm(model: dict[str, Any], what: str) -> None:
    """A 422 before any job when the registered model does not predict the next token (a masked or
    encoder model), as recorded at registration; a model registered before that was recorded is
    checked by the job itself when it loads the model."""
    if model["layout"].get("causal_lm") is False:
        raise InvalidInput(
            f"{what} need a model that predicts the next token; model {model['model_id']} is a "
            f"{model['architecture']} (a masked-language or encoder model)"
        )
