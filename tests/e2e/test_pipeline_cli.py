"""The README's main job as a user runs it: `python -m jobs.pipeline` in a fresh process —
dry run, bad input failing fast, and the whole DAG on the embedded default at smoke size
(collect -> teacher -> align + ablation + DSpark baseline -> evaluate -> publish) against
a real MLflow server, then a rerun that skips every finished stage and reuses the run."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from tests.report_checks import check_figures

TRAINED = ["teacher", "align", "align_no_teacher", "dspark"]


def _run(repo, *args, timeout=600):
    return subprocess.run([sys.executable, "-m", "jobs.pipeline", "--config", "configs/experiments/tiny.yaml", *args], cwd=repo,
                          capture_output=True, text=True, timeout=timeout)


def test_dry_run_prints_plan_and_config(repo_root, tmp_path):
    r = _run(repo_root, "--dry-run", f"run.output_dir={tmp_path}")
    assert r.returncode == 0, r.stderr
    for stage in ["collect", *TRAINED, "evaluate", "publish"]:
        assert f"{stage} " in r.stdout and f"stages/{stage}-" in r.stdout
    assert "drafter:" in r.stdout
    assert not any(tmp_path.iterdir()), "a dry run must not write anything"


def test_bad_input_fails_before_work(repo_root, tmp_path):
    r = _run(repo_root, "drafter.gamma=1", f"run.output_dir={tmp_path}")
    assert r.returncode == 2 and "drafter.gamma" in r.stderr
    r = _run(repo_root, "train.nope=3")
    assert r.returncode == 2 and "train.nope" in r.stderr
    r = _run(repo_root, "--only", "align", f"run.output_dir={tmp_path}")
    assert r.returncode == 2 and "align needs collect" in r.stderr
    assert not any(tmp_path.iterdir())


@pytest.fixture(scope="module")
def pipeline_run(repo_root, tmp_path_factory, mlflow_server, smoke_pipeline):
    out = tmp_path_factory.mktemp("pipeline")
    args = [f"run.output_dir={out}", f"tracking.uri={mlflow_server}", "tracking.experiment=pipeline-e2e", *smoke_pipeline]
    first = _run(repo_root, *args, timeout=1800)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    return out, args, first


@pytest.mark.timeout(2700)  # its fixture runs the whole DAG (about 5 min quiet, 15 loaded)
def test_pipeline_runs_every_stage(pipeline_run, mlflow_server):
    out, _, first = pipeline_run
    (summary_path,) = out.glob("tiny-*/summary.json")
    s = json.loads(summary_path.read_text())
    ev = s["results"]["evaluate"]
    assert set(ev["methods"]) == {"dlite", "dlite_no_teacher", "dspark"} and ev["lossless"] is True
    # The summary's headline figures are the evaluation report's, and those agree with
    # themselves; greedy output matched plain decoding token for token.
    report = json.loads(Path(ev["report"]).read_text())
    for name, head in ev["methods"].items():
        m = report["methods"][name]
        t1 = m["by_temperature"]["1.0"]
        assert head == {"tau": m["tau"], "speedup_vs_ar": m["speedup_vs_ar"], "lossless": True,
                        "speedup_vs_ar_lower": m["speedup_vs_ar_lower"],
                        "lossless_up_to_ties": True,  # fp32 target: the same verdict as strict
                        "tau_t1": t1["tau"], "speedup_vs_ar_t1": t1["speedup_vs_ar"],
                        "tau_by_bucket": m["tau_by_bucket"]}
        assert m["n_tokens"]["spec"] == m["n_tokens"]["plain"] > 0 and m["n_mismatched_tasks"] == 0
        for r in m["by_temperature"].values():
            check_figures(r)
    # The training estimate beside the held-out figure, per learned method.
    for name, stage in (("dlite", "align"), ("dlite_no_teacher", "align_no_teacher"), ("dspark", "dspark")):
        v = s["val_vs_heldout"][name]
        assert v["val_tau"] == s["results"][stage]["best_val_tau"] and v["heldout_tau"] == ev["methods"][name]["tau"]
        assert v["val_over_heldout"] == round(v["val_tau"] / v["heldout_tau"], 4)
        # The same checkpoint's greedy replay of the validation blocks (the eval's stop rule).
        assert v["val_tau_greedy"] == s["results"][stage]["best_val_tau_greedy"] and 1 <= v["val_tau_greedy"] <= 8
        assert v["greedy_over_heldout"] == round(v["val_tau_greedy"] / v["heldout_tau"], 4)
        # ... and the replay walked over the validation answers (tokens per round)
        assert v["val_tau_replay"] == s["results"][stage]["best_val_tau_replay"] and 1 <= v["val_tau_replay"] <= 8
        assert v["replay_over_heldout"] == round(v["val_tau_replay"] / v["heldout_tau"], 4)
    assert s["results"]["teacher"]["best_val_tau_replay"] is None  # never evaluated: no walk
    assert "plain decoding" in first.stdout and "MLflow run: http://" in first.stdout
    assert s["results"]["publish"]["version"]

    from mlflow import MlflowClient
    c = MlflowClient(mlflow_server)
    parent = c.get_run(s["mlflow_run"])
    assert parent.info.status == "FINISHED"
    assert parent.data.metrics["dlite.tau"] == pytest.approx(ev["methods"]["dlite"]["tau"])
    for stage in TRAINED:
        assert parent.data.metrics[f"{stage}.best_val_tau"] == pytest.approx(s["results"][stage]["best_val_tau"])
    kids = c.search_runs([parent.info.experiment_id], f"tags.mlflow.parentRunId = '{parent.info.run_id}'")
    assert sorted(k.data.tags["dlite.stage"] for k in kids) == sorted(
        ["collect", *TRAINED, "evaluate", "publish"])
    assert all(k.info.status == "FINISHED" for k in kids)
    arts = {a.path for a in c.list_artifacts(parent.info.run_id, "pipeline")}
    assert {"pipeline/summary.json", "pipeline/loss_curves.png"} <= arts


def test_rerun_skips_finished_stages(pipeline_run, repo_root, mlflow_server):
    out, args, _ = pipeline_run
    again = _run(repo_root, *args)
    assert again.returncode == 0, again.stderr[-3000:]
    assert again.stdout.count("finished earlier") == 7
    (summary_path,) = out.glob("tiny-*/summary.json")
    s = json.loads(summary_path.read_text())
    from mlflow import MlflowClient
    c = MlflowClient(mlflow_server)
    exp = c.get_experiment_by_name("pipeline-e2e")
    parents = c.search_runs([exp.experiment_id], "tags.`dlite.kind` = 'pipeline'")
    assert [p.info.run_id for p in parents] == [s["mlflow_run"]]  # the restart reused it
    kids = c.search_runs([exp.experiment_id], f"tags.mlflow.parentRunId = '{s['mlflow_run']}'")
    assert len(kids) == 7  # no stage ran again


# Last in this module: it adds a second pipeline home (other run.stages) to the same
# run.output_dir, which the tests above expect to hold one.
@pytest.mark.timeout(1800)
def test_gpu_check_script_on_cpu(pipeline_run, repo_root, mlflow_server, smoke_pipeline, tmp_path):
    """scripts/gpu_check.sh as a user runs it, on CPU at the smoke size: the stages the
    module's pipeline trained are reused (same settings, same run.output_dir), the
    evaluation runs again (no ablation in its inputs), then the engine comparison."""
    import os
    out, _, _ = pipeline_run
    report = tmp_path / "gpu_check.json"
    r = subprocess.run(["bash", "scripts/gpu_check.sh", "--config", "configs/experiments/tiny.yaml",
                        "--out", str(report), f"run.output_dir={out}", f"tracking.uri={mlflow_server}",
                        "tracking.experiment=gpu-check-e2e", *smoke_pipeline],
                       cwd=repo_root, capture_output=True, text=True, timeout=1700,
                       env={**os.environ, "PYTHON": sys.executable, "DLITE_GPU_CHECK_DIR": str(tmp_path)})
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    g = json.loads(report.read_text())
    assert g["device"] == "cpu" and "no CUDA device" in r.stderr
    assert g["stages_reused"] == ["collect", "teacher", "align", "dspark"]  # evaluate ran
    assert set(g["decoding"]) == {"dlite", "dspark"} and g["lossless"] is True
    for m in g["decoding"].values():
        assert m["tokens_per_s_plain"] > 0 and m["tokens_per_s_spec"] > 0 and m["tau"] >= 1.0
    for s in ("teacher", "align", "dspark"):
        assert g["training"][s]["samples_per_s"] > 0 and g["training"][s]["peak_gpu_bytes"] is None
    e = g["engine"]
    assert e["engine_overhead"] > 0 and e["workers"] == 2 and "same_math" not in e
    assert g["wall_s"] >= g["pipeline_s"] > 0 and g["budget_s"] == 480
