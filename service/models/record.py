"""A model's registration (``models/<quoted id>.json``) as a frozen record: its layout parsed once.

Its stored format is version 2 (:data:`MODEL_FORMAT_VERSION`): version 1, and 0.1.0's records
without a version, may lack ``kind``, which a reader must not guess (an image classifier registered
before kinds existed would read as text and be fed text). Readers refuse them by name; ``engram-service
migrate`` (:mod:`service.models.migrate`) records the kind registration gives the folder
(:func:`folder_kind`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BeforeValidator, ConfigDict, PlainSerializer

from service.engine.image_models import PREPROCESSOR_CONFIG, ModelKind, check_preprocessor_config, model_kind
from service.engine.layout import ModelLayout
from service.engine.model_file_descriptors import FileIdentity
from service.engine.model_files import ModelSourceError, read_side_json
from service.models.gguf_source import GgufOrigin
from service.storage.records import StoredRecord

# 1: the first versioned registration; 2: ``kind`` is always recorded (issue 25).
MODEL_FORMAT_VERSION = 2


def _parse_layout(value: Any) -> ModelLayout:
    return value if isinstance(value, ModelLayout) else ModelLayout.from_json(value)


# Stored as the layout's JSON; held parsed, so that no reader parses it again.
StoredLayout = Annotated[ModelLayout, BeforeValidator(_parse_layout), PlainSerializer(lambda layout: layout.to_json())]


class ModelRecord(StoredRecord):
    """A registered checkpoint.

    Attributes:
        path: the resolved folder (a remote source's: this machine's private copy).
        digest: the content digest of the files the service uses.
        file_sha256: each file's digest (names the file whose content changed).
        identity: each file's (size, mtime, inode, ctime) as registered; None in a registration
            made before identities were recorded (they are recorded at its first check).
        fingerprint: sizes and mtimes, what workers older than identities read.
        layout: the checkpoint's editable layers, parsed once when the record is read.
        kind: what its records are: ``"image"`` for an image classifier (it reads ``pixel_values``
            through its image processor), ``"text"`` for every other model (:func:`folder_kind`).
    """

    model_config = ConfigDict(frozen=True, extra="forbid", arbitrary_types_allowed=True)

    record_name: ClassVar[str] = "model registration"
    # ``gguf`` only where there is one: a safetensors registration keeps its stored keys
    absent_when_none: ClassVar[frozenset[str]] = frozenset({"gguf"})

    format_version: int = MODEL_FORMAT_VERSION
    model_id: str
    source: str
    path: str
    digest: str
    file_sha256: dict[str, str] | None = None
    identity: dict[str, list[int]] | None = None
    fingerprint: dict[str, list[int]] | None = None
    architecture: str
    kind: Literal["text", "image"] = "text"
    num_parameters: int
    layout: StoredLayout
    registered_at: str | None = None
    gguf: GgufOrigin | None = None  # the GGUF file ``path`` was dequantized from (service.models.gguf_source)

    @property
    def is_local(self) -> bool:
        return self.source.startswith("file://")

    def registered_identity(self) -> dict[str, FileIdentity] | None:
        """The identity of each file recorded at registration; None when none was recorded (or one
        is not readable: the files are then checked by content)."""
        if not self.identity:
            return None
        identity = {name: FileIdentity.from_json(value) for name, value in self.identity.items()}
        if any(value is None for value in identity.values()):
            return None
        return {name: value for name, value in identity.items() if value is not None}


def folder_kind(path: Path) -> ModelKind:
    """The kind registration records for a model folder: what its ``config.json`` says
    (:func:`service.engine.image_models.model_kind`); an image model's ``preprocessor_config.json``
    must say how to read an image (the register job also loads the processor, which needs transformers).

    Raises:
        ModelSourceError: ``config.json`` is not readable, or an image model's processor config is
            missing or unusable (the message names the file).
    """
    config = read_side_json(path, "config.json")
    if not isinstance(config, dict):
        raise ModelSourceError("config.json is not a JSON object")
    kind = model_kind(config)
    if kind == "image":
        has_processor = (path / PREPROCESSOR_CONFIG).is_file()
        check_preprocessor_config(read_side_json(path, PREPROCESSOR_CONFIG) if has_processor else None, config)
    return kind
