"""The edit options are spelled once, by the wire contract (``api_schemas.EditOptions``).

- The client's ``unlearn``/``compose`` keywords and the CLI's edit flags are exactly the contract's
  fields, and the CLI's choices are the contract's ``Literal`` values: a field added to the contract
  without them fails here, by name.
- ``options=EditOptions(...)`` (validated before anything is sent) gives the same body, and so the
  same variant, as the same options given as keywords (against the session's live server).
- An option given twice, or a name the contract does not have, is refused before any request: the
  transport of those tests raises if it is ever reached.
"""

from __future__ import annotations

import functools
import inspect
import json
from typing import Any, Literal, get_args, get_origin

import httpx
import pytest
from typer.testing import CliRunner

from api_schemas import CalibrateRequest, ConceptCreate, DatasetReference, EditOptions, GenerateRequest
from engram_client import EngramAPIError, EngramClient, cli
from engram_client.bodies import EDIT_OPTIONS
from engram_client.cli import edits, options, root


def _keywords(method: Any) -> set[str]:
    parameters = inspect.signature(method).parameters.values()
    return {p.name for p in parameters if p.kind is inspect.Parameter.KEYWORD_ONLY} - {"options"}


def test_the_client_and_the_cli_take_exactly_the_contracts_edit_options() -> None:
    assert set(EDIT_OPTIONS) == set(EditOptions.model_fields)
    assert _keywords(EngramClient.unlearn) == set(EDIT_OPTIONS)
    assert _keywords(EngramClient.compose) == set(EDIT_OPTIONS)
    flags = edits.EditFlags().options()
    assert set(flags) == set(EDIT_OPTIONS) and set(flags.values()) == {None}  # nothing given, nothing sent


# Every edit flag on a command line, and what the request body must then hold (by contract field).
FLAGS = {
    "scaling": (["--scaling", "weight_norm"], "weight_norm"),
    "modules": (["--module", "q_proj", "--module", "v_proj"], ["q_proj", "v_proj"]),
    "layers": (["--layer", "1"], [1]),
    "module_strengths": (["--strength", "q_proj=1.5"], {"q_proj": 1.5}),
    "rcond": (["--rcond", "0.01"], 0.01),
    "reference": (["--reference", "retain"], ["retain"]),
    "universe": (["--universe", "0" * 32], "0" * 32),
    "format": (["--format", "peft"], "peft"),
    "lora_rank": (["--lora-rank", "8"], 8),
    "lora_target": (["--lora-target", "vllm"], "vllm"),
    "adapter_base_model": (["--adapter-base-model", "org/base"], "org/base"),
    "gguf_quantization": (["--gguf-quantization", "Q8_0"], "Q8_0"),
    "callback_url": (["--callback-url", "http://hook.test/done"], "http://hook.test/done"),
}


@pytest.mark.parametrize(
    ("command", "body"),
    [
        (["unlearn", "m", "-c", "forget", "--alpha", "0.5"], {"concepts": ["forget"], "alpha": 0.5}),
        (["compose", "m", "-t", "forget=-0.5"], {"terms": {"forget": -0.5}}),
    ],
    ids=["unlearn", "compose"],
)
def test_every_edit_flag_reaches_the_body_under_the_contracts_name(
    monkeypatch: pytest.MonkeyPatch, command: list[str], body: dict[str, Any]
) -> None:
    """The flags stated once (edits.EditFlags) are each command's: given on its command line, each is
    sent as its EditOptions field. The service is an httpx mock transport that records the body and
    answers 404 (what is under test is the command line, not the service)."""
    assert set(FLAGS) == set(EditOptions.model_fields)  # a new field needs its line here
    seen: list[dict[str, Any]] = []

    def answer(request: httpx.Request) -> httpx.Response:
        seen.append(json.loads(request.content))
        return httpx.Response(404, json={"status": 404, "title": "Not found", "detail": "no such model"})

    transport = httpx.MockTransport(answer)
    monkeypatch.setattr(root, "EngramClient", functools.partial(EngramClient, transport=transport))
    args = [*command, *(arg for flag, _ in FLAGS.values() for arg in flag)]
    result = CliRunner().invoke(cli.app, ["--url", "http://engram.test", *args])
    assert result.exit_code == 1 and "no such model" in result.output, result.output
    assert seen == [{**body, **{field: value for field, (_, value) in FLAGS.items()}}]


