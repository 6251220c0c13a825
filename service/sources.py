"""Where model checkpoints come from: ``file://`` (inside ENGRAM_MODEL_ROOTS) and ``hf://``."""

from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import unquote, urlparse

from service.errors import InvalidInput

HF_PATTERN = re.compile(r"^hf://([A-Za-z0-9._-]+(?:/[A-Za-z0-9._-]+)?)(?:@([A-Za-z0-9._/-]+))?$")
# Only what a variant needs: weights, configs, tokenizer. Pickle files are never fetched.
HF_ALLOW = ["*.json", "*.safetensors", "*.txt", "*.model", "*.jinja", "tokenizer*"]


def local_model_dir(source: str, model_roots: list[Path], cache_dir: Path) -> Path:
    """The local directory holding the checkpoint named by ``source``.

    Raises:
        InvalidInput: unknown scheme, a path outside the allowed roots, an unreachable hub.
    """
    scheme = urlparse(source).scheme
    if scheme == "file":
        return _file_source(source, model_roots)
    if scheme == "hf":
        return _hf_source(source, cache_dir)
    if scheme == "s3":
        raise InvalidInput("s3:// model sources need the S3 storage backend, which is not configured")
    raise InvalidInput(f"source must be file:///abs/dir, s3://bucket/prefix/ or hf://org/name, got {source!r}")


def _file_source(source: str, model_roots: list[Path]) -> Path:
    parsed = urlparse(source)
    if parsed.netloc not in {"", "localhost"}:
        raise InvalidInput(f"file:// sources must be local paths, got host {parsed.netloc!r}")
    raw = unquote(parsed.path)
    if "\x00" in raw:
        raise InvalidInput("file:// source contains a NUL byte")
    if not raw.startswith("/") or ".." in Path(raw).parts:
        raise InvalidInput(f"file:// source must be an absolute path without '..', got {raw!r}")
    path = Path(raw).resolve()  # symlinks resolved: a link must not lead out of the roots
    if not any(path == root or root in path.parents for root in model_roots):
        roots = ", ".join(str(r) for r in model_roots) or "none configured"
        raise InvalidInput(f"{path} is outside ENGRAM_MODEL_ROOTS ({roots})")
    if not path.is_dir():
        raise InvalidInput(f"{path} is not a directory")
    return path


def _hf_source(source: str, cache_dir: Path) -> Path:
    match = HF_PATTERN.match(source)
    if match is None:
        raise InvalidInput(f"hf:// source must be hf://org/name[@revision], got {source!r}")
    repo_id, revision = match.group(1), match.group(2)
    try:
        from huggingface_hub import snapshot_download

        path = snapshot_download(
            repo_id, revision=revision, allow_patterns=HF_ALLOW, cache_dir=str(cache_dir / "hf")
        )
    except Exception as exc:  # the hub client raises many types (offline, 404, gated)
        raise InvalidInput(f"cannot fetch {repo_id} from the Hugging Face hub: {exc}") from None
    return Path(path)
