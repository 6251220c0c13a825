"""What a demanding new user of the ``engram`` CLI ran into, one test per finding.

Each runs the CLI as a real process (``run_cli`` of ``test_cli.py``) against the session's server,
a server of this module's own with API keys, or a socket that accepts and never answers. The
universes commands get a model of their own (``sweep/tiny``) so that building a universe never
changes another module's current universe.
"""

from __future__ import annotations

import http.server
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from engram_client import EngramClient
from engram_fixtures.demo import make_facts
from engram_fixtures.live import REPO_ROOT, LiveServer, start_server, stop_server
from tests.client.conftest import ReadyVariant
from tests.helpers.cli import failed, ok, run_cli, says, write_jsonl

SWEEP_MODEL = "sweep/tiny"
_FACTS = make_facts(16, seed=31)


def usage_error(result: subprocess.CompletedProcess[str], *mentions: str) -> str:
    """Assert exit code 2 (a usage error, nothing sent), no traceback, and every ``mentions`` on stderr."""
    assert result.returncode == 2, f"exit {result.returncode}\nstdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    stderr = result.stderr
    assert "Traceback" not in stderr, stderr
    for mention in mentions:
        assert says(stderr, mention), stderr
    return stderr


# ---------------------------------------------------------------- help and global options


def help_text(*command: str) -> str:
    """``engram COMMAND --help`` on a 200-column terminal, so that no long word is cut at the edge."""
    env = {**os.environ, "COLUMNS": "200", "PYTHONPATH": str(REPO_ROOT)}
    argv = [sys.executable, "-m", "engram_client.cli", *command, "--help"]
    return ok(subprocess.run(argv, cwd=REPO_ROOT, env=env, capture_output=True, text=True, check=False)).stdout


def test_help_shows_bracketed_text_as_written() -> None:
    """Rich markup swallowed ``[@rev]``: the help said hf://org/name, and no revision could be seen."""
    assert "hf://org/name[@rev]" in help_text("models", "add")
    assert "hf://datasets/org/name[@revision]/path" in help_text("concepts", "add")


@pytest.mark.parametrize("timeout", ["0", "-1"])
def test_a_timeout_that_is_not_positive_is_a_usage_error(timeout: str) -> None:
    """``--timeout -1`` printed a ValueError traceback; ``--timeout 0`` a misleading connection error."""
    usage_error(run_cli("http://127.0.0.1:9", "--timeout", timeout, "models", "list"), "--timeout")


def test_a_service_that_does_not_answer_in_time_names_timeout() -> None:
    """A timeout said only "check --url": the way out, a longer --timeout, was not named."""
    listener = socket.create_server(("127.0.0.1", 0))
    accepted: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:  # accept and never answer: a service stuck behind a proxy
        listener.settimeout(0.2)
        while not stop.is_set():
            try:
                accepted.append(listener.accept()[0])
            except OSError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{listener.getsockname()[1]}"
        failed(run_cli(url, "--timeout", "0.3", "models", "list"), "did not answer in time", "--timeout")
    finally:
        stop.set()
        thread.join()
        for conn in accepted:
            conn.close()
        listener.close()


# ---------------------------------------------------------------- usage mistakes caught before sending


def test_models_add_of_a_missing_local_directory_is_a_usage_error(tmp_path: Path) -> None:
    """A mistyped local path went to the service as is and came back as a regex ('should match pattern')."""
    missing = tmp_path / "no-such-model"
    stderr = usage_error(run_cli("http://127.0.0.1:9", "models", "add", "x/y", missing), "no-such-model", "file://")
    assert "pattern" not in stderr


def test_concepts_add_with_a_file_stem_that_is_no_concept_name_says_use_name(tmp_path: Path) -> None:
    """``my facts.jsonl`` gave the concept name ``my facts``, refused by the service with its regex."""
    data = write_jsonl(tmp_path / "my facts.jsonl", [{"text": "a fact"}])
    stderr = usage_error(run_cli("http://127.0.0.1:9", "concepts", "add", data, "-m", "x"), "'my facts'", "--name")
    assert "pattern" not in stderr


