"""Evaluation, generation and calibration render chat templates in the job's bounded template
process, as collection does (issue 23, finding 3), on a live server (embedded mode).

A chat template is a program from the model folder. Before, a messages probe was rendered with
``apply_chat_template`` in the job process itself: a looping template in an evaluate job ran until
the grace kill replaced the whole job process (ENGRAM_CANCEL_GRACE_S), and ``'a' * 1500000000`` was
unbounded. Now:

- the renderer's token IDs are ``apply_chat_template``'s, so a chat probe's NLL is what it was;
- a looping template in an evaluate job is cancelled by DELETE within seconds, by the job process
  itself (its pid unchanged, the render process gone), and the next evaluation runs;
- a template past a bound fails the job (422) naming the setting, in evaluate and generate jobs,
  and in the calibration's probe check.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from transformers import AutoModelForCausalLM, AutoTokenizer

from engram_fixtures.live import LiveServer, running_server, wait_concepts_ready, wait_for_job, wait_variant_ready
from engram_fixtures.models import CHAT_TEMPLATE, make_tiny_chat_llama
from service.calibration.candidates import check_probes
from service.engine.chat import generation_prompt, last_turn
from service.engine.evaluate import TextProbe, answer_nll
from service.engine.messages import Message
from service.engine.template_render import TemplateLimits, TemplateProcess
from service.errors import JobFailed
from tests.helpers.api import register_model
from tests.helpers.job_process import job_process, template_children

LOOPING = (
    "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
    "{% for m in messages %}{{ m['content'] }}{% endfor %}"
)
HUGE_REPEAT = "{{ 'a' * 1500000000 }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
# A template of the common shape: a system default, role headers, the generation prompt, specials.
SYSTEM_DEFAULT = (
    "{{ bos_token }}{% if messages[0]['role'] != 'system' %}<|system|>\nYou are helpful.{{ eos_token }}\n{% endif %}"
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] | trim }}{{ eos_token }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
TEMPLATES = {"plain": CHAT_TEMPLATE, "looping": LOOPING, "repeat": HUGE_REPEAT}
CONVERSATIONS = [
    [{"role": "user", "content": "Where was Ada born?"}, {"role": "assistant", "content": "In Quillmoor."}],
    [
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": "hi there"},
        {"role": "assistant", "content": "hello back"},
        {"role": "user", "content": "and the capital of Brindle?"},
        {"role": "assistant", "content": " Ostrava, of course "},
    ],
]
PROBES = [{"messages": c} for c in CONVERSATIONS]
TEXT = [{"text": f"the quiet cat number {i} sat on the warm mat"} for i in range(8)]
REFERENCE = [{"text": f"a loud dog number {i} ran across the cold field"} for i in range(16)]
GRACE_S = 30  # the grace kill would replace the job process only after this: a cancel before it is the job's own


def limits() -> TemplateLimits:
    return TemplateLimits(max_chars=1 << 20, memory_bytes=1 << 30, timeout_s=30)


def as_messages(conversation: list[dict[str, str]]) -> list[Message]:
    return [Message(m["role"], m["content"]) for m in conversation]


@pytest.mark.parametrize("template", [CHAT_TEMPLATE, SYSTEM_DEFAULT])
def test_the_bounded_renderer_gives_apply_chat_template_s_token_ids(tmp_path: Path, template: str) -> None:
    tokenizer = AutoTokenizer.from_pretrained(make_tiny_chat_llama(tmp_path / "m", template=template))
    with TemplateProcess(limits()) as renderer:
        for conversation in CONVERSATIONS:
            messages = as_messages(conversation)
            assert last_turn(tokenizer, messages, renderer) == last_turn(tokenizer, messages)
            expected = tokenizer.apply_chat_template(
                conversation[:-1], tokenize=True, add_generation_prompt=True, return_dict=False
            )
            assert generation_prompt(tokenizer, messages[:-1], renderer) == expected


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    root = tmp_path_factory.mktemp("bounded-eval")
    models = root / "models"
    for name, template in TEMPLATES.items():
        make_tiny_chat_llama(models / name, template=template)
    env = {"ENGRAM_TEMPLATE_TIMEOUT_S": "60", "ENGRAM_CANCEL_GRACE_S": str(GRACE_S)}
    with running_server(root, models, **env) as live:
        api = live.client
        for name in TEMPLATES:
            register_model(api, f"t/{name}", f"file://{models / name}", existing_ok=True)
        # text records: collecting them renders no template, so every model gets a variant to evaluate
        # (and a universe to calibrate on)
        for name, role, records in (("cats", "target", TEXT), ("dogs", "reference", REFERENCE)):
            body = {"name": name, "role": role, "models": [f"t/{n}" for n in TEMPLATES], "records": records}
            response = api.post("/concepts", json=body)
            assert response.status_code == 202, response.text
        wait_concepts_ready(api, ["cats", "dogs"], timeout=180)
        yield live


@pytest.fixture(scope="module")
def variants(server: LiveServer) -> dict[str, str]:
    api, ids = server.client, {}
    for name in TEMPLATES:
        response = api.post(f"/models/t/{name}/unlearn", json={"concepts": ["cats"], "alpha": 1.0, "format": "delta"})
        assert response.status_code in (200, 202), response.text
        ids[name] = wait_variant_ready(api, response.json()["variant"]["variant_id"], timeout=180)["variant_id"]
    return ids


def evaluate(api: httpx.Client, variant_id: str, probes: list[dict[str, Any]]) -> dict[str, Any]:
    response = api.post(f"/variants/{variant_id}/evaluate", json={"forget": probes, "retain": probes})
    assert response.status_code in (200, 202), response.text
    return dict(response.json())


def wait_rendering(server: LiveServer, job_id: str, timeout: float = 120) -> int:
    """The job process, once the job's render process runs (the template is being rendered)."""
    deadline = time.monotonic() + timeout
    pid = job_process(server)
    while not template_children(pid):
        status = server.client.get(f"/jobs/{job_id}").json()["status"]
        assert status in ("queued", "running") and time.monotonic() < deadline, f"no render process ({status})"
        time.sleep(0.05)
    return pid


