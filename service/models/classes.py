"""An image classifier's classes as its ``config.json`` names them, read without loading the model.

The API process is torch-free: it reads the registered folder's ``config.json`` (``id2label``), never
the weights. Both the concept submission (a record's label) and an evaluation's image probes are
checked against these classes before a job starts.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from service.engine.model_files import ModelSourceError, read_side_json
from service.models.record import ModelRecord


def model_classes(model: ModelRecord) -> dict[int, str] | None:
    """The model's classes (``config.json``'s ``id2label``, ids as ints), or None when this process
    cannot read its folder (a remote registration's copy lives with the workers: the job checks)."""
    try:
        config = read_side_json(Path(model.path), "config.json")
    except (ModelSourceError, OSError):
        return None
    return classes_of_config(config)


def classes_of_config(config: Mapping[str, Any]) -> dict[int, str]:
    """``id2label`` with int ids; transformers' default (``num_labels`` classes ``LABEL_i``, 2 when
    unset) when the config has none."""
    labels = config.get("id2label")
    if isinstance(labels, dict) and labels:
        return {int(k): str(v) for k, v in labels.items()}
    count = int(config.get("num_labels") or 2)
    return {i: f"LABEL_{i}" for i in range(count)}
