"""JSON logs carry no tqdm bars (issue 40: "Writing model shards" and "Loading weights" bars ended up between
the JSON lines), in the process that configured logging and in a process it spawns later."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

from engram_fixtures.live import REPO_ROOT

SCRIPT = textwrap.dedent(
    """
    import multiprocessing, sys
    from pathlib import Path

    def save_and_load(folder):
        from engram_fixtures.models import make_tiny_llama
        from transformers import AutoModelForCausalLM
        make_tiny_llama(Path(folder), hidden=16, layers=1)
        AutoModelForCausalLM.from_pretrained(folder)

    if __name__ == "__main__":
        import transformers  # imported before logging is configured, as the API's app does
        from service.observability import configure_logging
        configure_logging(log_format=sys.argv[1])
        save_and_load(sys.argv[2] + "/here")
        child = multiprocessing.get_context("spawn").Process(target=save_and_load, args=(sys.argv[2] + "/child",))
        child.start(); child.join()
        sys.exit(child.exitcode)
    """
)


def run(log_format: str, tmp_path: Path) -> str:
    script = tmp_path / "bars.py"
    script.write_text(SCRIPT)
    done = subprocess.run(
        [sys.executable, str(script), log_format, str(tmp_path)],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1"},
    )
    assert done.returncode == 0, done.stderr
    return done.stderr


def test_json_logs_have_no_progress_bars_here_or_in_a_spawned_process(tmp_path: Path) -> None:
    stderr = run("json", tmp_path)
    for line in stderr.splitlines():
        if line.strip():
            json.loads(line)  # every line a JSON object: no bar, no fragment of one
    assert "Writing model shards" not in stderr and "Loading weights" not in stderr


def test_text_logs_keep_the_bars_a_person_at_a_terminal_reads(tmp_path: Path) -> None:
    """The control: the same script with text logs shows the bars, so the JSON case proves something."""
    stderr = run("text", tmp_path)
    assert "Writing model shards" in stderr or "Loading weights" in stderr, stderr
