"""A bad drafter / teacher directory is refused by the job before any cluster work:
`python -m jobs.evaluate`, `jobs.publish` and `jobs.train --teacher` on a truncated
model.safetensors and on a drafter of another target exit 2 with one stderr line
naming the file (or both fingerprints), no traceback, no Ray started (the config points
Ray at an address nothing listens on, and Ray's log file is never opened), no MLflow
store made. And a crashed ablation's MLflow run ends FAILED, as the pipeline's runs do
(a real SQLite store; the crash is a stage runner that raises)."""

import json
import shutil
import subprocess
import sys

import pytest
import torch

from dlite import target as tgt
from dlite.config import load_config
from dlite.export import save_drafter
from dlite.models import build_drafter
from dlite.train import plan as st

TINY = "configs/experiments/tiny.yaml"


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    """A random-weight DLite drafter around the tiny target, exported as training does."""
    cfg = load_config(TINY)
    torch.manual_seed(0)
    model = build_drafter(st.drafter_config(cfg, "dlite"), *st.load_vocab(cfg.target))
    fields = {"target_name": cfg.target.name, "target_fingerprint": tgt.fingerprint(cfg.target)["id"]}
    return save_drafter(model, tmp_path_factory.mktemp("good") / "drafter", fields)


def truncated(good, tmp_path):
    d = shutil.copytree(good, tmp_path / "truncated")
    data = (d / "model.safetensors").read_bytes()
    (d / "model.safetensors").write_bytes(data[:len(data) // 2])  # an interrupted copy
    return d, [str(d / "model.safetensors"), "truncated"]


def other_target(good, tmp_path):
    d = shutil.copytree(good, tmp_path / "other")
    config = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**config, "target_fingerprint": "0123456789abcdef-other"}))
    ours = tgt.fingerprint(load_config(TINY).target)["id"]
    return d, [str(d / "config.json"), "0123456789abcdef-other", ours]


def command(job: str, d, tmp_path) -> list:
    flags = {"evaluate": ["--drafter", str(d), "--out", str(tmp_path / "report.json")],
             "publish": ["--drafter", str(d), "--report", str(tmp_path / "report.json"),
                         "--out", str(tmp_path / "summary.json")],
             "train": ["--stage", "align", "--input", str(tmp_path / "shards"),
                       "--output", str(tmp_path / "align"), "--teacher", str(d)]}[job]
    return [sys.executable, "-m", f"jobs.{job}", "--config", TINY, *flags,
            f"run.output_dir={tmp_path / 'runs'}", "cluster.address=127.0.0.1:1",
            f"tracking.uri=sqlite:///{tmp_path / 'mlflow.db'}"]


@pytest.mark.parametrize("case", [truncated, other_target], ids=["truncated", "other_target"])
@pytest.mark.parametrize("job", ["evaluate", "publish", "train"])
def test_job_refuses_a_bad_artifact_before_ray(repo_root, good, tmp_path, job, case):
    d, named = case(good, tmp_path)
    r = subprocess.run(command(job, d, tmp_path), cwd=repo_root, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 2, r.stdout[-2000:] + r.stderr[-3000:]
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("artifact error: "), r.stderr[-3000:]
    assert all(n in lines[0] for n in named), lines[0]
    assert "Traceback" not in r.stdout + r.stderr
    assert not (tmp_path / "runs" / "logs" / "ray.log").exists()  # init_ray was never reached
    assert not (tmp_path / "mlflow.db").exists()


def test_a_good_artifact_passes_the_check(repo_root, good, tmp_path):
    r = subprocess.run(command("evaluate", good, tmp_path) + ["--dry-run"], cwd=repo_root,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "sha256 of model.safetensors ok; target fingerprint ok" in r.stdout


@pytest.mark.parametrize("runner", ["align", "evaluate", "publish"])
def test_a_pipeline_stage_rechecks_the_drafters_it_reuses(good, tmp_path, runner):
    """Inside the DAG, a stage re-checks the drafter a finished input stage left (it may
    have been reused from an earlier run and damaged since) before any work: the
    truncated file is named, and nothing (no Ray, no MLflow run) is started."""
    from dlite.export import ArtifactError
    from pipelines.orchestration.dag import Context
    from pipelines.orchestration.runners import RUNNERS
    d, named = truncated(good, tmp_path)
    stage = {"align": "teacher", "evaluate": "align", "publish": "align"}[runner]
    deps = {stage: {"drafter": str(d)}, "collect": {"shards": str(tmp_path / "shards")},
            "evaluate": {"report": str(tmp_path / "report.json")}}
    (tmp_path / "report.json").write_text("{}")
    cfg = load_config(TINY, [f"run.output_dir={tmp_path / 'runs'}", "cluster.address=127.0.0.1:1",
                             f"tracking.uri=sqlite:///{tmp_path / 'mlflow.db'}"])
    with pytest.raises(ArtifactError) as err:
        RUNNERS[runner](Context(cfg, "no-run", print), tmp_path / "out", deps)
    assert all(n in str(err.value) for n in named), str(err.value)
    assert not (tmp_path / "mlflow.db").exists() and not (tmp_path / "runs").exists()


def test_a_crashed_ablation_run_is_marked_failed(tmp_path, monkeypatch):
    from pipelines.benchmarks import ablations
    from pipelines.common import tracking
    from pipelines.orchestration import runners
    cfg = load_config(TINY, [f"tracking.uri=sqlite:///{tmp_path / 'mlflow.db'}", f"run.output_dir={tmp_path}"])

    def crash(ctx, out, deps):
        raise RuntimeError("collect crashed")

    monkeypatch.setattr(runners, "RUNNERS", {s: crash for s in ablations.STAGES})
    parent = tracking.open_parent(cfg, tmp_path / "bench", "bench")
    with pytest.raises(RuntimeError, match="collect crashed"):
        ablations.run_one(cfg, "head_none", 1536, parent, log=lambda line: None)
    c = tracking.client(cfg.tracking.uri)
    runs = c.search_runs([tracking.experiment_id(cfg)], "tags.`dlite.ablation` = 'head_none'")
    assert [(r.info.status, r.data.tags["mlflow.parentRunId"]) for r in runs] == [("FAILED", parent)]