def test_a_dataset_uri_the_service_cannot_fetch_is_a_usage_error() -> None:
    """An https:// reference came back as the schema's regex of the accepted URIs."""
    args = ("concepts", "add", "--dataset-uri", "https://example.com/facts.jsonl", "-m", "x")
    stderr = usage_error(run_cli("http://127.0.0.1:9", *args), "https://example.com/facts.jsonl", "s3://", "file:///")
    assert "pattern" not in stderr


# ---------------------------------------------------------------- API keys


@pytest.fixture(scope="module")
def secured(tmp_path_factory: pytest.TempPathFactory, model_root: Path) -> Iterator[tuple[str, str]]:
    """A server of this module's own with one ``read`` key: (URL, key)."""
    root = tmp_path_factory.mktemp("sweep-auth")
    key = secrets.token_urlsafe(24)
    server = start_server(root / "store", model_root, root / "server.log", ENGRAM_API_KEYS=f"{key}:read")
    try:
        yield server.base_url, key
    finally:
        stop_server(server)


def test_a_401_says_how_the_cli_sends_a_key(secured: tuple[str, str]) -> None:
    """The 401 said 'send Authorization: Bearer <key>', which a CLI user does not write by hand."""
    url, _ = secured
    failed(run_cli(url, "models", "list"), "Unauthorized (401)", "--api-key", "ENGRAM_API_KEY")
    failed(run_cli(url, "models", "list", api_key="wrong-key-of-enough-length"), "--api-key", "ENGRAM_API_KEY")


# ---------------------------------------------------------------- maps


def test_map_measure_is_the_http_answer_of_that_measure(cli2: ReadyVariant, api: httpx.Client) -> None:
    """The API has ``measure=data|weight``; the CLI had no way to ask for the paper's weight ratio."""
    args = ("map", cli2.model, "-c", "cli2-forget")
    for measure in ("data", "weight"):
        shown = json.loads(ok(run_cli(cli2.url, "--json", *args, "--measure", measure)).stdout)
        answer = api.get(f"/models/{cli2.model}/engram-map", params={"concepts": "cli2-forget", "measure": measure})
        assert shown == answer.json()
    default = json.loads(ok(run_cli(cli2.url, "--json", *args)).stdout)
    assert default == api.get(f"/models/{cli2.model}/engram-map", params={"concepts": "cli2-forget"}).json()
    assert "--measure" in ok(run_cli(cli2.url, "map", "--help")).stdout
    usage_error(run_cli(cli2.url, *args, "--measure", "bytes"), "--measure")


# ---------------------------------------------------------------- jobs


def test_jobs_show_renders_an_evaluation_as_its_table(cli2: ReadyVariant) -> None:
    """``jobs show`` of an evaluate job printed its whole result as one JSON line per screen."""
    submitted = json.loads(
        ok(run_cli(cli2.url, "--json", "evaluate", cli2.variant_id, "--forget", cli2.forget_jsonl, "--no-wait")).stdout
    )
    ok(run_cli(cli2.url, "jobs", "watch", submitted["job_id"]))
    shown = ok(run_cli(cli2.url, "jobs", "show", submitted["job_id"])).stdout
    assert "succeeded" in shown and "NLL ratio" in shown, shown
    assert '"records"' not in shown, shown
    whole = json.loads(ok(run_cli(cli2.url, "--json", "jobs", "show", submitted["job_id"])).stdout)
    assert whole["result"]["records"]  # --json still has all of it


