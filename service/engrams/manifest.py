"""A built universe's manifest (``universes/<id>/manifest.json``) as a frozen record.

It lives on the engrams' floor, below universes, because it is what the engram readers need: each
member's engram key and per-layer norms, and each layer's ``‖W_l‖_F`` (W-Norm's ``ρ_l``).

The universe job writes it last (:mod:`service.universes.build`): the universe is built exactly when
it exists. Every reader goes through :func:`read_manifest`, which checks it once; nobody reads it by
string key.

Its version is the ``format`` field it always carried (``engram-universe/1``, also hashed into the
universe's ID by :meth:`~service.universes.spec.UniverseSpec.identity`), not a separate
``format_version``: a manifest of another format is refused by name, and a universe whose manifest
is refused is deleted (``DELETE /universes/{id}``) and built again. The stored JSON keeps the keys
it always had (:meth:`UniverseManifest.to_json`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, ValidationError

from service.errors import ServiceUnavailable, first_validation_error

# The universe format: the manifest's version, and part of every universe's identity (its ID).
UNIVERSE_FORMAT = "engram-universe/1"


class _Record(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class ManifestMember(_Record):
    """A member's statistics, the names it had when the universe was built and its engram file's key."""

    names: tuple[str, ...]
    stats: str  # statistics prefix
    dataset_digest: str
    key: str  # engrams/<key>.safetensors, and its entry in ``engrams``
    tokens: int


class ManifestGroup(_Record):
    """An input group's pseudo-inverse factors: their shape, size and who computed them how.

    ``source``, ``worker`` and ``seconds`` are absent in a group published before part records were kept.
    """

    layers: tuple[str, ...]
    dim: int
    rank: int
    explicit: bool
    bytes: int
    source: str | None = None
    worker: str | None = None
    seconds: float | None = None


class ManifestLayer(_Record):
    """A layer with engrams: its input group, the engrams' dtype and ``‖W_l‖_F`` (W-Norm's denominator)."""

    group: str
    dtype: str
    weight_norm: float


class ManifestEngram(_Record):
    """A member's engram file: its size and each layer's ``‖E_k,l[:, :in]‖_F``."""

    bytes: int
    norms: dict[str, float]


class ManifestBytes(_Record):
    groups: int
    engrams: int
    total: int


class UniverseManifest(_Record):
    """What a built universe holds: members, input groups, layers, engram norms, bytes, build seconds."""

    format: Literal["engram-universe/1"] = "engram-universe/1"  # UNIVERSE_FORMAT
    universe_id: str
    model_id: str
    model_digest: str
    rcond: float | None
    members: tuple[ManifestMember, ...]
    groups: dict[str, ManifestGroup]
    layers: dict[str, ManifestLayer]
    engrams: dict[str, ManifestEngram]
    bytes: ManifestBytes
    seconds: dict[str, float]
    created_at: str

    def to_json(self) -> dict[str, Any]:
        """The stored form: the keys manifests always had (a group's absent origin stays absent)."""
        return self.model_dump(mode="json", exclude_unset=True)

    @property
    def member_prefixes(self) -> list[str]:
        """The members' statistics prefixes, sorted."""
        return [m.stats for m in self.members]

    def member_key(self, prefix: str) -> str | None:
        """The engram key of the member with statistics ``prefix`` (None: not a member)."""
        return next((m.key for m in self.members if m.stats == prefix), None)

    def engram_norm(self, member_key: str, layer: str) -> float:
        return self.engrams[member_key].norms[layer]

    def weight_norm(self, layer: str) -> float:
        return self.layers[layer].weight_norm


class MalformedManifest(ServiceUnavailable):
    """A stored universe manifest this version cannot read (another format, or fields missing or wrong)."""

    def __init__(self, universe_id: str, why: str) -> None:
        super().__init__(
            f"the manifest of universe {universe_id} cannot be read ({why}): delete the universe "
            f"(DELETE /universes/{universe_id}) and request it again to rebuild it"
        )


def read_manifest(universe_id: str, data: Mapping[str, Any]) -> UniverseManifest:
    """The stored manifest of ``universe_id`` as a record.

    Raises:
        MalformedManifest: it is of another format, not a manifest, or another universe's.
    """
    found = data.get("format")
    if found != UNIVERSE_FORMAT:
        raise MalformedManifest(universe_id, f"format {found!r}, not {UNIVERSE_FORMAT!r}")
    try:
        manifest = UniverseManifest.model_validate(data)
    except ValidationError as exc:
        raise MalformedManifest(universe_id, first_validation_error(exc)) from exc
    if manifest.universe_id != universe_id:
        raise MalformedManifest(universe_id, f"it names universe {manifest.universe_id}")
    return manifest
