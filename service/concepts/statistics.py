"""A concept's statistics on a model: what enters their key, and what a published statistics file holds.

Statistics live at ``stats/<model digest>/<dataset digest>/<settings digest>/``
(:func:`service.storage.keys.stats_prefix`); the collection job (:mod:`service.concepts.collection`)
publishes ``statistics.safetensors`` and then ``manifest.json``: they exist exactly when the
manifest does.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from typing import Any

from service.config import Settings
from service.context import Context
from service.engine.layers import select_layers, summarize_names
from service.engine.layout import ModelLayout
from service.errors import Conflict
from service.storage.keys import ENGINE_VERSION, canonical_digest


def collection_settings(
    settings: Settings,
    modules: Sequence[str] | None = None,
    template: str | None = None,
    layout: ModelLayout | None = None,
) -> dict[str, Any]:
    """Everything that changes a statistic (and so is part of its key).

    Args:
        modules: the module suffixes a concept was posted with (only their input groups are
            collected); part of the key only when given, so keys without them stay as they were.
        template: ``"chat"``: prompt/completion records rendered as one-turn chats; part of the
            key only when set.
        layout: the model's layout. The collected layers enter the key when they include a layer
            stored under a renamed key (``renamed_layers``): versions before those were edited
            collected the same model without it, and a key shared with such statistics would reuse
            them, short of that layer. Other keys stay as they were.
    """
    chosen: dict[str, Any] = {"max_length": settings.max_length, "engine": ENGINE_VERSION}
    if modules is not None:
        chosen["modules"] = canonical_modules(modules)
    if layout is not None and layout.renamed_layers:
        collected = [spec.name for spec in select_layers(layout.layers, modules)]
        if set(collected) & set(layout.renamed_layers):
            chosen["layers"] = canonical_digest(collected)
    if template is not None:
        chosen["template"] = template
    # Only when not the default, so existing keys stay valid.
    if settings.stats_dtype != "float64":
        chosen["stats_dtype"] = settings.stats_dtype
    if settings.collect_dtype != "stored":  # the activations, and so Σ, depend on it
        chosen["collect_dtype"] = settings.collect_dtype
    return chosen


def canonical_modules(modules: Sequence[str]) -> list[str]:
    """A module selection in the form that enters a statistics key: sorted, each suffix once."""
    return sorted(set(modules))


def stats_manifest(ctx: Context, prefix: str) -> dict[str, Any] | None:
    return ctx.reads.immutable_json(prefix + "manifest.json")  # content-addressed: written once


def check_statistics_cover(
    ctx: Context,
    layout: ModelLayout,
    members: Iterable[tuple[str, str]],
    modules: Sequence[str] | None,
    layers: Sequence[int] | None,
) -> None:
    """Refuse an edit that needs a layer some member's statistics lack (collected with ``modules``,
    or a layer collection could not read).

    Args:
        layout: the model's layout.
        members: ``(concept name, statistics prefix)`` of every concept of the edit's universe.
        modules, layers: the edit's selection.

    Raises:
        Conflict: naming each concept and the layers it has no statistics for.
    """
    selected = select_layers(layout.layers, modules, layers)
    unreached = unreached_by_every(ctx, [prefix for _, prefix in members])
    needed = [spec for spec in selected if spec.name not in unreached]
    if selected and not needed:
        raise Conflict(
            f"no concept of the edit reaches the selected layers ({summarize_names(s.name for s in selected)}): "
            "their forward pass never ran them, so their edit is zero; choose modules/layers the concepts reach"
        )
    problems = []
    for name, prefix in sorted(set(members)):
        manifest = stats_manifest(ctx, prefix)
        if manifest is None:
            continue  # not ready: refused by name where the universe is resolved
        held = statistics_layers(ctx, prefix, manifest, layout)
        missing = [spec.name for spec in needed if spec.name not in held]
        if missing:
            collected = manifest.get("settings", {}).get("modules")
            how = f" (collected with modules {', '.join(collected)})" if collected else ""
            problems.append(f"concept {name} has no statistics for {summarize_names(missing)}{how}")
    if problems:
        raise Conflict(
            f"the edit needs layers that its concepts' statistics lack: {'; '.join(problems)}. Choose modules/layers "
            "they cover, or post the concept with modules that include those layers"
        )


_STATS_LAYERS: dict[str, frozenset[str]] = {}  # statistics prefix -> its layers (statistics never change)


def statistics_layers(ctx: Context, prefix: str, manifest: dict[str, Any], layout: ModelLayout) -> frozenset[str]:
    """The layers a published statistics file holds: those its ``modules`` selected minus the ones
    collection could not read (``lacking``), when the manifest's count says exactly that. Otherwise
    (statistics published before ``lacking`` was recorded, or collected from a layout of another
    version with other layers) they are read from the file's header (a few kilobytes)."""
    chosen = select_layers(layout.layers, manifest.get("settings", {}).get("modules"))
    lacking = set(manifest.get("lacking", ()))
    if "lacking" in manifest and int(manifest.get("layers", -1)) + len(lacking) == len(chosen):
        return frozenset(spec.name for spec in chosen) - lacking
    if prefix not in _STATS_LAYERS:
        _STATS_LAYERS[prefix] = frozenset(_header_metadata(ctx, prefix + "statistics.safetensors")["layer_group"])
    return _STATS_LAYERS[prefix]


_UNREACHED: dict[str, frozenset[str]] = {}  # statistics prefix -> its unreached layers


def unreached_by_every(ctx: Context, prefixes: Iterable[str]) -> frozenset[str]:
    """The layers no forward pass of these statistics ever ran (a vision tower, for text concepts).

    Their statistics are zero in every member, so the engram of every member is zero there: an edit
    leaves them as they are, and says so (a variant's ``unreached_layers``) instead of refusing.
    Statistics not published yet reach everything (the edit is refused elsewhere until they are).
    """
    common: frozenset[str] | None = None
    for prefix in dict.fromkeys(prefixes):
        if prefix not in _UNREACHED:
            if stats_manifest(ctx, prefix) is None:
                return frozenset()
            metadata = _header_metadata(ctx, prefix + "statistics.safetensors")
            _UNREACHED[prefix] = frozenset(json.loads(metadata.get("unreached", "[]")))
        common = _UNREACHED[prefix] if common is None else common & _UNREACHED[prefix]
    return common or frozenset()


def _header_metadata(ctx: Context, key: str) -> dict[str, Any]:
    """A stored safetensors file's metadata (JSON values decoded), read by range: its header only."""
    length = int.from_bytes(b"".join(ctx.storage.iter_range(key, 0, 7)), "little")
    header = json.loads(b"".join(ctx.storage.iter_range(key, 8, 8 + length - 1)))
    return {k: json.loads(v) if k == "layer_group" else v for k, v in (header.get("__metadata__") or {}).items()}
