"""A member's engram files: one holding every layer, or, for a universe built in stages
(:mod:`service.universes.build`), one per stage, each fetched only when a layer of it is read."""

from __future__ import annotations

from pathlib import Path

from service.context import Context
from service.engrams.manifest import UniverseManifest
from service.storage.keys import engram_key
from service.storage.local_copies import local_object


class MemberFiles:
    """A member's engrams written in several files (a universe built in stages): layer -> its file,
    fetched (downloaded off a remote store) only when a layer of it is read."""

    def __init__(self, ctx: Context, manifest: UniverseManifest, member: str) -> None:
        self.ctx, self.manifest, self.member = ctx, manifest, member
        self._local: dict[str, Path] = {}

    def __call__(self, layer: str) -> Path:
        """The local file holding ``layer``.

        Raises:
            GroupNotBuilt: the layer's input group is deferred (not built yet).
        """
        name = self.manifest.engram_file(self.member, layer)
        if name not in self._local:
            self._local[name] = local_object(self.ctx, engram_key(self.manifest.universe_id, name))
        return self._local[name]


# A term's engrams: one file holding every layer, or a member's files of a universe built in stages.
EngramFile = Path | MemberFiles


def layer_file(engrams: EngramFile, layer: str) -> Path:
    """The local file holding ``layer`` of a term's engrams."""
    return engrams if isinstance(engrams, Path) else engrams(layer)
