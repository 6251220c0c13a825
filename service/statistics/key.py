"""Where a concept's statistics live: the one spelling of their storage prefix and file names.

``stats/<model digest>/<dataset digest>/<settings digest>/`` holds ``statistics.safetensors`` (the
sums, :mod:`service.engine.stats_io`'s format) and ``manifest.json`` (written last: the statistics
exist exactly when it does). The settings digest is :meth:`service.statistics.spec.CollectionSpec.digest`.
Stored records (concepts, universes, variant requests) keep the prefix as a string: :meth:`StatsKey.parse`
reads it back, and :func:`statistics_key` / :func:`manifest_key` name its files.
"""

from __future__ import annotations

from dataclasses import dataclass

STATS = "stats/"
STATISTICS_FILE = "statistics.safetensors"
MANIFEST_FILE = "manifest.json"


@dataclass(frozen=True)
class StatsKey:
    """The three digests that address one concept's statistics on one model."""

    model_digest: str
    dataset_digest: str
    settings_digest: str

    def __post_init__(self) -> None:
        for name, value in (
            ("model", self.model_digest),
            ("dataset", self.dataset_digest),
            ("settings", self.settings_digest),
        ):
            if not value or "/" in value:
                raise ValueError(f"a statistics key's {name} digest must be one non-empty path segment, not {value!r}")

    @property
    def prefix(self) -> str:
        """``stats/<model>/<dataset>/<settings>/``: the folder of the statistics' files."""
        return f"{STATS}{self.model_digest}/{self.dataset_digest}/{self.settings_digest}/"

    @property
    def statistics(self) -> str:
        return statistics_key(self.prefix)

    @property
    def manifest(self) -> str:
        return manifest_key(self.prefix)

    @classmethod
    def parse(cls, prefix: str) -> StatsKey:
        """The key of a stored prefix (``stats/<model>/<dataset>/<settings>/``, the trailing slash optional).

        Raises:
            ValueError: ``prefix`` is not a statistics prefix.
        """
        parts = prefix.rstrip("/").split("/")
        if len(parts) != 4 or parts[0] + "/" != STATS:
            raise ValueError(f"{prefix!r} is not a statistics prefix (stats/<model>/<dataset>/<settings>/)")
        return cls(parts[1], parts[2], parts[3])


def statistics_key(prefix: str) -> str:
    """The statistics file of the statistics at ``prefix``."""
    return prefix + STATISTICS_FILE


def manifest_key(prefix: str) -> str:
    """The manifest of the statistics at ``prefix`` (written last: they exist exactly when it does)."""
    return prefix + MANIFEST_FILE
