"""The ``engram`` CLI, run as a real process against the real server (``live_server``).

Every command runs ``python -m engram_client.cli`` in a subprocess with ``ENGRAM_URL`` pointing at
the session's server, with stdout and stderr captured (not a terminal), so progress shows as the
plain lines a CI log gets. Module fixtures build on each other the way a user does: register the
model, upload a target and a reference concept, unlearn. Names are prefixed ``cli`` so they cannot
collide with other modules on the shared server. ``evaluate``, ``generate`` and ``map`` run on the
``cli2`` variant of ``conftest.py`` (built with the Python client, so they need not wait for the flow).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import secrets
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from PIL import Image

from engram_fixtures.demo import make_facts
from engram_fixtures.live import LiveServer, free_port, start_server, stop_server
from tests.client.conftest import CLI2_MODEL, ReadyVariant
from tests.helpers.cli import failed, ok, run_cli, says, write_jsonl

MODEL = "cli/tiny"
FACTS = make_facts(40, seed=7)
FORGET = [{"prompt": p, "completion": c} for p, c in FACTS[:12]]
RETAIN = [{"prompt": p, "completion": c} for p, c in FACTS[12:36]]


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# ---------------------------------------------------------------- the flow, one step per fixture


@dataclass
class Flow:
    url: str
    data: Path  # the JSONL files
    collect_forget: subprocess.CompletedProcess[str]
    collect_retain: subprocess.CompletedProcess[str]


@pytest.fixture(scope="module")
def registered(live_server: LiveServer, tiny_llama_dir: Path) -> str:
    """``engram models add cli/tiny file://...``: the service's base URL once it succeeded."""
    result = ok(run_cli(live_server.base_url, "models", "add", MODEL, f"file://{tiny_llama_dir}"))
    assert f"model {MODEL}: LlamaForCausalLM" in result.stdout
    return live_server.base_url


@pytest.fixture(scope="module")
def flow(registered: str, tmp_path_factory: pytest.TempPathFactory) -> Flow:
    """Both concepts uploaded and collected: ``cli-forget`` (name from the file stem) and ``cli-retain``."""
    data = tmp_path_factory.mktemp("cli-data")
    forget = write_jsonl(data / "cli-forget.jsonl", FORGET)
    retain = write_jsonl(data / "retain.jsonl", RETAIN)
    collect_forget = ok(run_cli(registered, "concepts", "add", forget, "--model", MODEL))
    collect_retain = ok(
        run_cli(registered, "concepts", "add", retain, "-m", MODEL, "--name", "cli-retain", "--role", "reference")
    )
    return Flow(registered, data, collect_forget, collect_retain)


@pytest.fixture(scope="module")
def unlearned(flow: Flow, tmp_path_factory: pytest.TempPathFactory) -> tuple[subprocess.CompletedProcess[str], Path]:
    """``engram unlearn cli/tiny --concept cli-forget --alpha 0.8 --out DIR``, its output and DIR."""
    out = tmp_path_factory.mktemp("cli-variant") / "forgot"
    result = ok(run_cli(flow.url, "unlearn", MODEL, "--concept", "cli-forget", "--alpha", "0.8", "--out", out))
    return result, out


def variant_json(url: str, *args: str | Path) -> dict[str, Any]:
    return json.loads(ok(run_cli(url, "--json", *args)).stdout)


# ---------------------------------------------------------------- models and concepts


def test_models_list_and_show_as_table_and_json(registered: str) -> None:
    table = ok(run_cli(registered, "models", "list")).stdout
    assert MODEL in table and "LlamaForCausalLM" in table
    models = json.loads(ok(run_cli(registered, "--json", "models", "list")).stdout)
    assert MODEL in {m["model_id"] for m in models}
    shown = json.loads(ok(run_cli(registered, "models", "show", MODEL, "--json")).stdout)
    assert shown["model_id"] == MODEL and shown["layers"]
    assert "model.layers.0.self_attn.q_proj" in ok(run_cli(registered, "models", "show", MODEL)).stdout


def test_models_add_again_is_a_no_op(registered: str, tiny_llama_dir: Path) -> None:
    again = json.loads(ok(run_cli(registered, "--json", "models", "add", MODEL, f"file://{tiny_llama_dir}")).stdout)
    assert again["model_id"] == MODEL