def test_a_chat_probe_s_nll_is_what_apply_chat_template_gives(server: LiveServer, variants: dict[str, str]) -> None:
    api = server.client
    job = wait_for_job(api, evaluate(api, variants["plain"], PROBES)["job_id"], timeout=180)
    assert job["status"] == "succeeded", job
    folder = server.model_root / "plain"
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    direct = answer_nll(model, tokenizer, [TextProbe(messages=c) for c in CONVERSATIONS])  # rendered in this process
    served = [r["base"]["nll"] for r in job["result"]["records"] if r["split"] == "forget"]
    assert served == pytest.approx(direct, rel=1e-5)
    assert template_children(job_process(server)) == []  # the render process went with the job


def test_a_looping_template_in_an_evaluate_job_is_cancelled_by_the_job_process(
    server: LiveServer, variants: dict[str, str]
) -> None:
    api = server.client
    job = evaluate(api, variants["looping"], PROBES)
    pid = wait_rendering(server, job["job_id"])
    time.sleep(0.5)  # well inside the loop
    asked = time.monotonic()
    assert api.delete(f"/jobs/{job['job_id']}").status_code == 200
    final = wait_for_job(api, job["job_id"], timeout=GRACE_S)
    latency = time.monotonic() - asked
    print(f"\nlooping template in an evaluate job: cancelled {latency:.2f}s after DELETE")  # noqa: T201
    assert final["status"] == "cancelled", final
    assert latency < 8.0  # typically well under a second; the margin is for a loaded machine
    assert job_process(server) == pid  # stopped by its own check, not by the grace kill of the process
    assert template_children(pid) == []
    after = wait_for_job(api, evaluate(api, variants["plain"], PROBES[:1])["job_id"], timeout=120)
    assert after["status"] == "succeeded", after  # the lane is free again


def test_a_huge_repeat_fails_the_evaluate_job_naming_the_setting(server: LiveServer, variants: dict[str, str]) -> None:
    api = server.client
    final = wait_for_job(api, evaluate(api, variants["repeat"], PROBES)["job_id"], timeout=120)
    assert final["status"] == "failed", final
    assert final["error"]["status"] == 422, final["error"]
    assert "ENGRAM_TEMPLATE_MAX_CHARS" in final["error"]["detail"], final["error"]
    assert final["error"]["detail"].startswith("forget[0]: "), final["error"]


def test_a_huge_repeat_fails_the_generate_job_naming_the_setting(server: LiveServer, variants: dict[str, str]) -> None:
    api = server.client
    body = {"messages": CONVERSATIONS[0][:1], "max_new_tokens": 2}
    response = api.post(f"/variants/{variants['repeat']}/generate", json=body)
    assert response.status_code in (200, 202), response.text
    final = wait_for_job(api, response.json()["job_id"], timeout=120)
    assert final["status"] == "failed", final
    assert final["error"]["status"] == 422, final["error"]
    assert "ENGRAM_TEMPLATE_MAX_CHARS" in final["error"]["detail"], final["error"]


def calibrate(api: httpx.Client, model: str) -> dict[str, Any]:
    body = {"concepts": ["cats"], "forget": PROBES, "retain": PROBES, "budget": 2}
    response = api.post(f"/models/t/{model}/calibrate", json=body)
    assert response.status_code in (200, 202), response.text
    return dict(response.json()["job"])


def test_a_looping_template_in_a_calibrate_job_is_cancelled_by_the_job_process(server: LiveServer) -> None:
    api = server.client
    job = calibrate(api, "looping")
    pid = wait_rendering(server, job["job_id"])
    asked = time.monotonic()
    assert api.delete(f"/jobs/{job['job_id']}").status_code == 200
    final = wait_for_job(api, job["job_id"], timeout=GRACE_S)
    latency = time.monotonic() - asked
    print(f"\nlooping template in a calibrate job: cancelled {latency:.2f}s after DELETE")  # noqa: T201
    assert final["status"] == "cancelled", final
    assert latency < 8.0
    assert job_process(server) == pid
    assert template_children(pid) == []


def test_a_huge_repeat_fails_the_calibrate_job_naming_the_setting(server: LiveServer) -> None:
    final = wait_for_job(server.client, calibrate(server.client, "repeat")["job_id"], timeout=180)
    assert final["status"] == "failed", final
    assert final["error"]["status"] == 422, final["error"]
    assert "ENGRAM_TEMPLATE_MAX_CHARS" in final["error"]["detail"], final["error"]


def test_calibration_s_probe_check_renders_in_the_bounded_process(tmp_path: Path) -> None:
    """The calibration job checks and encodes its probes once, through the job's renderer
    (service.calibration.build passes it); a huge repeat is refused naming the setting."""
    tokenizer = AutoTokenizer.from_pretrained(make_tiny_chat_llama(tmp_path / "m", template=HUGE_REPEAT))
    probes = {"forget": [TextProbe(messages=CONVERSATIONS[0])], "retain": []}
    with TemplateProcess(limits()) as renderer, pytest.raises(JobFailed, match="ENGRAM_TEMPLATE_MAX_CHARS"):
        check_probes(tokenizer, probes, renderer)