def test_jobs_list_shows_what_the_service_is_working_on(live_server: LiveServer, api: httpx.Client) -> None:
    """``GET /jobs`` (the unfinished jobs) had no command."""
    listed = json.loads(ok(run_cli(live_server.base_url, "--json", "jobs", "list")).stdout)
    assert isinstance(listed, list)
    assert {job["status"] for job in listed} <= {"queued", "running"}
    ok(run_cli(live_server.base_url, "jobs", "list", "--status", "queued"))
    usage_error(run_cli(live_server.base_url, "jobs", "list", "--status", "succeeded"), "--status")


# ---------------------------------------------------------------- universes


@pytest.fixture(scope="module")
def sweep_model(live_server: LiveServer, tiny_llama_dir: Path) -> str:
    """``sweep/tiny`` with two ready concepts, ``sweep-a`` and ``sweep-b``, and no universe yet."""
    records = [{"prompt": p, "completion": c} for p, c in _FACTS]
    with EngramClient(live_server.base_url) as engram:
        engram.register_model(SWEEP_MODEL, f"file://{tiny_llama_dir}")
        jobs = [
            engram.add_concept(name, [SWEEP_MODEL], records=part).jobs[0].job_id
            for name, part in (("sweep-a", records[:8]), ("sweep-b", records[8:]))
        ]
        assert {job.status for job in engram.wait_for_jobs(jobs, poll_s=0.1)} == {"succeeded"}
    return SWEEP_MODEL


def test_universes_build_list_show_and_usage(live_server: LiveServer, api: httpx.Client, sweep_model: str) -> None:
    """The README's universes section had only curl: the CLI could neither build one nor show the
    IDs that ``unlearn --universe`` takes."""
    url = live_server.base_url
    assert json.loads(ok(run_cli(url, "--json", "universes", "list", sweep_model)).stdout) == []
    built = ok(run_cli(url, "--json", "universes", "build", sweep_model, "-c", "sweep-a", "-c", "sweep-b"))
    universe = json.loads(built.stdout)
    assert universe["status"] == "ready" and universe["current"] is True
    assert sorted(m["name"] for m in universe["members"]) == ["sweep-a", "sweep-b"]
    universe_id = universe["universe_id"]
    assert universe_id in built.stderr  # the build was watched and named

    assert json.loads(ok(run_cli(url, "--json", "universes", "show", universe_id)).stdout) == (
        api.get(f"/universes/{universe_id}").json()
    )
    listed = ok(run_cli(url, "universes", "list", sweep_model)).stdout
    assert universe_id in listed and "sweep-a" in listed
    shown = ok(run_cli(url, "universes", "show", universe_id)).stdout
    assert universe_id in shown and "ready" in shown

    usage = json.loads(ok(run_cli(url, "--json", "universes", "usage", "-m", sweep_model)).stdout)
    assert usage == api.get("/universes/usage", params={"model_id": sweep_model}).json()
    assert "budget" in ok(run_cli(url, "universes", "usage")).stdout

    again = ok(run_cli(url, "--json", "universes", "build", sweep_model))  # every ready concept: the same one
    assert json.loads(again.stdout)["universe_id"] == universe_id
    failed(run_cli(url, "universes", "show", "nope"), "Not found (404)")


# ---------------------------------------------------------------- Ctrl-C while downloading


