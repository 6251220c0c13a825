"""engram_fixtures.cache: a trained fixture is built once per cache, found by content, published whole,
rebuilt when partial or corrupt, and built once when two processes ask at once; the cached demo is
the bytes a fresh build_demo gives."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from engram_fixtures.cache import MANIFEST, cache_key, cached_build, copy_entry, entry_is_complete
from engram_fixtures.demo import build_demo, cached_demo, cached_retain_model
from engram_fixtures.live import REPO_ROOT
from tests.helpers import warm


class Builder:
    """Writes two files and counts its calls."""

    def __init__(self, text: str = "weights") -> None:
        self.calls = 0
        self.text = text

    def __call__(self, folder: Path) -> None:
        self.calls += 1
        (folder / "model").mkdir()
        (folder / "model" / "weights.bin").write_text(self.text)
        (folder / "forget.jsonl").write_text("{}\n")


def test_an_entry_is_built_once_and_found_by_content(tmp_path: Path) -> None:
    build = Builder()
    first = cached_build("demo", {"steps": 2}, [Path(__file__)], build, tmp_path)
    again = cached_build("demo", {"steps": 2}, [Path(__file__)], build, tmp_path)
    assert first == again and build.calls == 1
    assert (first / "model" / "weights.bin").read_text() == "weights" and entry_is_complete(first)
    assert first.stat().st_mode & 0o777 == 0o755  # readable by a server running as another user
    # Another parameter, or another source, is another entry.
    other = cached_build("demo", {"steps": 3}, [Path(__file__)], build, tmp_path)
    assert other != first and build.calls == 2
    # Nothing is left beside the entries but their locks.
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.endswith(".lock")) == sorted([first.name, other.name])


def test_a_source_change_is_a_new_key(tmp_path: Path) -> None:
    code = tmp_path / "builder.py"
    code.write_text("x = 1\n")
    before = cache_key({"steps": 2}, [code])
    code.write_text("x = 2\n")
    assert cache_key({"steps": 2}, [code]) != before


@pytest.mark.parametrize("damage", ["changed bytes", "missing file", "no manifest", "truncated manifest"])
def test_a_partial_or_corrupt_entry_is_rebuilt(tmp_path: Path, damage: str) -> None:
    build = Builder()
    entry = cached_build("demo", {}, [Path(__file__)], build, tmp_path)
    weights = entry / "model" / "weights.bin"
    if damage == "changed bytes":
        weights.write_text("weightz")  # same size: only the hash tells
    elif damage == "missing file":
        weights.unlink()
    elif damage == "no manifest":
        (entry / MANIFEST).unlink()
    else:
        (entry / MANIFEST).write_text((entry / MANIFEST).read_text()[:20])
    assert not entry_is_complete(entry)
    assert cached_build("demo", {}, [Path(__file__)], build, tmp_path) == entry
    assert build.calls == 2 and weights.read_text() == "weights" and entry_is_complete(entry)


def test_a_failed_build_leaves_no_entry_and_no_staging(tmp_path: Path) -> None:
    def failing(folder: Path) -> None:
        (folder / "half.bin").write_text("half")
        raise RuntimeError("out of memory")

    with pytest.raises(RuntimeError, match="out of memory"):
        cached_build("demo", {}, [Path(__file__)], failing, tmp_path)
    assert [p.name for p in tmp_path.iterdir() if not p.name.endswith(".lock")] == []


def test_a_copy_is_private_and_has_no_manifest(tmp_path: Path) -> None:
    entry = cached_build("demo", {}, [Path(__file__)], Builder(), tmp_path / "cache")
    copy = copy_entry(entry, tmp_path / "copy")
    (copy / "model" / "weights.bin").write_text("edited by a test")
    assert not (copy / MANIFEST).exists()
    assert entry_is_complete(entry)  # the cache is as built
    assert oct((copy / "forget.jsonl").stat().st_mode & 0o777) == "0o644"


# Two processes ask for one entry at once: the second waits on the lock for the first one's build.
RACER = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from engram_fixtures.cache import cached_build

    cache, log = Path(sys.argv[1]), Path(sys.argv[2])

    def build(folder):
        with log.open("a") as out:
            out.write("built\\n")
        time.sleep(2)  # long enough for the other process to arrive while this one builds
        (folder / "weights.bin").write_text("weights")

    print(cached_build("race", {"n": 1}, [Path(sys.argv[3])], build, cache))
    """
)


