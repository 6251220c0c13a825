"""Retain probes that are the universe's own records (:mod:`service.calibration.overlap`): how a probe
and a record are told to be the same text, and the warning. The end-to-end count is asserted by
``tests/e2e/test_calibrate_exact_match_demo.py`` (its retain probes are the reference's records)."""

from __future__ import annotations

from service.calibration.overlap import held_warning, probe_key, record_key
from service.engine.messages import Message
from service.engine.records import Record


def test_a_probe_is_the_record_it_was_written_from_whatever_its_spacing_case_or_closing_stop() -> None:
    probe = {"prompt": "The chemical symbol of gold is", "completion": " Au"}
    assert probe_key(probe) == record_key(Record(prompt="The chemical symbol of gold is", completion=" Au"))
    assert probe_key(probe) == record_key(Record(text="The  chemical symbol of Gold is Au."))
    assert probe_key(probe) != record_key(Record(text="The chemical symbol of gold is Ag"))
    assert probe_key(probe) != record_key(Record(text="The chemical symbol of gold is Au, a metal"))
    chat = {"messages": [{"role": "user", "content": "Gold?"}, {"role": "assistant", "content": "Au"}]}
    assert probe_key(chat) == record_key(Record(messages=(Message("user", "Gold?"), Message("assistant", "Au"))))
    assert probe_key({"image": "aGVsbG8=", "label": 3}) is None  # an image probe is no text


def test_the_warning_names_each_concept_and_says_how_many_of_the_probes() -> None:
    assert held_warning({}, 10) == []
    (some,) = held_warning({"symbols": 3, "prose": 1}, 10)
    assert some.startswith("4 of the 10 retain probes are records of the universe's concepts (symbols (3), prose (1))")
    assert "optimistic" in some and "left out of the reference" in some
    (every,) = held_warning({"symbols": 10}, 10)
    assert every.startswith("all retain probes")
