"""Publishing against a real `mlflow server` (the session `mlflow_server` fixture):
registry version with lineage + metric tags, aliases moved by the release gate, a
failing gate that leaves `production` alone and says why, the same weights never
registered twice, the model card in the registered artifacts, plots in the run, and
`python -m jobs.publish` end to end. Drafters are random-weight DLite models around the
shipped tiny target's vocabulary; the report dicts are gate inputs, not measurements."""

import hashlib
import json
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import torch

from dlite import target as tgt
from dlite.config import config_hash, load_config
from dlite.export import save_drafter
from dlite.models import build_drafter
from dlite.train import plan as st
from pipelines.common import tracking
from pipelines.common.plots import loss_curves_from_mlflow
from pipelines.stages.publish import publish


@pytest.fixture
def cfg(mlflow_server, tmp_path):
    tag = uuid.uuid4().hex[:8]  # own experiment and registered model: tests share the server
    return load_config(None, [f"tracking.uri={mlflow_server}", f"tracking.experiment=publish-{tag}",
                              f"tracking.registered_model=dlite-test-{tag}", f"run.output_dir={tmp_path}",
                              "gate.min_tau=1.5", "gate.min_speedup=1.0", "gate.tolerance=0.05"])


def make_drafter(cfg, stage_dir, seed: int) -> str:
    """A random-weight drafter exported like the align stage does, in `<stage_dir>/drafter`."""
    vocab = st.load_vocab(cfg.target)
    torch.manual_seed(seed)
    model = build_drafter(st.drafter_config(cfg, "dlite"), *vocab)
    fields = {"target_name": cfg.target.name, "target_fingerprint": tgt.fingerprint(cfg.target)["id"],
              "data_plan_id": f"plan-{seed}", "stage": "align", "step": 20, "skip_teacher": False,
              "val_tau": 1.9, "val_loss": 2.0}
    return str(save_drafter(model, stage_dir / "drafter", fields))


def result(cfg, tau: float, speedup: float) -> dict:
    """One method's evaluation result, shaped like jobs.evaluate's (inputs to the gate)."""
    r = {"tau": tau, "speedup_vs_ar": speedup, "lossless": True, "accept_at_k": [0.8, 0.5, None],
         "tau_by_bucket": {"<1K": tau}, "bucket_labels": ["<1K", "1K-4K"], "n_tasks": 4,
         "time_split": {}, "drafter": "x", "target_fingerprint": tgt.fingerprint(cfg.target)}
    return {**r, "by_temperature": {"0.0": dict(r), "1.0": dict(r, tau=tau - 0.3, lossless=None)}}


def report(cfg, tau: float, speedup: float) -> dict:
    from omegaconf import OmegaConf
    methods = {"dlite": result(cfg, tau, speedup), "dspark": result(cfg, 1.6, 1.05)}
    return {"methods": methods, "primary": "dlite", **methods["dlite"],
            "config": OmegaConf.to_container(cfg), "env": {}}


