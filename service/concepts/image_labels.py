"""A concept's records checked against each listed model at submission: their kind, and for an
image classifier every label against the classes its ``config.json`` names.

Statistics ignore labels, but a job that met ``"zero"`` or ``99`` on a 10-class model would fail on
it after the concept was accepted; the submission refuses it instead, naming the first record with
that label (``record 3`` of an inline body, ``dataset line 4`` of an upload) and the model's classes.
A dataset reference's labels are read by its job (the API never reads the referenced data).
"""

from __future__ import annotations

from service.datasets.images import check_record_kinds, resolve_label
from service.datasets.spool import SpooledDataset
from service.errors import InvalidInput
from service.models.classes import model_classes
from service.models.record import ModelRecord


def check_records_for(dataset: SpooledDataset, model_id: str, model: ModelRecord) -> None:
    """Refuse records the model cannot read, or labels it does not have.

    Raises:
        InvalidInput: a record of the other kind (:func:`~service.datasets.images.check_record_kinds`);
            a label that is no class id or class name of an image model (naming the record, the
            model, its class ids and names). A model whose folder this process cannot read (a
            remote registration) is checked by the job.
    """
    check_record_kinds(dataset.first, model_id, model.kind)
    if model.kind != "image" or not dataset.labels:
        return
    classes = model_classes(model)
    if classes is None:
        return
    for label, where in dataset.labels.items():
        try:
            resolve_label(label, classes, where)
        except InvalidInput as exc:
            raise InvalidInput(
                f"{exc.detail.replace('the model', f'model {model_id}', 1)}; a label is a class id or one "
                "of the names in the model's config.json id2label"
            ) from None