def collect_line(stderr: str) -> re.Match[str]:
    """The last plain progress line of a collection job, parsed."""
    lines = [line for line in stderr.splitlines() if line.startswith("collect job ")]
    assert lines, stderr
    last = lines[-1]
    match = re.fullmatch(r"collect job ([0-9a-f]+) (\d+)/(\d+) tokens \((\d+)%\) (\w+)", last)
    assert match, last
    return match


def test_concepts_add_shows_token_progress_until_ready(flow: Flow) -> None:
    for result, name in ((flow.collect_forget, "cli-forget"), (flow.collect_retain, "cli-retain")):
        concept = variant_json(flow.url, "concepts", "show", name)
        state = concept["models"][MODEL]
        assert state["status"] == "ready"
        job_id, done, total, percent, status = collect_line(result.stderr).groups()
        assert (job_id, status, percent) == (state["job_id"], "succeeded", "100")
        assert int(done) == int(total) == state["tokens"] > 0
        assert f"{name} on {MODEL}: ready ({state['tokens']} tokens)" in result.stdout
    assert "cli-forget: 12 records" in flow.collect_forget.stderr  # the name came from the file's stem
    assert variant_json(flow.url, "concepts", "show", "cli-retain")["role"] == "reference"


def test_concepts_list_and_json_output_of_add(flow: Flow) -> None:
    listing = ok(run_cli(flow.url, "concepts", "list")).stdout
    assert "cli-forget" in listing and "cli-retain" in listing
    # Posting the same dataset again is idempotent: --json gives the concept and its finished job.
    again = json.loads(
        ok(run_cli(flow.url, "--json", "concepts", "add", flow.data / "cli-forget.jsonl", "-m", MODEL)).stdout
    )
    assert again["concept"]["models"][MODEL]["status"] == "ready"
    assert [job["status"] for job in again["jobs"]] == ["succeeded"]


def test_failed_collection_exits_1_with_its_problem(flow: Flow) -> None:
    # A prompt longer than the service's max_length leaves no completion token to count: the job fails.
    path = write_jsonl(flow.data / "cli-truncated.jsonl", [{"prompt": "lorem ipsum " * 400, "completion": "gone"}])
    stderr = failed(run_cli(flow.url, "concepts", "add", path, "-m", MODEL), "failed", "no record has a token")
    job_id = variant_json(flow.url, "concepts", "show", "cli-truncated")["models"][MODEL]["job_id"]
    assert f"collect job {job_id} " in stderr
    failed(run_cli(flow.url, "jobs", "watch", job_id), f"collect job {job_id} failed", "no record has a token")
    # Only its statistics (none: the collection failed) and its collection on MODEL go; the concept stays.
    assert run_cli(flow.url, "concepts", "delete", "cli-truncated", "-m", MODEL).returncode == 2  # needs --statistics-only
    ok(run_cli(flow.url, "concepts", "delete", "cli-truncated", "--statistics-only", "-m", MODEL))
    assert variant_json(flow.url, "concepts", "show", "cli-truncated")["models"] == {}
    ok(run_cli(flow.url, "concepts", "delete", "cli-truncated"))
    failed(run_cli(flow.url, "concepts", "show", "cli-truncated"), "Not found (404)")


def test_cancelled_job_watch_exits_1(flow: Flow) -> None:
    # Long enough (about a million tokens) that the cancel lands long before the collection could end.
    texts = [f"{p} {c}" for p, c in FACTS]
    records = [{"text": " ".join(texts[(i + k) % len(texts)] for k in range(12))} for i in range(1500)]
    path = write_jsonl(flow.data / "cli-long.jsonl", records)
    submitted = variant_json(flow.url, "concepts", "add", path, "-m", MODEL, "--no-wait")
    job_id = submitted["jobs"][0]["job_id"]
    ok(run_cli(flow.url, "jobs", "cancel", job_id))
    failed(run_cli(flow.url, "jobs", "watch", job_id), f"collect job {job_id} cancelled")
    ok(run_cli(flow.url, "concepts", "delete", "cli-long"))


# ---------------------------------------------------------------- unlearn, jobs, variants