@pytest.mark.parametrize(
    ("choices", "model", "field"),
    [
        (options.Scaling, EditOptions, "scaling"),
        (options.Format, EditOptions, "format"),
        (options.LoraTarget, EditOptions, "lora_target"),
        (options.Role, ConceptCreate, "role"),
        (options.DatasetFormat, DatasetReference, "format"),
    ],
)
def test_the_clis_choices_are_the_contracts_literals(choices: Any, model: Any, field: str) -> None:
    annotation = model.model_fields[field].annotation
    literal = annotation if get_origin(annotation) is Literal else get_args(annotation)[0]  # X or X | None
    assert [member.value for member in choices] == list(get_args(literal))


def test_validated_options_give_the_body_and_variant_of_the_same_keywords(cli2: Any) -> None:  # conftest's ReadyVariant
    sent: list[httpx.Request] = []
    with EngramClient(cli2.url) as engram:
        engram._http.event_hooks["request"].append(sent.append)
        typed = engram.unlearn(cli2.model, ["cli2-forget"], 0.5, options=EditOptions(layers=[0], modules=["q_proj"]))
        keywords = engram.unlearn(cli2.model, ["cli2-forget"], 0.5, modules=("q_proj",), layers=[0])
    bodies = [json.loads(r.content) for r in sent if r.url.path.endswith("/unlearn")]
    assert bodies == [{"concepts": ["cli2-forget"], "alpha": 0.5, "layers": [0], "modules": ["q_proj"]}] * 2
    assert typed.variant.variant_id == keywords.variant.variant_id


def _unreachable(request: httpx.Request) -> httpx.Response:
    raise AssertionError(f"nothing may be sent, but {request.method} {request.url} was")


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda c: c.unlearn("m", ["a"], scaling="uniform", options=EditOptions(scaling="uniform")), "scaling: given both"),
        (lambda c: c.compose("m", {"a": -1.0}, rcond=0.1, options=EditOptions(rcond=0.1)), "rcond: given both"),
        (lambda c: c.calibrate("m", ["a"], [], [], budgett=3), "budgett: not a field of CalibrateRequest"),
    ],
    ids=["unlearn-twice", "compose-twice", "calibrate-typo"],
)
def test_an_option_twice_or_unknown_is_refused_before_sending(call: Any, message: str) -> None:
    with EngramClient("http://engram.test", transport=httpx.MockTransport(_unreachable)) as engram:
        with pytest.raises(TypeError, match=message):
            call(engram)


def test_calibrate_sends_the_fields_set_under_the_contracts_names() -> None:
    seen: list[dict[str, Any]] = []

    def answer(request: httpx.Request) -> httpx.Response:
        seen.append(json.loads(request.content))
        return httpx.Response(404, json={"status": 404, "title": "Not found", "detail": "no such model"})

    with EngramClient("http://engram.test", transport=httpx.MockTransport(answer)) as engram, pytest.raises(EngramAPIError):
        engram.calibrate("m", ("a",), [{"prompt": "p", "completion": "c"}], [], budget=3, rcond=None)
    assert seen == [{"concepts": ["a"], "forget": [{"prompt": "p", "completion": "c"}], "retain": [], "budget": 3}]
    assert set(seen[0]) <= set(CalibrateRequest.model_fields)


def test_generate_choices_are_the_contracts() -> None:
    assert [member.value for member in options.Generator] == ["base", "variant"]
    assert get_args(get_args(GenerateRequest.model_fields["models"].annotation)[0]) == ("base", "variant")
