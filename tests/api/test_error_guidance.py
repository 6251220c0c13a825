"""Refusals that say how to fix the request, not only what is wrong (issue 28): a model ``source``
without a scheme names the three accepted forms, not pydantic's regular expression; a multipart
concept upload without ``models`` names the form field and how to send it."""

from __future__ import annotations

from tests.helpers.api import assert_problem, jsonl
from tests.helpers.app import InProcessServer

SOURCE_FORMS = "source must be file:///absolute/dir, s3://bucket/prefix or hf://org/name[@revision]"


def test_a_source_without_a_scheme_names_the_accepted_forms(app_server: InProcessServer) -> None:
    for source in ("/abs/dir", "models/tiny", "ftp://host/x"):
        response = app_server.client.post("/models", json={"model_id": "guidance/m", "source": source})
        problem = assert_problem(response, 422, SOURCE_FORMS)
        assert "^" not in problem["detail"], problem  # no regular expression
        assert problem["errors"][0]["loc"][-1] == "source"


def test_the_openapi_document_still_publishes_the_source_pattern(app_server: InProcessServer) -> None:
    schema = app_server.client.get("/openapi.json").json()["components"]["schemas"]["ModelCreate"]
    assert schema["properties"]["source"]["pattern"].startswith("^(")


def test_an_upload_without_models_says_how_to_send_them(app_server: InProcessServer) -> None:
    dataset = {"dataset": ("d.jsonl", jsonl([{"text": "a fact"}]))}
    for form in ({"name": "guidance-no-models"}, {"name": "guidance-no-models", "models": " , "}):
        response = app_server.client.post("/concepts", data=form, files=dataset)
        problem = assert_problem(response, 422, "'models'", "-F models=<model id>")
        assert "List should have" not in problem["detail"], problem  # not pydantic's wording
        assert problem["errors"][0]["loc"] == ["models"]