def test_unlearn_downloads_a_verified_checkpoint_that_loads(
    unlearned: tuple[subprocess.CompletedProcess[str], Path], flow: Flow, tiny_llama_dir: Path
) -> None:
    from transformers import AutoModelForCausalLM

    result, out = unlearned
    variant_id = re.search(r"variant ([0-9a-f]{32}) in ", result.stderr).group(1)  # type: ignore[union-attr]
    variant = variant_json(flow.url, "variants", "show", variant_id)
    assert variant["terms"] == {"cli-forget": -0.8} and variant["alpha"] == 0.8
    assert sorted(variant["reference"]) == ["cli-forget", "cli-retain"]
    assert re.search(r"^variant job [0-9a-f]+ (\d+)/\1 layers \(100%\) succeeded$", result.stderr, re.MULTILINE), (
        result.stderr
    )
    assert re.search(r"^download [0-9a-f]{32} .*\(100%\)$", result.stderr, re.MULTILINE), result.stderr
    assert {p.name for p in out.iterdir()} == {f["path"] for f in variant["files"]}
    for entry in variant["files"]:
        assert sha256(out / entry["path"]) == entry["sha256"], entry
    assert not [p for p in out.parent.iterdir() if p.name.startswith(".")]  # no staging directory left behind
    base = AutoModelForCausalLM.from_pretrained(tiny_llama_dir)
    edited = AutoModelForCausalLM.from_pretrained(out)
    base_weights, edited_weights = base.state_dict(), edited.state_dict()
    assert base_weights.keys() == edited_weights.keys()
    changed = [k for k in base_weights if not torch.equal(base_weights[k], edited_weights[k])]
    assert any("q_proj" in k for k in changed), changed
    assert all(torch.isfinite(edited_weights[k]).all() for k in changed)


def test_unlearn_again_downloads_the_existing_variant(
    unlearned: tuple[subprocess.CompletedProcess[str], Path], flow: Flow, tmp_path: Path
) -> None:
    first, out = unlearned
    again = ok(run_cli(flow.url, "unlearn", MODEL, "-c", "cli-forget", "--alpha", "0.8", "--out", tmp_path / "again"))
    assert "exists already" in again.stderr and "variant job" not in again.stderr
    assert {p.name: sha256(p) for p in (tmp_path / "again").iterdir()} == {p.name: sha256(p) for p in out.iterdir()}
    # The same --out again holds exactly the verified files: nothing to do, exit 0.
    ok(run_cli(flow.url, "unlearn", MODEL, "-c", "cli-forget", "--alpha", "0.8", "--out", out))
    # Another directory with other content is refused without --force ...
    other = tmp_path / "other"
    other.mkdir()
    (other / "keep.txt").write_text("mine")
    failed(run_cli(flow.url, "unlearn", MODEL, "-c", "cli-forget", "--alpha", "0.8", "--out", other), "--force")
    assert (other / "keep.txt").read_text() == "mine"
    # ... and replaced with it.
    ok(run_cli(flow.url, "unlearn", MODEL, "-c", "cli-forget", "--alpha", "0.8", "--out", other, "--force"))
    assert {p.name for p in other.iterdir()} == {p.name for p in out.iterdir()}


def test_jobs_watch_show_and_cancel_a_finished_build(
    unlearned: tuple[subprocess.CompletedProcess[str], Path], flow: Flow
) -> None:
    job_id = re.search(r"^variant job ([0-9a-f]+) ", unlearned[0].stderr, re.MULTILINE).group(1)  # type: ignore[union-attr]
    layers = len(variant_json(flow.url, "models", "show", MODEL)["layers"])
    watched = ok(run_cli(flow.url, "jobs", "watch", job_id))
    assert f"variant job {job_id} {layers}/{layers} layers (100%) succeeded" in watched.stderr
    assert f"variant job {job_id}: succeeded" in watched.stdout
    shown = variant_json(flow.url, "jobs", "show", job_id)
    assert shown["status"] == "succeeded" and shown["progress"] == {"done": layers, "total": layers, "unit": "layers"}
    assert variant_json(flow.url, "jobs", "cancel", job_id)["status"] == "succeeded"  # too late: nothing changes


def test_variants_list_shows_the_variant(unlearned: tuple[subprocess.CompletedProcess[str], Path], flow: Flow) -> None:
    variant_id = re.search(r"variant ([0-9a-f]{32}) in ", unlearned[0].stderr).group(1)  # type: ignore[union-attr]
    table = ok(run_cli(flow.url, "variants", "list")).stdout
    row = next(line for line in table.splitlines() if variant_id in line)
    assert MODEL in row and "cli-forget=-0.8" in row and "ready" in row
    mine = variant_json(flow.url, "variants", "list", "--model", MODEL)
    assert variant_id in {v["variant_id"] for v in mine} and {v["model_id"] for v in mine} == {MODEL}


