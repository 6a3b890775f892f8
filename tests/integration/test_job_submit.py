"""`ray job submit` as a user runs it against a running cluster: a real `ray start --head`
on localhost (the `ray_head` fixture), the whole pipeline of the embedded default at
smoke size submitted through the CLI with the repo as working dir, then the job's status,
its printed results table and the MLflow runs and registry entry it left behind."""

import json
import subprocess
import sys
import uuid
from pathlib import Path

import pytest


@pytest.mark.timeout(2700)  # the whole DAG through a Ray job
def test_ray_job_submit_runs_the_pipeline(ray_head, mlflow_server, repo_root, tmp_path, smoke_pipeline):
    from mlflow import MlflowClient
    from ray.job_submission import JobStatus, JobSubmissionClient

    from pipelines.retraining.watch import EXCLUDES
    sid = f"dlite-test-{uuid.uuid4().hex[:8]}"
    env = {"excludes": EXCLUDES, "env_vars": {"DS_ACCELERATOR": "cpu", "TOKENIZERS_PARALLELISM": "false"}}
    cmd = [str(Path(sys.executable).with_name("ray")), "job", "submit", "--address", ray_head,
           "--submission-id", sid, "--working-dir", str(repo_root), "--runtime-env-json", json.dumps(env),
           "--", "python", "-m", "jobs.pipeline", f"run.output_dir={tmp_path / 'runs'}",
           f"tracking.uri={mlflow_server}", "tracking.experiment=job-submit", *smoke_pipeline]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=2400)
    client = JobSubmissionClient(ray_head)
    logs = client.get_job_logs(sid)
    assert client.get_job_status(sid) == JobStatus.SUCCEEDED, r.stdout[-3000:] + logs[-3000:]
    assert "plain decoding" in logs and "[pipeline] done in" in logs

    (summary_path,) = (tmp_path / "runs").glob("tiny-*/summary.json")
    s = json.loads(summary_path.read_text())
    c = MlflowClient(mlflow_server)
    parent = c.get_run(s["mlflow_run"])
    assert parent.info.status == "FINISHED" and parent.data.metrics["dlite.tau"] >= 1.0
    kids = c.search_runs([parent.info.experiment_id], f"tags.mlflow.parentRunId = '{parent.info.run_id}'")
    assert {k.data.tags["dlite.stage"] for k in kids} >= {"collect", "teacher", "align", "evaluate", "publish"}
    pub = s["results"]["publish"]
    version = c.get_model_version(pub["registered_model"], pub["version"])
    assert version.tags["dlite.target_fingerprint"] == s["results"]["collect"]["target_fingerprint"]
