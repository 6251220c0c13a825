"""The MLflow tracker's pieces that need no tracking server: the settings, the names, a dead server.

The runs on a live ``mlflow server`` are in tests/api/test_mlflow_tracking.py.
"""

from __future__ import annotations

import importlib.util
import logging
from unittest import mock

import pytest
from pydantic import ValidationError

from engram_fixtures.live import free_port
from service.config import Settings
from service.jobs.tracking import RunRecord, log_run, metric_name, numeric_leaves, param_value, run_url

STORE = "file:///tmp/engram-tracking-unused"


def test_tracking_is_off_by_default_and_logs_nothing() -> None:
    settings = Settings(storage_url=STORE)
    assert settings.mlflow_tracking_uri is None and settings.mlflow_experiment == "engram-service"
    assert log_run(settings, "variant x", lambda: pytest.fail("a run is described only with tracking on")) is None


def test_an_empty_tracking_uri_is_unset_and_a_public_url_must_be_http() -> None:
    assert Settings(storage_url=STORE, mlflow_tracking_uri=" ").mlflow_tracking_uri is None
    assert Settings(storage_url=STORE, public_url="https://engram.example/").public_url == "https://engram.example"
    with pytest.raises(ValidationError, match="ENGRAM_PUBLIC_URL must be an http"):
        Settings(storage_url=STORE, public_url="engram.example")


def test_a_tracking_uri_without_the_mlflow_client_stops_the_process_naming_the_extra() -> None:
    real = importlib.util.find_spec

    def without_mlflow(name: str, *args: object) -> object:
        return None if name == "mlflow" else real(name, *args)  # type: ignore[arg-type]

    # The boundary mocked: mlflow is installed here (dev extras), so its absence is simulated.
    with mock.patch("importlib.util.find_spec", without_mlflow), pytest.raises(ValidationError) as refused:
        Settings(storage_url=STORE, mlflow_tracking_uri="http://mlflow:5000")
    assert "pip install 'engram-service[mlflow]'" in str(refused.value)


def test_names_mlflow_refuses_become_underscores_and_long_params_say_where_the_rest_is() -> None:
    assert metric_name("attacks.quantize:Q4_1.summary.variant.forget.exact_match") == (
        "attacks.quantize_Q4_1.summary.variant.forget.exact_match"
    )
    long = param_value("x" * 7000)
    assert len(long) == 6000 and long.endswith("(7000 characters: the whole value is in the run's artifacts)")
    assert param_value("uniform") == "uniform"
    assert run_url("http://mlflow:5000/", "3", "abc") == "http://mlflow:5000/#/experiments/3/runs/abc"
    assert run_url("sqlite:///mlflow.db", "3", "abc") is None


def test_every_number_of_a_json_value_is_a_metric_named_by_its_path() -> None:
    value = {
        "variant_id": "v",
        "summary": {"variant": {"forget": {"mean_nll": 1.5, "exact_match": 0.25, "n": 4}}},
        "tofu": {"variant": {"values": {"forget_quality": 0.5, "forget_quality_log10": None}, "left_out": {"x": "why"}}},
        "confusion": [0.75, 0.25],
        "passed": True,
        "records": [{"nll": 9.0}],
    }
    assert numeric_leaves(value, skip=frozenset({"records"})) == {
        "summary.variant.forget.mean_nll": 1.5,
        "summary.variant.forget.exact_match": 0.25,
        "summary.variant.forget.n": 4.0,
        "tofu.variant.values.forget_quality": 0.5,
        "confusion.0": 0.75,
        "confusion.1": 0.25,
        "passed": 1.0,
    }


def test_a_dead_tracking_server_is_a_warning_naming_the_run_not_an_error(caplog: pytest.LogCaptureFixture) -> None:
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    settings = Settings(mlflow_tracking_uri=dead, mlflow_timeout_s=2, storage_url=STORE)
    with caplog.at_level(logging.WARNING, logger="engram.tracking"):
        tracked = log_run(settings, "variant abc", lambda: RunRecord(name="variant abc", params={"a": "b"}))
    assert tracked is not None and tracked.logged is False and tracked.run_id is None
    assert tracked.warning is not None and "'variant abc'" in tracked.warning and dead in tracked.warning
    ours = [r for r in caplog.records if r.name == "engram.tracking"]  # urllib3 warns of each retry too
    assert [(r.levelno, r.getMessage()) for r in ours] == [(logging.WARNING, tracked.warning)]
