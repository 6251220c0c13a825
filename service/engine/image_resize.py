"""What an image processor's resize makes of an image, told from the processor's settings and the
image's header, before any pixel is decoded.

An image classifier's processor (``preprocessor_config.json``) resizes every image before it
normalises it, and what that costs is not the image's pixel count: a ``shortest_edge`` resize (the
ConvNeXT processor that ResNets ship) keeps the aspect ratio, so a 1 × 2,000,000 strip of 6 KB
becomes 18 × 36,000,000 on the way to a 16 × 16 crop and took 6.2 GB (measured, 2026-11-29); and
Pillow resizes the horizontal pass first, so a tall strip resized to a fixed ``height × width``
passes through ``width_out × height_in`` pixels. :class:`ResizePath` reads the processor's settings
(``do_resize``, ``size``, ``crop_pct``) and :meth:`ResizePath.path_pixels` gives the most pixels an
image's resize holds at once, so the caller can refuse what would cost more than a bound.

The sizes follow transformers' rules (``get_resize_output_image_size``, ConvNeXT's ``crop_pct``):
``{"height", "width"}`` is that size; ``{"shortest_edge"}`` scales the shorter side to it (to
``shortest_edge / crop_pct`` below 384 when the processor has a ``crop_pct``, a square at 384 and
over); ``{"shortest_edge", "longest_edge"}`` and ``{"longest_edge"}`` cap the longer side;
``{"max_height", "max_width"}`` fits the image inside. A size this module does not know, or
``do_resize`` false, is taken as no resize: the image's own pixels, which its pixel bound limits.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# transformers' SizeDict keys read here (the processor's ``size``: a SizeDict, a dict or an int).
_KEYS = ("height", "width", "shortest_edge", "longest_edge", "max_height", "max_width")
# ConvNeXT's rule: a shortest edge under this is resized to shortest_edge / crop_pct, then cropped.
_CROP_PCT_BELOW = 384


@dataclass(frozen=True)
class ResizePath:
    """How a processor resizes: whether it does, its ``size`` entries and its ``crop_pct``."""

    do_resize: bool
    size: tuple[tuple[str, int], ...]
    crop_pct: float | None = None

    @classmethod
    def of(cls, processor: Any) -> ResizePath:
        """The resize settings of a loaded image processor (attributes it lacks: none)."""
        return cls(
            bool(getattr(processor, "do_resize", True)),
            # transformers image processors: each class has its own subset of these settings
            _size_entries(getattr(processor, "size", None)),
            _positive_float(getattr(processor, "crop_pct", None)),
        )

    def output(self, width: int, height: int) -> tuple[int, int]:
        """The ``(width, height)`` the processor resizes a ``width × height`` image to."""
        size = dict(self.size)
        if not self.do_resize:
            return width, height
        if "height" in size and "width" in size:
            return size["width"], size["height"]
        if "shortest_edge" in size:
            return self._shortest_edge(width, height, size["shortest_edge"], size.get("longest_edge"))
        if "longest_edge" in size:
            return _fit(width, height, size["longest_edge"], size["longest_edge"])
        if "max_height" in size and "max_width" in size:
            return _fit(width, height, size["max_width"], size["max_height"])
        return width, height

    def path_pixels(self, width: int, height: int) -> int:
        """The most pixels one image holds at once on its way through the resize: the decoded image,
        Pillow's horizontal pass (the output's width at the input's height), and the output."""
        out_width, out_height = self.output(width, height)
        return max(width * height, out_width * height, out_width * out_height)

    def _shortest_edge(self, width: int, height: int, edge: int, longest: int | None) -> tuple[int, int]:
        if self.crop_pct is not None and longest is None:
            if edge >= _CROP_PCT_BELOW:
                return edge, edge
            edge = int(edge / self.crop_pct)
        short, long = min(width, height), max(width, height)
        new_short, new_long = edge, int(edge * long / max(short, 1))
        if longest is not None and new_long > longest:
            new_short, new_long = int(longest * new_short / new_long), longest
        return (new_short, new_long) if width <= height else (new_long, new_short)


def _fit(width: int, height: int, max_width: int, max_height: int) -> tuple[int, int]:
    """The largest size of the image's aspect within ``max_width × max_height``."""
    scale = min(max_width / max(width, 1), max_height / max(height, 1))
    return max(1, int(width * scale)), max(1, int(height * scale))


def _size_entries(size: Any) -> tuple[tuple[str, int], ...]:
    """A processor's ``size`` as ``(key, positive int)`` pairs (an int ``n`` is ``n × n``)."""
    if isinstance(size, int) and not isinstance(size, bool) and size > 0:
        return (("height", size), ("width", size))
    entries = []
    for key in _KEYS:
        # transformers' SizeDict: only the keys its processor uses are set
        value = size.get(key) if isinstance(size, dict) else getattr(size, key, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            entries.append((key, value))
    return tuple(entries)


def _positive_float(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) and value > 0 else None
