"""`ray job submit` as a user runs it, following README's "On a Ray cluster": a real
`ray start --head` on localhost with token authentication on (Ray 2.60's default once
~/.ray/auth_token exists), the client authenticated the documented way (RAY_AUTH_MODE=
token, the token in that file), the embedded default's smallest pipeline at smoke size
(a Ray Train + DeepSpeed stage, evaluation, publication; the collection the session's
finished one, found and reused as a rerun would) submitted through the CLI with the repo
as working dir and no MLflow store configured.

Without the token the submission is refused; a relative `run.output_dir` is refused by
the job before any work; the real run keeps its MLflow record beside its outputs, and
after `ray stop` the parent run, its child runs and the registered drafter are read
back from that store -- the one the job printed."""

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from tests.pipeline_runs import SMALLEST_STAGES, seed_stages

RUNTIME_ENV = {"env_vars": {"DS_ACCELERATOR": "cpu", "TOKENIZERS_PARALLELISM": "false"}}


def submit(address: str, repo_root: Path, args: list, env: dict, timeout: float = 2400):
    """`ray job submit ... -- python -m jobs.pipeline ARGS`; (submission id, result)."""
    from pipelines.retraining.watch import EXCLUDES
    sid = f"dlite-test-{uuid.uuid4().hex[:8]}"
    cmd = [str(Path(sys.executable).with_name("ray")), "job", "submit", "--address", address,
           "--submission-id", sid, "--working-dir", str(repo_root),
           "--runtime-env-json", json.dumps({**RUNTIME_ENV, "excludes": EXCLUDES}),
           "--", "python", "-m", "jobs.pipeline", "--config", "configs/experiments/tiny.yaml", *args]
    return sid, subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)


@pytest.mark.timeout(2700)  # four stages through a Ray job
def test_ray_job_submit_runs_the_pipeline(own_ray_head, repo_root, tmp_path, smoke_pipeline, smoke_collection):
    from mlflow import MlflowClient
    from ray.job_submission import JobStatus, JobSubmissionClient

    runs = tmp_path / "runs"
    seed_stages(runs, smoke_collection)
    store = f"sqlite:///{runs / 'mlflow.db'}"
    authed = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    assert authed["RAY_AUTH_MODE"] == "token"  # the `ray_token` fixture: README's client setup
    with own_ray_head() as (address, ray_tmp):
        client = JobSubmissionClient(address)

        # No RAY_AUTH_MODE in the client's environment: the cluster refuses it.
        bare = {k: v for k, v in authed.items() if not k.startswith("RAY_")}
        sid, r = submit(address, repo_root, ["--dry-run"], bare, timeout=600)
        assert r.returncode != 0 and "Missing authentication token" in r.stdout + r.stderr, r.stderr[-2000:]

        # The default (relative) run.output_dir: one line from the job, before any work.
        sid, r = submit(address, repo_root, [], authed, timeout=600)
        logs = client.get_job_logs(sid)
        assert client.get_job_status(sid) == JobStatus.FAILED, logs[-3000:]
        assert "config error: run.output_dir: 'runs' is relative, and this runs as a Ray job" in logs, logs[-3000:]

        sid, r = submit(address, repo_root, [f"run.output_dir={runs}", *smoke_pipeline, *SMALLEST_STAGES], authed)
        logs = client.get_job_logs(sid)
        assert client.get_job_status(sid) == JobStatus.SUCCEEDED, r.stdout[-3000:] + logs[-3000:]
        assert "plain decoding" in logs and "[pipeline] done in" in logs
        assert f"[pipeline] MLflow: {store} (" in logs and f"`mlflow ui --backend-store-uri {store}`" in logs
        # Nothing of the record went into Ray's temporary copy of the working dir.
        left = [p for pat in ("mlflow.db", "mlartifacts", "runs") for p in ray_tmp.rglob(pat)]
        assert left == [], left
    assert not ray_tmp.exists()  # Ray is stopped and its temp dir gone

    (summary_path,) = runs.glob("tiny-*/summary.json")
    s = json.loads(summary_path.read_text())
    c = MlflowClient(store)
    parent = c.get_run(s["mlflow_run"])
    assert parent.info.status == "FINISHED" and parent.data.metrics["dlite.tau"] >= 1.0
    kids = c.search_runs([parent.info.experiment_id], f"tags.mlflow.parentRunId = '{parent.info.run_id}'")
    assert {k.data.tags["dlite.stage"] for k in kids} == {"align", "evaluate", "publish"}
    assert {x["stage"]: x["status"] for x in s["stages"]}["collect"] == "done"  # reused
    pub = s["results"]["publish"]
    version = c.get_model_version(pub["registered_model"], pub["version"])
    assert version.tags["dlite.target_fingerprint"] == s["results"]["collect"]["target_fingerprint"]
    assert version.source.startswith((runs / "mlartifacts").as_uri())
    drafter = Path(c.download_artifacts(version.run_id, "drafter", str(tmp_path / "dl")))
    assert (drafter / "config.json").is_file() and (drafter / "model.safetensors").is_file()