def test_ctrl_c_while_downloading_says_nothing_was_written(cli2: ReadyVariant, api: httpx.Client, tmp_path: Path) -> None:
    """Ctrl-C mid-download exited 130 without a word. A stand-in for the service serves the real
    variant's manifest, with one file of 1 GiB, and then that file slowly: a real server cannot be made to stall on cue."""
    variant = api.get(f"/variants/{cli2.variant_id}").json()
    variant["files"] = [{"path": "model.safetensors", "size": 1 << 30, "sha256": "0" * 64}]
    manifest = json.dumps(variant).encode()

    class Slow(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (the stdlib's name)
            if "/files/" not in self.path:
                self.send_response(200)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(manifest)))
                self.end_headers()
                self.wfile.write(manifest)
                return
            self.send_response(200)
            self.send_header("content-length", str(1 << 30))
            self.end_headers()
            try:
                for _ in range(1200):  # 64 KiB every 0.05 s, of 1 GiB: the download does not end by itself
                    self.wfile.write(bytes(1 << 16))
                    self.wfile.flush()
                    time.sleep(0.05)
            except OSError:
                pass

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Slow)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    out = tmp_path / "variant"
    env = {k: v for k, v in os.environ.items() if not k.startswith("ENGRAM_") and k != "COLUMNS"}
    env.update(ENGRAM_URL=f"http://127.0.0.1:{server.server_address[1]}", PYTHONPATH=str(REPO_ROOT))
    argv = [sys.executable, "-m", "engram_client.cli", "variants", "download", cli2.variant_id, "--out", str(out)]
    process = subprocess.Popen(argv, cwd=REPO_ROOT, env=env, stderr=subprocess.PIPE, text=True)
    try:
        assert process.stderr is not None
        line = process.stderr.readline()  # the first progress line: bytes are arriving
        assert line.startswith("download "), line
        process.send_signal(signal.SIGINT)
        stderr = line + process.stderr.read()
        assert process.wait(timeout=30) == 130, stderr
    finally:
        process.kill()
        server.shutdown()
    assert "Traceback" not in stderr and "Download interrupted" in stderr and "run the same command again" in stderr
    assert not out.exists()
    assert not list(tmp_path.iterdir()), list(tmp_path.iterdir())  # no staging directory left behind


def test_unlearn_json_prints_the_variant_with_or_without_waiting(cli2: ReadyVariant) -> None:
    """``engram --json unlearn … | jq -r .variant_id`` works with --no-wait too: both print the
    variant (a build not finished names its job in ``job_id``)."""
    args = ("--json", "unlearn", "cli2-tiny", "-c", "cli2-forget", "--alpha", "0.37")
    submitted = json.loads(ok(run_cli(cli2.url, *args, "--no-wait")).stdout)
    assert submitted["status"] in {"building", "ready"} and len(submitted["variant_id"]) == 32
    assert submitted["status"] == "ready" or submitted["job_id"]
    waited = json.loads(ok(run_cli(cli2.url, *args)).stdout)
    assert waited["variant_id"] == submitted["variant_id"] and waited["status"] == "ready"


def test_force_never_replaces_a_file_with_the_variant(cli2: ReadyVariant, tmp_path: Path) -> None:
    precious = tmp_path / "model.safetensors"
    precious.write_bytes(b"my weights")
    result = run_cli(cli2.url, "variants", "download", cli2.variant_id, "--out", precious, "--force")
    assert result.returncode != 0 and "is a file" in result.stderr, result.stderr
    assert precious.read_bytes() == b"my weights"


def test_model_and_variant_views_name_the_layers_left_as_they_are(capsys: pytest.CaptureFixture[str]) -> None:
    """``models show`` names layers the checkpoint lacks; ``variants show`` the ones no concept reached."""
    from api_schemas import Model, Variant
    from engram_client.cli.render import render_model, render_variant

    render_model(
        Model(
            model_id="m",
            source="file:///m",
            digest="d",
            architecture="LlavaForConditionalGeneration",
            num_parameters=1,
            layers=[],
            layers_not_in_checkpoint=["lm_head"],
        )
    )
    render_variant(
        Variant(
            variant_id="v" * 32,
            model_id="m",
            terms={"a": -1.0},
            alpha=1.0,
            scaling="uniform",
            format="checkpoint",
            reference=[],
            status="ready",
            unreached_layers=["model.vision_tower.encoder.layers.0.mlp.fc1"],
        )
    )
    shown = capsys.readouterr().out
    assert "not in the checkpoint (never edited): lm_head" in shown
    assert "reached by no concept: model.vision_tower.encoder.layers.0.mlp.fc1" in shown
