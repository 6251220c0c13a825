"""A job process imports every job body when it starts, not in its first job (issue 27).

Importing the bodies (torch, transformers, the domains) costs seconds; the first variant after a
restart paid them inside its job. Now embedded mode's job process imports them as soon as no job
runs (a registration that arrives at start-up runs first, importing only its own body; never two
threads importing transformers at once), and says so when done (``/readyz``: ``job_process``
``starting`` → ``ready``); a Celery worker imports them at ``worker_init``, before its pool forks.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

from engram_fixtures.live import REPO_ROOT, running_server
from service.execution.kinds import KINDS


def test_import_bodies_imports_every_kinds_module_and_importing_the_table_imports_none() -> None:
    script = (
        "import json, sys\n"
        "from service.execution.kinds import KINDS, import_bodies\n"
        "before = [k.body_path.split(':')[0] for k in KINDS.values() if k.body_path.split(':')[0] in sys.modules]\n"
        "import_bodies()\n"
        "after = [k.body_path.split(':')[0] for k in KINDS.values() if k.body_path.split(':')[0] in sys.modules]\n"
        "print(json.dumps({'before': before, 'after': after, 'torch': 'torch' in sys.modules}))\n"
    )
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["before"] == [], "importing the kind table must not import a body (the API imports it)"
    assert sorted(seen["after"]) == sorted(k.body_path.split(":")[0] for k in KINDS.values())
    assert seen["torch"]


def test_readyz_says_when_the_job_process_is_warm(tmp_path: Path) -> None:
    (tmp_path / "models").mkdir()
    with running_server(tmp_path, tmp_path / "models") as server:
        seen = []
        deadline = time.monotonic() + 240
        while True:
            ready = server.client.get("/readyz")
            assert ready.status_code == 200, ready.text  # jobs queue meanwhile: the service is ready
            seen.append(ready.json()["job_process"])
            if seen[-1] == "ready" or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert seen[-1] == "ready", f"the job process never said it was warm: {seen[-5:]}\n{server.log_tail()}"
        assert set(seen) <= {"starting", "ready"}
