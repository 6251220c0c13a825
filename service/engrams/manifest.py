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

from collections.abc import Mapping, Sequence
from typing import Any, Literal

from pydantic import ValidationError

from service.engine.errors import EditError
from service.errors import ServiceUnavailable, first_validation_error
from service.storage.records import StoredRecord

# The universe format: the manifest's version, and part of every universe's identity (its ID).
UNIVERSE_FORMAT = "engram-universe/1"


class ManifestMember(StoredRecord):
    """A member's statistics, the names it had when the universe was built and its engram file's key."""

    names: tuple[str, ...]
    stats: str  # statistics prefix
    dataset_digest: str
    key: str  # engrams/<key>.safetensors, and its entry in ``engrams``
    tokens: int


class ManifestGroup(StoredRecord):
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


class ManifestLayer(StoredRecord):
    """A layer with engrams: its input group, the engrams' dtype and ``‖W_l‖_F`` (W-Norm's denominator)."""

    group: str
    dtype: str
    weight_norm: float


class ManifestEngram(StoredRecord):
    """A member's engram file(s): their size and each layer's ``‖E_k,l[:, :in]‖_F``.

    ``files``: engram file name (``engrams/<name>.safetensors``) -> the layers it holds, where the
    member's engrams were written in several stages (a request's layers first, the rest later:
    :mod:`service.universes.build`); absent, one file ``engrams/<key>.safetensors`` holds every layer.
    """

    bytes: int
    norms: dict[str, float]
    files: dict[str, tuple[str, ...]] | None = None


class ManifestBytes(StoredRecord):
    groups: int
    engrams: int
    total: int


class GroupNotBuilt(EditError):
    """A layer of a universe whose input group is not built yet (a partial universe's deferred group):
    a job that reads it fails naming both (it should have built the group first)."""

    def __init__(self, universe_id: str, layer: str, group: str) -> None:
        self.layer, self.group = layer, group
        super().__init__(
            f"layer {layer} of universe {universe_id}: its input group {group} is not built yet (deferred); "
            "a request that edits it builds it first"
        )


class UniverseManifest(StoredRecord):
    """What a built universe holds: members, input groups, layers, engram norms, bytes, build seconds.

    ``deferred``: the input groups not built yet. Never stored in ``manifest.json`` (written only when
    every group is built, so the universe exists exactly when it does): a *partial* manifest is what a
    build stage stores (``stages/<stage>.json``, its own groups and layers, the others deferred) and what
    :func:`service.universes.build.ensure_universe` answers a request that needs only some layers.
    """

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
    deferred: dict[str, tuple[str, ...]] = {}  # group not built yet -> its layers

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
        self.require_layer(layer)
        return self.engrams[member_key].norms[layer]

    def weight_norm(self, layer: str) -> float:
        self.require_layer(layer)
        return self.layers[layer].weight_norm

    @property
    def partial(self) -> bool:
        """Some input group is not built yet (a stage's manifest, or the union of stages so far)."""
        return bool(self.deferred)

    def require_layer(self, layer: str) -> None:
        """Refuse by name a layer whose input group is deferred (a ``KeyError`` for a layer the
        universe never holds).

        Raises:
            GroupNotBuilt: the layer's group is deferred.
        """
        if layer in self.layers:
            return
        group = self.deferred_group_of(layer)
        if group is not None:
            raise GroupNotBuilt(self.universe_id, layer, group)

    def deferred_group_of(self, layer: str) -> str | None:
        """The deferred group ``layer`` belongs to (None: its group is built, or it has none here)."""
        return next((g for g, layers in self.deferred.items() if layer in layers), None)

    def engram_file(self, member_key: str, layer: str) -> str:
        """The name of the engram file (``engrams/<name>.safetensors``) holding ``layer`` of a member.

        Raises:
            GroupNotBuilt: the layer's group is deferred.
            KeyError: not a member, or a layer this universe never holds.
        """
        self.require_layer(layer)
        files = self.engrams[member_key].files
        if not files:
            return member_key
        return next(name for name, layers in files.items() if layer in layers)


class MalformedManifest(ServiceUnavailable):
    """A stored universe manifest this version cannot read (another format, or fields missing or wrong)."""

    def __init__(self, universe_id: str, why: str) -> None:
        super().__init__(
            f"the manifest of universe {universe_id} cannot be read ({why}): delete the universe "
            f"(DELETE /universes/{universe_id}) and request it again to rebuild it"
        )


def read_manifest(universe_id: str, data: Mapping[str, Any], *, partial: bool = False) -> UniverseManifest:
    """The stored manifest of ``universe_id`` as a record.

    Args:
        partial: a build stage's manifest (``stages/<stage>.json``), which may defer groups; a
            ``manifest.json`` (the default) that defers any is refused: it would pass a partial
            universe for a built one.

    Raises:
        MalformedManifest: it is of another format, not a manifest, another universe's, or partial
            where a whole one is read.
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
    if manifest.deferred and not partial:
        raise MalformedManifest(universe_id, f"it is partial: group(s) {', '.join(sorted(manifest.deferred))} not built")
    return manifest


def merge_stages(
    universe_id: str, stages: Sequence[UniverseManifest], groups: Mapping[str, Sequence[str]], layers: Sequence[str]
) -> UniverseManifest:
    """The universe as its build stages together hold it: their groups, layers and engram files; the
    plan's other groups deferred (none: the whole universe, what ``manifest.json`` stores).

    Args:
        stages: the stored stages' manifests (at least one). Two requests that needed overlapping
            groups at once may both have built a group's layers (the group itself once, through its
            lease): a layer is then read from the first stage's file, and both files' bytes count.
        groups: the plan's input groups -> their layers; ``layers``: the plan's layers in layout order.
    """
    first = stages[0]
    built = {g: info for stage in stages for g, info in stage.groups.items()}
    held = {name: info for stage in stages for name, info in stage.layers.items()}
    engrams: dict[str, dict[str, Any]] = {}
    for stage in stages:
        for key, engram in stage.engrams.items():
            merged = engrams.setdefault(key, {"bytes": 0, "norms": {}, "files": {}})
            merged["bytes"] += engram.bytes
            merged["norms"].update(engram.norms)
            merged["files"].update(engram.files or {key: tuple(n for n in layers if n in engram.norms)})
    for key, merged in engrams.items():
        if list(merged["files"]) == [key]:
            del merged["files"]  # one file, named as a universe built at once names it
    seconds: dict[str, float] = {}
    for stage in stages:
        for step, value in stage.seconds.items():
            seconds[step] = round(seconds.get(step, 0.0) + value, 3)
    group_bytes = sum(info.bytes for info in built.values())
    engram_bytes = sum(int(e["bytes"]) for e in engrams.values())
    deferred = {g: tuple(names) for g, names in groups.items() if g not in built}
    return UniverseManifest.model_validate(
        {
            **first.model_dump(include={"universe_id", "model_id", "model_digest", "rcond", "members"}),
            "format": UNIVERSE_FORMAT,
            "groups": {g: built[g].model_dump(exclude_unset=True) for g in groups if g in built},
            "layers": {n: held[n].model_dump() for n in layers if n in held},
            "engrams": engrams,
            "bytes": {"groups": group_bytes, "engrams": engram_bytes, "total": group_bytes + engram_bytes},
            "seconds": seconds,
            "created_at": max(stage.created_at for stage in stages),
            **({"deferred": deferred} if deferred else {}),  # a whole universe's manifest keeps its keys
        }
    )