def test_two_processes_asking_at_once_build_once(tmp_path: Path) -> None:
    script, log = tmp_path / "racer.py", tmp_path / "builds.log"
    script.write_text(RACER)
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    command = [sys.executable, str(script), str(tmp_path / "cache"), str(log), str(script)]
    racers = [subprocess.Popen(command, env=env, stdout=subprocess.PIPE, text=True) for _ in range(2)]
    outputs = [racer.communicate(timeout=120)[0].strip() for racer in racers]
    assert [racer.returncode for racer in racers] == [0, 0]
    assert outputs[0] == outputs[1] and Path(outputs[0]).name.startswith("race-")
    assert log.read_text() == "built\n"


def test_the_cached_demo_is_the_bytes_a_fresh_build_gives(tmp_path: Path) -> None:
    """Two training steps on 20 facts: the cached entry and a plain build_demo (one thread) agree
    byte for byte, and the retain model is trained with the demo's tokenizer."""
    fresh = build_demo(tmp_path / "fresh", n_facts=20, forget_fraction=0.1, seed=1, steps=2, threads=1)
    cached = cached_demo(n_facts=20, forget_fraction=0.1, seed=1, steps=2, cache_dir=tmp_path / "cache")
    for name in ("model/model.safetensors", "model/tokenizer.json", "forget.jsonl", "retain.jsonl"):
        assert (cached.root / name).read_bytes() == (fresh.root / name).read_bytes(), name
    retain = cached_retain_model(n_facts=20, forget_fraction=0.1, seed=1, steps=2, cache_dir=tmp_path / "cache")
    assert (retain / "tokenizer.json").read_bytes() == (fresh.root / "model" / "tokenizer.json").read_bytes()
    assert (retain / "model.safetensors").read_bytes() != (fresh.root / "model" / "model.safetensors").read_bytes()
    assert cached_demo(n_facts=20, forget_fraction=0.1, seed=1, steps=2, cache_dir=tmp_path / "cache") == cached


# ---------------------------------------------------------------- the session's warm-up (tests.helpers.warm)


class Item:
    def __init__(self, *fixtures: str) -> None:
        self.fixturenames = list(fixtures)


def test_the_warm_up_builds_what_the_session_uses_in_order_of_first_use() -> None:
    items = [Item("tmp_path"), Item("retain_model", "mini_tofu_demo"), Item("chat_demo"), Item("mini_tofu_demo")]
    assert warm.builders_for(items) == [
        "engram_fixtures.demo:mini_tofu",
        "engram_fixtures.demo:tofu_retain_model",
        "engram_fixtures.demo:chat_tofu",
    ]
    assert warm.builders_for([Item("api"), Item("tmp_path")]) == []
    assert warm.start([]) == []


def test_a_warm_up_runs_its_builders_and_a_failed_one_is_said(tmp_path: Path) -> None:
    [done] = warm.start(["os:getcwd"], cache=tmp_path)
    done.process.wait(timeout=60)
    assert done.process.returncode == 0 and warm.failure(done) is None and not done.log.exists()
    [failed] = warm.start(["os:getcwd", "json:dumps"], cache=tmp_path)  # dumps() wants an argument
    failed.process.wait(timeout=60)
    said = warm.failure(failed)
    assert said is not None and "json:dumps" in said and "TypeError" in said and "os:getcwd: " in said
    # A session that ends first stops it: SIGTERM, answered by unwinding (a build removes its staging).
    [slow] = warm.start(["signal:pause"], cache=tmp_path)
    time.sleep(1)
    warm.stop(slow)
    # 143: its handler unwound; -15: the signal came before the interpreter had installed the handler
    assert slow.process.returncode in (128 + signal.SIGTERM, -signal.SIGTERM) and warm.failure(slow) is None
