"""Why Engram's Privacy is 0 on mini-TOFU: the MIA AUCs of each edit against the retain model, along α.

    python -m bench.tofu_sweep --small --n-facts 100 --steps 300 --threads 2

Privacy (:mod:`service.evaluation.tofu_metrics`) is the harmonic mean of four attacks' scores
``1 − 2·|AUC − 0.5|``, each AUC separating the model's per-probe scores on the forget facts from the
retain model's on the same facts: one attack that separates them fully (AUC 0 or 1) makes Privacy
0. This tool trains the base and retain models as :mod:`bench.tofu` does (or loads them from
``--models``), builds one Engram variant at α = 1 per arm through the live API, and scores the
whole α line of each arm in-process: an Engram edit is linear in α (``W + α·ΔW``, every scaling),
so the variant at α is the base plus α times the variant at 1's difference (what
``tests/e2e/test_calibrate_tofu.py`` checks against built variants).

Each row: the arm, α, model utility relative to the base's (the calibration's floor reads
``model_utility``), Memorization, Privacy, the four AUCs against the retain model, the forget
answers' mean loss (nats/token) next to the retain model's, and Overall.
"""

# ruff: noqa: T201  (a command-line tool: printing is its output)

from __future__ import annotations

import argparse
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import AutoModelForCausalLM, PreTrainedModel, PreTrainedTokenizerFast

from bench.tofu import BASE_ID, RETAIN_ID, MiniTofu, _download, _job, mini_tofu, model_report, pooled_facts, train_model
from engram_fixtures.demo import split_forget, train_tokenizer
from engram_fixtures.live import post_and_wait, start_server, stop_server, wait_concepts_ready
from engram_fixtures.models import interpolated
from service.evaluation import tofu_metrics as tm

ATTACKS = ("mia_loss", "mia_zlib", "mia_min_k", "mia_min_k_plus_plus")
# module-name suffixes of the tiny Llama, as the calibration's presets select them
MODULES: dict[str, list[str] | None] = {
    "all": None,
    "qk_gate": ["q_proj", "k_proj", "gate_proj"],
    "attention": ["q_proj", "k_proj", "v_proj", "o_proj"],
    "mlp": ["gate_proj", "up_proj", "down_proj"],
}
ALPHAS = (0.25, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0)


@dataclass(frozen=True)
class ArmSpec:
    """One edit direction: module set, blocks (None: every block) and scaling."""

    modules: str
    layers: tuple[int, ...] | None
    scaling: str

    @property
    def name(self) -> str:
        blocks = "" if self.layers is None else "@" + ",".join(map(str, self.layers))
        return f"{self.modules}{blocks}/{self.scaling}"

    def body(self) -> dict[str, Any]:
        body: dict[str, Any] = {"concepts": ["tofu-forget"], "alpha": 1.0, "scaling": self.scaling}
        if MODULES[self.modules] is not None:
            body["modules"] = MODULES[self.modules]
        if self.layers is not None:
            body["layers"] = list(self.layers)
        return body


def trained(
    tokenizer: PreTrainedTokenizerFast, facts: list[Any], retain: list[Any], args: argparse.Namespace, cache: Path
) -> dict[str, PreTrainedModel]:
    """The base and retain models, trained as bench.tofu trains them, cached under ``cache``."""
    models: dict[str, PreTrainedModel] = {}
    for name, train_facts, steps in (("base", facts, args.steps), ("retain", retain, args.retain_steps or args.steps)):
        folder = cache / name
        if (folder / "config.json").exists():
            models[name] = AutoModelForCausalLM.from_pretrained(folder).eval()
            continue
        started = time.perf_counter()
        models[name] = train_model(tokenizer, train_facts, args.seed, steps, args.small).eval()
        models[name].save_pretrained(folder)
        tokenizer.save_pretrained(folder)
        print(f"trained {name}: {len(train_facts)} facts, {steps} steps, {time.perf_counter() - started:.1f} s")
    return models


