"""A model's registration (``models/<quoted id>.json``) as a frozen record: its layout parsed once."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, PlainSerializer

from service.engine.layout import ModelLayout
from service.engine.model_files import FileIdentity
from service.models.stored import FORMAT_VERSION


def _parse_layout(value: Any) -> ModelLayout:
    return value if isinstance(value, ModelLayout) else ModelLayout.from_json(value)


# Stored as the layout's JSON; held parsed, so that no reader parses it again.
StoredLayout = Annotated[ModelLayout, BeforeValidator(_parse_layout), PlainSerializer(lambda layout: layout.to_json())]


class ModelRecord(BaseModel):
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
            through its image processor), ``"text"`` for every other model
            (:func:`service.engine.image_models.model_kind`); ``"text"`` in a registration made before kinds.
    """

    model_config = ConfigDict(frozen=True, extra="forbid", arbitrary_types_allowed=True)

    format_version: int = FORMAT_VERSION
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

    def to_json(self) -> dict[str, Any]:
        return self.model_dump(mode="json")