def test_compose_terms_json_and_download(flow: Flow, tmp_path: Path) -> None:
    out = tmp_path / "composed"
    composed = variant_json(
        flow.url, "compose", MODEL, "--term", "cli-forget=0.5", "--term", "cli-retain=-0.25", "--format", "delta", "-o", out
    )
    assert composed["terms"] == {"cli-forget": 0.5, "cli-retain": -0.25} and composed["format"] == "delta"
    assert [p.name for p in out.iterdir()] == ["delta.safetensors"]
    downloaded = variant_json(flow.url, "variants", "download", composed["variant_id"], "--out", tmp_path / "again")
    assert downloaded["variant_id"] == composed["variant_id"]
    assert sha256(tmp_path / "again" / "delta.safetensors") == sha256(out / "delta.safetensors")


def test_bad_term_is_a_usage_error(flow: Flow) -> None:
    result = run_cli(flow.url, "compose", MODEL, "--term", "cli-forget")
    assert result.returncode == 2 and "NAME=COEFFICIENT" in result.stderr and "Traceback" not in result.stderr


def test_unlearn_with_module_strengths_lora_target_and_universe(flow: Flow) -> None:
    """``--strength``, ``--lora-target`` and ``--universe`` reach the variant as the HTTP API takes them."""
    plain = variant_json(flow.url, "unlearn", MODEL, "-c", "cli-forget", "--alpha", "0.6")
    args = [
        "unlearn",
        MODEL,
        "-c",
        "cli-forget",
        "--alpha",
        "0.6",
        "--strength",
        "q_proj=1.5",
        "--strength",
        "down_proj=0.5",
    ]
    variant = variant_json(flow.url, *args, "--universe", plain["universe_id"])
    assert variant["module_strengths"] == {"down_proj": 0.5, "q_proj": 1.5}
    assert variant["universe_id"] == plain["universe_id"] and variant["variant_id"] != plain["variant_id"]
    adapter = variant_json(flow.url, "unlearn", MODEL, "-c", "cli-forget", "--format", "peft", "--lora-target", "vllm")
    assert adapter["format"] == "peft" and adapter["lora_target"] == "vllm"


@pytest.mark.parametrize("strength", ["q_proj", "q_proj=x", "=2"])
def test_bad_strength_is_a_usage_error(flow: Flow, strength: str) -> None:
    result = run_cli(flow.url, "unlearn", MODEL, "-c", "cli-forget", "--strength", strength)
    assert result.returncode == 2 and "SUFFIX=S" in result.stderr and "Traceback" not in result.stderr


# ---------------------------------------------------------------- evaluate, generate, map (the cli2 variant)


def job_of(stderr: str, kind: str) -> str:
    """The ID in the last plain progress line of a ``kind`` job, which must have succeeded."""
    lines = re.findall(rf"^{kind} job ([0-9a-f]+) .*succeeded$", stderr, re.MULTILINE)
    assert lines, stderr
    return lines[-1]


def table_rows(stdout: str, first: set[str]) -> dict[str, list[str]]:
    """The cells of a printed table's rows whose first cell is in ``first`` (column rules dropped)."""
    rows = [[cell for cell in line.split() if cell not in {"│", "┃"}] for line in stdout.splitlines()]
    return {row[0]: row[1:] for row in rows if row and row[0] in first}


def test_evaluate_table_and_json_are_the_jobs_numbers(cli2: ReadyVariant, api: httpx.Client) -> None:
    args = ("evaluate", cli2.variant_id, "--forget", cli2.forget_jsonl, "--retain", cli2.retain_jsonl)
    shown = ok(run_cli(cli2.url, *args))
    assert f"on {len(cli2.forget)} forget and {len(cli2.retain)} retain probes" in shown.stderr
    summary = api.get(f"/jobs/{job_of(shown.stderr, 'evaluate')}").json()["result"]["summary"]
    rows = table_rows(shown.stdout, {"forget", "retain"})
    assert set(rows) == {"forget", "retain"}, shown.stdout
    for split, (n, base_nll, variant_nll, ratio, base_em, variant_em) in rows.items():
        base, edited = summary["base"][split], summary["variant"][split]
        assert int(n) == base["n"] == edited["n"]
        assert float(base_nll) == pytest.approx(base["mean_nll"], rel=1e-3)
        assert float(variant_nll) == pytest.approx(edited["mean_nll"], rel=1e-3)
        assert float(ratio) == pytest.approx(edited["mean_nll"] / base["mean_nll"], rel=1e-3)
        assert float(base_em.rstrip("%")) == pytest.approx(100 * base["exact_match"], abs=0.05)
        assert float(variant_em.rstrip("%")) == pytest.approx(100 * edited["exact_match"], abs=0.05)
    as_json = ok(run_cli(cli2.url, "--json", *args))
    result = json.loads(as_json.stdout)
    assert result == api.get(f"/jobs/{job_of(as_json.stderr, 'evaluate')}").json()["result"]
    assert {model: set(splits) for model, splits in result["summary"].items()} == {
        "base": {"forget", "retain"},
        "variant": {"forget", "retain"},
    }
    assert len(result["records"]) == len(cli2.forget) + len(cli2.retain)


