"""Request bodies whose field names come from the wire contract, so the client spells no option itself.

The edit options of ``unlearn`` and ``compose`` are the fields of :class:`api_schemas.EditOptions`,
those of ``calibrate`` the fields of :class:`api_schemas.CalibrateRequest`: a name that is not one
of them is refused here, before anything is sent. Values are not validated here but by the service,
whose 422 says what is wrong with them (one authority for the bounds, whatever the client's version);
a caller who wants them checked first passes a validated ``EditOptions``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from pydantic import BaseModel

from api_schemas import EditOptions

__all__ = ["EDIT_OPTIONS", "edit_keywords", "edit_options_body", "fields_body"]

# The edit options, in the contract's order: the client's unlearn/compose keywords and the CLI's
# flags are checked against this (tests/client/test_options.py), so none can drift from the contract.
EDIT_OPTIONS: tuple[str, ...] = tuple(EditOptions.model_fields)


def fields_body(model: type[BaseModel], given: Mapping[str, Any]) -> dict[str, Any]:
    """The JSON body of the fields of ``model`` that are set (not ``None``); the service's defaults apply
    to the rest. Sequences become lists and mappings dicts, as JSON has them.

    Raises:
        TypeError: a name is not a field of ``model`` (a typo would otherwise be the service's 422).
    """
    unknown = sorted(set(given) - set(model.model_fields))
    if unknown:
        known = ", ".join(model.model_fields)
        raise TypeError(f"{', '.join(unknown)}: not a field of {model.__name__} (its fields: {known})")
    return {name: _plain(value) for name, value in given.items() if value is not None}


def edit_keywords(arguments: Mapping[str, Any]) -> dict[str, Any]:
    """The edit options among a method's arguments (its ``locals()``): those named as the contract's fields,
    so ``unlearn`` and ``compose`` spell each option once, in their signatures.

    Raises:
        KeyError: the method lacks a keyword for one of the contract's edit options.
    """
    return {name: arguments[name] for name in EDIT_OPTIONS}


def edit_options_body(options: EditOptions | None, given: Mapping[str, Any]) -> dict[str, Any]:
    """The edit options of an unlearn or compose body: the fields ``options`` was given (validated when
    it was built), then the keyword arguments that are set.

    Raises:
        TypeError: an option is given both in ``options`` and as a keyword, or is no edit option.
    """
    body = options.model_dump(mode="json", exclude_unset=True) if options is not None else {}
    keywords = fields_body(EditOptions, given)
    twice = sorted(set(body) & set(keywords))
    if twice:
        raise TypeError(f"{', '.join(twice)}: given both in options= and as a keyword; give each option once")
    return body | keywords


def _plain(value: Any) -> Any:
    if isinstance(value, Mapping):
        return dict(value)
    if isinstance(value, Sequence) and not isinstance(value, (str, bytes)):
        return list(value)
    return value
