"""A built variant's manifest (``variants/<id>/manifest.json``) as a frozen record.

The variant job writes it last (:func:`service.variants.build.run_variant`): the variant is ready
exactly when it exists. Every reader (the variant's view, its file downloads, the evaluation job's
loader) goes through :func:`read_variant_manifest`, which checks it once; nobody reads it by string key.

It has no ``format_version``: it is content-addressed and written once, and its stored keys are
those it always had. The one older shape is read here, in this reader only: a variant built before
universes were stored (0.1.0) has no ``universe_id`` (None in the record; left absent when written
back). Anything else that is not a manifest is refused by name (:class:`MalformedVariantManifest`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import JsonValue, ValidationError

from service.errors import ServiceUnavailable, first_validation_error
from service.storage.records import StoredRecord


class VariantFile(StoredRecord):
    """One file of the variant, as uploaded: its path under the variant, size and SHA-256 (the ETag)."""

    path: str
    size: int
    sha256: str


class VariantManifest(StoredRecord):
    """What a built variant holds: its files, each layer's scale ``f_l``, build seconds, its universe.

    Attributes:
        universe_id: None for a variant built before universes were stored (0.1.0 wrote none).
        unreached_layers: selected layers no concept of the universe reached, written unchanged
            (absent in the stored form when there are none).
        lora: a peft adapter's report (:func:`service.engine.lora_files.adapter_report`), shown on
            the variant as it was written; None for the other formats.
    """

    variant_id: str
    files: tuple[VariantFile, ...]
    scales: dict[str, float]
    seconds: float
    universe_id: str | None = None
    unreached_layers: tuple[str, ...] = ()
    lora: dict[str, JsonValue] | None = None

    def to_json(self) -> dict[str, Any]:
        """The stored form: the keys manifests always had (no ``unreached_layers`` or ``lora`` when
        there are none, no ``universe_id`` in a manifest that had none)."""
        stored = self.model_dump(mode="json", exclude_unset=True)
        for optional in ("unreached_layers", "lora"):
            if not stored.get(optional):
                stored.pop(optional, None)
        return stored

    def file(self, path: str) -> VariantFile | None:
        """The listed file at ``path`` (None: the variant has no such file)."""
        return next((f for f in self.files if f.path == path), None)

    @property
    def file_views(self) -> list[dict[str, Any]]:
        """The files as the variant's view lists them."""
        return [f.model_dump(mode="json") for f in self.files]


class MalformedVariantManifest(ServiceUnavailable):
    """A stored variant manifest this version cannot read (fields missing or wrong, another variant's)."""

    def __init__(self, variant_id: str, why: str) -> None:
        super().__init__(
            f"the manifest of variant {variant_id} cannot be read ({why}): remove variants/{variant_id}/ from "
            "the store and request the variant again to rebuild it"
        )


def read_variant_manifest(variant_id: str, data: Mapping[str, Any]) -> VariantManifest:
    """The stored manifest of ``variant_id`` as a record.

    Raises:
        MalformedVariantManifest: it is not a variant manifest, or another variant's.
    """
    try:
        manifest = VariantManifest.model_validate(data)
    except ValidationError as exc:
        raise MalformedVariantManifest(variant_id, first_validation_error(exc)) from exc
    if manifest.variant_id != variant_id:
        raise MalformedVariantManifest(variant_id, f"it names variant {manifest.variant_id}")
    return manifest