def test_evaluate_no_wait_prints_the_job_to_watch(cli2: ReadyVariant) -> None:
    submitted = ok(run_cli(cli2.url, "evaluate", cli2.variant_id, "--retain", cli2.retain_jsonl, "--no-wait"))
    job_id = submitted.stdout.strip()
    assert re.fullmatch(r"[0-9a-f]+", job_id) and f"engram jobs watch {job_id}" in submitted.stderr
    watched = ok(run_cli(cli2.url, "jobs", "watch", job_id))
    assert f"evaluate job {job_id}: succeeded" in watched.stdout


def test_generate_prints_each_models_text(cli2: ReadyVariant, api: httpx.Client) -> None:
    prompt = cli2.forget[0]["prompt"]
    shown = ok(run_cli(cli2.url, "generate", cli2.variant_id, prompt, "--max-new-tokens", "6"))
    outputs = api.get(f"/jobs/{job_of(shown.stderr, 'generate')}").json()["result"]["outputs"]
    assert list(outputs) == ["base", "variant"]
    assert shown.stdout == "".join(f"{name}: {output['text']}\n" for name, output in outputs.items())
    one = ok(run_cli(cli2.url, "--json", "generate", cli2.variant_id, prompt, "--max-new-tokens", "6", "-m", "variant"))
    result = json.loads(one.stdout)
    assert result == api.get(f"/jobs/{job_of(one.stderr, 'generate')}").json()["result"]
    assert (result["prompt"], result["outputs"]) == (prompt, {"variant": outputs["variant"]})  # greedy: the same text


def test_map_tables_and_json_are_the_http_answer(cli2: ReadyVariant, api: httpx.Client) -> None:
    concepts = ("-c", "cli2-forget", "-c", "cli2-retain")
    data = json.loads(ok(run_cli(cli2.url, "--json", "map", cli2.model, *concepts)).stdout)
    assert data == api.get(f"/models/{cli2.model}/engram-map", params={"concepts": "cli2-forget,cli2-retain"}).json()
    shown = ok(run_cli(cli2.url, "map", cli2.model, *concepts)).stdout
    headings = [
        f"{name}: max ρ {data['maps'][name]['max']:.3g} at {data['maps'][name]['argmax']}" for name in data["concepts"]
    ]
    assert all(heading in shown for heading in headings), shown
    second = shown.index(headings[1])
    for name, text in zip(data["concepts"], (shown[:second], shown[second:]), strict=True):
        assert table_rows(text, {"block"}) == {"block": data["modules"]}
        assert table_rows(text, {str(b) for b in data["blocks"]}) == {
            str(b): ["-" if rho is None else f"{rho:.3g}" for rho in row]
            for b, row in zip(data["blocks"], data["maps"][name]["rho"], strict=True)
        }


def test_map_png_is_written_whole_at_the_size_asked(cli2: ReadyVariant, tmp_path: Path) -> None:
    target = tmp_path / "maps" / "forget.png"
    result = ok(
        run_cli(cli2.url, "map", cli2.model, "-c", "cli2-forget", "--png", target, "--width", "400", "--height", "300")
    )
    assert says(result.stderr, f"in {target}: 400×300 px") and result.stdout == ""
    with Image.open(target) as image:
        assert (image.format, image.size) == ("PNG", (400, 300))
    assert os.listdir(target.parent) == ["forget.png"]  # the partial file was renamed, nothing else is left
    again = json.loads(ok(run_cli(cli2.url, "--json", "map", cli2.model, "-c", "cli2-forget", "--png", target)).stdout)
    assert (again["path"], again["bytes"]) == (str(target), target.stat().st_size)
    with Image.open(target) as image:
        assert image.size == (again["width"], again["height"])  # the service's default size replaced the file