def sha256(path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def test_publish_gate_aliases_and_reuse(cfg, tmp_path):
    uri, name = cfg.tracking.uri, cfg.tracking.registered_model
    c = tracking.client(uri)
    parent = tracking.open_parent(cfg, tmp_path / "pipeline", "pipeline")
    align = tracking.open_child(cfg, "align", tmp_path / "align", parent)  # what the align stage does
    for step in range(5):
        tracking.log_metrics(uri, align, step, {"loss": 5.0 - step})
    assert loss_curves_from_mlflow(uri, {"align": align}) == {"align": [(s, 5.0 - s) for s in range(5)]}
    good = make_drafter(cfg, tmp_path / "align", seed=1)

    s1 = publish(cfg, good, report(cfg, 2.5, 1.4), parent_run_id=parent)
    assert (s1["version"], s1["aliases"], s1["production_before"]) == ("1", ["candidate", "production"], None)
    assert s1["gate"]["passed"] and s1["model_uri"] == f"models:/{name}/1" and not s1["reused_version"]
    mv = c.get_model_version(name, "1")
    git = subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(__file__).parent, capture_output=True,
                         text=True, check=False)
    expect = {"dlite.target_fingerprint": tgt.fingerprint(cfg.target)["id"], "dlite.data_fingerprint": "plan-1",
              "dlite.config_hash": config_hash(cfg), "dlite.git_commit": git.stdout.strip() or "unknown",
              "dlite.drafter_sha256": sha256(f"{good}/model.safetensors"), "dlite.method": "dlite",
              "dlite.metric.tau": "2.5", "dlite.metric.speedup_vs_ar": "1.4", "dlite.metric.tau_T1": "2.2",
              "dlite.metric.accept_at_k": "[0.8, 0.5, null]", "dlite.gate": "passed"}
    assert {k: mv.tags.get(k) for k in expect} == expect
    assert mv.run_id == s1["run_id"] and mv.source.endswith(f"{s1['run_id']}/artifacts/drafter")

    run = c.get_run(s1["run_id"])
    assert run.data.tags["mlflow.parentRunId"] == parent and run.data.tags["dlite.stage"] == "publish"
    assert run.info.status == "FINISHED" and run.data.metrics["gate_passed"] == 1.0
    assert {f.path for f in c.list_artifacts(s1["run_id"], "plots")} == {
        "plots/accept_at_k.png", "plots/tau_by_bucket.png", "plots/loss_curves.png"}
    assert "report.json" in {f.path for f in c.list_artifacts(s1["run_id"])}

    # The registered artifact, as a user fetches it: the card with the table, the same weights.
    import mlflow
    got = mlflow.artifacts.download_artifacts(c.get_model_version_download_uri(name, "1"),
                                              dst_path=str(tmp_path / "dl"), tracking_uri=uri)
    card = Path(got, "README.md").read_text()
    assert "| **dlite** (this) | greedy | 2.50 | 1.40x | 0.80 0.50 – | <1K 2.50 |" in card
    assert "| dspark | greedy | 1.60 | 1.05x |" in card and "plan-1" in card
    assert sha256(f"{got}/model.safetensors") == expect["dlite.drafter_sha256"]

    # Other weights whose tau regressed 20% against production: candidate only, reasons recorded.
    worse = make_drafter(cfg, tmp_path / "align2", seed=2)
    s2 = publish(cfg, worse, report(cfg, 2.0, 1.5), parent_run_id=parent)
    assert (s2["version"], s2["aliases"], s2["production_before"]) == ("2", ["candidate"], "1")
    why = "tau vs production: 2 < 2.375 (production v1 2.5 - 5% tolerance)"
    assert not s2["gate"]["passed"] and s2["gate"]["reasons"] == [why]
    assert c.get_registered_model(name).aliases == {"candidate": "2", "production": "1"}
    assert c.get_model_version(name, "2").tags["dlite.gate.reasons"] == why
    assert c.get_run(s2["run_id"]).data.tags["dlite.gate.reasons"] == why
    assert s2["run_id"] != s1["run_id"]  # version 1's source run was not written to
    assert c.get_model_version(name, "1").source == mv.source

    # The first weights again (a pipeline rerun): same version and run, nothing new registered.
    s3 = publish(cfg, good, report(cfg, 2.5, 1.4), parent_run_id=parent)
    assert (s3["version"], s3["reused_version"], s3["run_id"]) == ("1", True, s1["run_id"])
    assert s3["aliases"] == ["candidate", "production"]
    assert len(c.search_model_versions(f"name = '{name}'")) == 2


def test_publish_cli_end_to_end(cfg, tmp_path, repo_root, capsys):
    d = make_drafter(cfg, tmp_path / "stage", seed=3)
    rep = report(cfg, 1.2, 1.3)  # tau under gate.min_tau=1.5: registered, never production
    (tmp_path / "report.json").write_text(json.dumps(rep))
    args = [sys.executable, "-m", "jobs.publish", "--config", "configs/experiments/tiny.yaml",
            "--drafter", d, "--report", str(tmp_path / "report.json"),
            "--out", str(tmp_path / "summary.json"), f"tracking.uri={cfg.tracking.uri}",
            f"tracking.experiment={cfg.tracking.experiment}", f"run.output_dir={tmp_path}",
            f"tracking.registered_model={cfg.tracking.registered_model}", "gate.min_tau=1.5"]
    from jobs.publish import main
    assert main(args[3:] + ["--dry-run"]) == 0 and not (tmp_path / "summary.json").exists()
    assert main(args[3:7] + ["--report", str(tmp_path / "missing.json")] + args[9:]) == 1
    out = capsys.readouterr()
    assert "dry run" in out.out and "publish error" in out.err and "missing.json" in out.err
    done = subprocess.run(args, cwd=repo_root, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["version"] == "1" and summary["aliases"] == ["candidate"]
    assert summary["gate"]["reasons"] == ["tau >= gate.min_tau: 1.2 < 1.5"]
    c = tracking.client(cfg.tracking.uri)
    assert c.get_registered_model(cfg.tracking.registered_model).aliases == {"candidate": "1"}


def test_refuses_a_report_for_another_target(cfg, tmp_path):
    d = make_drafter(cfg, tmp_path / "stage", seed=4)
    rep = report(cfg, 2.5, 1.4)
    rep["methods"]["dlite"]["target_fingerprint"] = {"id": "other-target"}
    with pytest.raises(ValueError, match="report.methods.dlite.target_fingerprint 'other-target'"):
        publish(cfg, d, rep)
    (tmp_path / "half").mkdir()
    (tmp_path / "half" / "config.json").write_text("{}")  # an interrupted save
    with pytest.raises(FileNotFoundError, match="drafter: no model.safetensors in .*half"):
        publish(cfg, tmp_path / "half", rep)
