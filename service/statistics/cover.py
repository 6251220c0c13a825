"""What published statistics cover: the layers each holds, those no forward pass reached, and the
check that refuses an edit needing a layer some member's statistics lack (their headers:
:func:`service.statistics.manifest.stats_header`)."""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence

from service.context import Context
from service.engine.layers import LayerSpec, select_layers, summarize_names
from service.engine.layout import ModelLayout
from service.errors import Conflict
from service.statistics.manifest import StatisticsManifest, has_stats_header, stats_header, stats_manifest


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
    members = list(members)
    selected = select_layers(layout.layers, modules, layers)
    unreached = unreached_by_every(ctx, [prefix for _, prefix in members])
    check_cover_of(ctx, layout, members, selected, unreached)


def check_cover_of(
    ctx: Context,
    layout: ModelLayout,
    members: Iterable[tuple[str, str]],
    selected: Sequence[LayerSpec],
    unreached: Collection[str],
) -> None:
    """:func:`check_statistics_cover` of an edit whose layers are already selected (a variant's plan).

    Args:
        selected: the edit's selected layers; ``unreached``: those no member's statistics reached.

    Raises:
        Conflict: naming each concept and the layers it has no statistics for.
    """
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
            collected = manifest.modules
            how = f" (collected with modules {', '.join(collected)})" if collected else ""
            problems.append(f"concept {name} has no statistics for {summarize_names(missing)}{how}")
    if problems:
        raise Conflict(
            f"the edit needs layers that its concepts' statistics lack: {'; '.join(problems)}. Choose modules/layers "
            "they cover, or post the concept with modules that include those layers"
        )


def statistics_layers(ctx: Context, prefix: str, manifest: StatisticsManifest | None, layout: ModelLayout) -> frozenset[str]:
    """The layers a published statistics file holds: those its ``modules`` selected minus the ones
    collection could not read (``lacking``), when the manifest's count says exactly that. Otherwise
    (statistics published before ``lacking`` was recorded, or collected from a layout of another
    version with other layers) they are read from the file's header (a few kilobytes)."""
    chosen = select_layers(layout.layers, manifest.modules if manifest is not None else None)
    if manifest is not None and manifest.lacking is not None and manifest.layers is not None:
        lacking = set(manifest.lacking)
        if manifest.layers + len(lacking) == len(chosen):
            return frozenset(spec.name for spec in chosen) - lacking
    return frozenset(stats_header(ctx, prefix).layer_group)


def unreached_by_every(ctx: Context, prefixes: Iterable[str]) -> frozenset[str]:
    """The layers no forward pass of these statistics ever ran (a vision tower, for text concepts).

    Their statistics are zero in every member, so the engram of every member is zero there: an edit
    leaves them as they are, and says so (a variant's ``unreached_layers``) instead of refusing.
    Statistics not published yet reach everything (the edit is refused elsewhere until they are).
    """
    common: frozenset[str] | None = None
    for prefix in dict.fromkeys(prefixes):
        if not has_stats_header(ctx, prefix) and stats_manifest(ctx, prefix) is None:
            return frozenset()
        unreached = stats_header(ctx, prefix).unreached
        common = unreached if common is None else common & unreached
    return common or frozenset()