@pytest.mark.parametrize(
    ("args", "title", "detail"),
    [
        (["evaluate", "0" * 32, "--forget", "{forget}"], "Not found (404)", "0" * 32),
        (["generate", "0" * 32, "Q: who? A:"], "Not found (404)", "0" * 32),
        (["map", CLI2_MODEL, "-c", "cli2-nothing"], "Not found (404)", "cli2-nothing"),
        (["map", "cli2-missing", "-c", "cli2-forget"], "Not found (404)", "cli2-missing"),
        (["generate", "{variant}", "Q: who? A:", "--max-new-tokens", "0"], "Invalid input (422)", "max_new_tokens"),
        (["evaluate", "{variant}", "--forget", "{bad}"], "Error", "line 2"),
    ],
    ids=["404-evaluate", "404-generate", "404-concept", "404-model", "422-tokens", "bad-jsonl"],
)
def test_new_commands_print_the_problem_and_exit_1(
    cli2: ReadyVariant, tmp_path: Path, args: list[str], title: str, detail: str
) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "Q", "completion": "A"}\n{"prompt": "only a prompt"}\n')
    values = {"forget": str(cli2.forget_jsonl), "variant": cli2.variant_id, "bad": str(bad)}
    stderr = failed(run_cli(cli2.url, *(arg.format(**values) for arg in args)), title, detail)
    assert stderr.startswith(title), stderr


def test_new_commands_usage_errors_exit_2(cli2: ReadyVariant) -> None:
    for args in (["evaluate", cli2.variant_id], ["map", cli2.model, "-c", "cli2-forget", "--width", "400"]):
        result = run_cli(cli2.url, *args)
        assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr


# ---------------------------------------------------------------- errors


@pytest.mark.parametrize(
    ("args", "title", "detail"),
    [
        (["models", "show", "cli/missing"], "Not found (404)", "cli/missing"),
        (["models", "add", MODEL, "file:///nowhere/else"], "Conflict (409)", "already registered"),
        (["unlearn", MODEL, "-c", "cli-forget", "--alpha", "500"], "Invalid input (422)", "alpha"),
        (["unlearn", MODEL, "-c", "cli-unknown"], "Not found (404)", "cli-unknown"),
        (["jobs", "watch", "nope"], "Not found (404)", "job nope does not exist"),
    ],
    ids=["404-model", "409-model", "422-alpha", "404-concept", "404-job"],
)
def test_problem_prints_title_and_detail_and_exits_1(flow: Flow, args: list[str], title: str, detail: str) -> None:
    stderr = failed(run_cli(flow.url, *args), title, detail)
    assert stderr.startswith(title), stderr


def test_unreachable_service_is_a_clear_error() -> None:
    url = f"http://127.0.0.1:{free_port()}"
    failed(run_cli(url, "models", "list"), "Connection error", url, "could not be reached", "ENGRAM_URL")


# ---------------------------------------------------------------- API keys


@pytest.fixture(scope="module")
def secured(tmp_path_factory: pytest.TempPathFactory, model_root: Path, tiny_llama_dir: Path) -> Iterator[tuple[str, str]]:
    """A server of this module's own with one ``write`` key (the session's server has no auth): (URL, key)."""
    root = tmp_path_factory.mktemp("cli-auth")
    key = secrets.token_urlsafe(24)
    server = start_server(root / "store", model_root, root / "server.log", ENGRAM_API_KEYS=f"{key}:write")
    try:
        yield server.base_url, key
    finally:
        stop_server(server)


def test_api_key_from_environment_or_option(secured: tuple[str, str], tiny_llama_dir: Path) -> None:
    url, key = secured
    failed(run_cli(url, "models", "list"), "Unauthorized (401)")
    failed(run_cli(url, "models", "list", api_key="wrong-key-of-enough-length"), "Unauthorized (401)")
    ok(run_cli(url, "models", "add", MODEL, tiny_llama_dir, api_key=key))  # a bare local dir becomes file://
    assert MODEL in ok(run_cli(url, "models", "list", api_key=key)).stdout
    assert MODEL in ok(run_cli(url, "--api-key", key, "models", "list")).stdout
    failed(run_cli(url, "jobs", "cancel", "some-job", api_key=key), "Forbidden (403)")  # cancelling needs admin