def variants_at_one(
    models: dict[str, PreTrainedModel], sets: MiniTofu, arms: Sequence[ArmSpec], work: Path, cache: Path
) -> dict[ArmSpec, PreTrainedModel]:
    """Each arm's variant at α = 1, built through the live API (embedded mode) and downloaded."""
    server = start_server(work / "store", cache, work / "server.log")
    try:
        client = server.client
        for model_id, name in ((BASE_ID, "base"), (RETAIN_ID, "retain")):
            post_and_wait(client, "/models", {"model_id": model_id, "source": f"file://{cache / name}"}, 600)
        for concept, role, probes in (("tofu-forget", "target", sets.forget), ("tofu-retain", "reference", sets.retain)):
            records = [{"prompt": p.probe.prompt, "completion": p.probe.completion} for p in probes]
            body = {"name": concept, "role": role, "models": [BASE_ID], "records": records}
            assert client.post("/concepts", json=body).status_code == 202
        wait_concepts_ready(client, ["tofu-forget", "tofu-retain"], BASE_ID, timeout=1800)
        out: dict[ArmSpec, PreTrainedModel] = {}
        # the linearity the sweep relies on, checked once: a variant built at α = 0.6 against the
        # interpolation of the one built at 1
        check = {**ArmSpec("all", None, "uniform").body(), "alpha": 0.6}
        response = client.post(f"/models/{BASE_ID}/unlearn", json=check)
        _job(client, response)
        built = _download(client, response.json()["variant"]["variant_id"], work / "check")
        for arm in arms:
            response = client.post(f"/models/{BASE_ID}/unlearn", json=arm.body())
            _job(client, response)
            target = work / arm.name.replace("/", "_").replace("@", "_").replace(",", "-")
            out[arm] = _download(client, response.json()["variant"]["variant_id"], target)
        one = out.get(ArmSpec("all", None, "uniform"))
        if one is not None:
            line = interpolated(models["base"], one, 0.6, AutoModelForCausalLM.from_pretrained(cache / "base"))
            gap = max(float((a - b).abs().max()) for a, b in zip(line.parameters(), built.parameters(), strict=True))
            print(f"linearity: all/uniform at α=0.6, built vs interpolated from α=1: max |ΔW| {gap:.2e}")
        return out
    finally:
        stop_server(server)


def _row(label: str, report: tm.ModelReport, base_mu: float, retain_loss: float) -> str:
    v = report.values
    aucs = "".join(f"{v.get(f'{a}_auc_vs_retain', float('nan')):>8.3f}" for a in ATTACKS)
    loss = float(np.mean(report.forget_mia_scores["mia_loss"]))
    return (
        f"{label:<26}{v['model_utility'] / base_mu:>7.3f}{v.get('memorization', float('nan')):>7.3f}"
        f"{v.get('privacy', float('nan')):>7.3f}{aucs}{loss:>8.2f}{retain_loss:>8.2f}{v.get('overall', float('nan')):>8.3f}"
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.tofu_sweep", description=__doc__.splitlines()[0])
    parser.add_argument("--n-facts", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--retain-steps", type=int, default=None, help="the retain model's steps (default: --steps)")
    parser.add_argument("--small", action="store_true", help="the tests' tiny model shape (hidden 64, 2 layers)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--answer-pool", type=int, default=None, help="as bench.tofu's (pooled_facts)")
    parser.add_argument("--models", type=Path, default=None, help="cache the trained base/retain models here")
    parser.add_argument("--arms", default="all/uniform,all/weight_norm,qk_gate/uniform,mlp/uniform,attention/uniform")
    parser.add_argument("--alphas", default=",".join(map(str, ALPHAS)))
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    facts = pooled_facts(args.n_facts, args.seed, args.answer_pool)
    forget, retain = split_forget(facts, 0.1, args.seed)
    tokenizer = train_tokenizer([p + c for p, c in facts])
    arms = []
    for text in args.arms.split(","):
        head, scaling = text.split("/")
        modules, _, blocks = head.partition("@")
        arms.append(ArmSpec(modules, tuple(int(b) for b in blocks.split("-")) if blocks else None, scaling))
    alphas = [float(a) for a in args.alphas.split(",")]
    with tempfile.TemporaryDirectory(prefix="bench-tofu-sweep-") as scratch:
        cache = args.models or Path(scratch) / "models"
        models = trained(tokenizer, facts, retain, args, cache)
        sets = mini_tofu(facts, forget, args.seed, n_holdout=len(forget), pooled=args.answer_pool is not None)
        raw = {name: model_report(model, tokenizer, sets) for name, model in models.items()}
        base_mu = raw["base"].values["model_utility"]
        retain_loss = float(np.mean(raw["retain"].forget_mia_scores["mia_loss"]))
        print(f"mini-TOFU sweep: {args.n_facts} facts, {len(sets.forget)} forgotten, seed {args.seed}, steps {args.steps}")
        head = f"{'model / arm α':<26}{'MU/base':>7}{'Mem':>7}{'Priv':>7}" + "".join(f"{a[4:12]:>8}" for a in ATTACKS)
        print(f"{head}{'loss':>8}{'ret.loss':>8}{'Overall':>8}")
        for name in ("base", "retain"):
            print(_row(name, tm.tofu_scores(raw[name], raw["retain"], raw["base"]), base_mu, retain_loss))
        for attack in ATTACKS:  # against the holdout (never-seen facts): OpenUnlearning's raw AUCs
            print(f"  {attack} vs holdout: base {raw['base'].values[attack]:.3f}, retain {raw['retain'].values[attack]:.3f}")
        at_one = variants_at_one(models, sets, arms, Path(scratch), cache)
        scratch_model = AutoModelForCausalLM.from_pretrained(cache / "base").eval()
        for arm, one in at_one.items():
            for alpha in alphas:
                model = interpolated(models["base"], one, alpha, scratch_model)
                report = tm.tofu_scores(model_report(model, tokenizer, sets), raw["retain"], raw["base"])
                print(_row(f"{arm.name} {alpha:g}", report, base_mu, retain_loss), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
