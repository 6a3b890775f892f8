"""Scheduled retraining (`jobs/watch_target.py`) against a real `ray start --head` and a
real MLflow server: a new checkpoint is submitted exactly once (the cheap `--dry-run`
pipeline, which must SUCCEED in the cluster), nothing new submits nothing, and a crash
between submit and record is healed without a second submission."""

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from dlite import target, tiny
from jobs import watch_target
from pipelines.common import tracking
from pipelines.retraining import watch
CHEAP = "--dry-run"  # the pipeline validates and plans on the new target, then exits
# A Ray job refuses a relative run.output_dir (its working dir is Ray's temporary copy),
# and so does the watcher before submitting; a dry run writes nothing there.
OUT = str(Path(tempfile.gettempdir()) / "dlite-watch-test-runs")


def make_checkpoint(d: Path, variant: str) -> Path:
    """The shipped tiny target + tokenizer in one dir; `variant` in config.json gives
    each checkpoint its own fingerprint (config.json is part of it)."""
    d.mkdir(parents=True)
    for src in (tiny.TARGET_PATH, tiny.TOKENIZER_PATH):
        for f in src.iterdir():
            shutil.copy(f, d / f.name)
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "dlite_test_variant": variant}))
    return d


def argv(source, name, uri, *extra):
    return ["--config", "configs/experiments/tiny.yaml", "--source", str(source), "--once", "--min-age", "0",
            f"--pipeline-args={CHEAP}",
            f"run.name={name}", f"tracking.uri={uri}", f"tracking.experiment=watch-{name}",
            f"run.output_dir={OUT}", *extra]


def run_cli(capsys, *args) -> str:
    assert watch_target.main(list(args)) == 0
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("[watch]")]
    return lines[-1]  # the decision (the first line says what is watched)


def jobs_of(client, name) -> list:
    return [j for j in client.list_jobs() if (j.submission_id or "").startswith(f"dlite-{name}-")]


def wait_terminal(client, sid, timeout=300):
    deadline = time.time() + timeout
    while not (status := client.get_job_status(sid)).is_terminal():
        assert time.time() < deadline, f"{sid} still {status}: {client.get_job_logs(sid)[-2000:]}"
        time.sleep(2)
    return status


def watcher_tags(uri, name) -> dict:
    cfg = OmegaConf.create({"tracking": {"uri": uri, "experiment": f"watch-{name}"},
                            "target": {"name": "tiny"}})
    runs = tracking.client(uri).search_runs([tracking.experiment_id(cfg)],
                                            "tags.`dlite.kind` = 'watcher'")
    assert len(runs) == 1, "one record run per (source, run.name), reused across invocations"
    return runs[0].data.tags


def fingerprint(ckpt: Path) -> str:
    section = OmegaConf.create({"path": str(ckpt), "name": "tiny", "revision": None})
    return target.fingerprint(section)["id"]


def test_new_checkpoint_submitted_exactly_once(tmp_path, ray_head, mlflow_server, capsys, monkeypatch):
    from ray.job_submission import JobStatus, JobSubmissionClient
    monkeypatch.setenv("RAY_ADDRESS", ray_head)
    client, name, src = JobSubmissionClient(ray_head), "wa", tmp_path / "ckpts"
    src.mkdir()
    # Nothing complete yet: no weights, then a writer's temp file, then too fresh.
    (src / "ckpt-0").mkdir()
    (src / "ckpt-0" / "config.json").write_text("{}")
    make_checkpoint(src / "ckpt-1", "1")
    (src / "ckpt-1" / "model.safetensors.tmp").write_text("half")
    assert "nothing new" in run_cli(capsys, *argv(src, name, mlflow_server))
    (src / "ckpt-1" / "model.safetensors.tmp").unlink()
    fresh = argv(src, name, mlflow_server)
    fresh[fresh.index("--min-age") + 1] = "3600"
    assert "nothing new" in run_cli(capsys, *fresh)
    assert jobs_of(client, name) == []

    line = run_cli(capsys, *argv(src, name, mlflow_server))
    fp = fingerprint(src / "ckpt-1")
    sid = f"dlite-{name}-{fp}"
    assert line.startswith(f"[watch] submitted {sid} for new checkpoint {src / 'ckpt-1'}"), line
    assert wait_terminal(client, sid) == JobStatus.SUCCEEDED, client.get_job_logs(sid)[-3000:]
    logs = client.get_job_logs(sid)
    assert "[pipeline] config configs/experiments/tiny.yaml" in logs
    assert f"path: {src / 'ckpt-1'}" in logs  # the pipeline planned on the new target
    info = client.get_job_info(sid)
    assert "--dry-run" in info.entrypoint and f"tracking.uri={mlflow_server}" in info.entrypoint
    from pipelines.stages.publish import git_commit
    assert info.runtime_env["env_vars"]["DLITE_GIT_COMMIT"] == git_commit() != "unknown"
    tags = watcher_tags(mlflow_server, name)
    assert json.loads(tags[f"dlite.watch.fp.{fp}"])["submission_id"] == sid
    assert tags["dlite.watch.source"] == str(src)

    # The same checkpoint again: no second job, whatever the cron schedule.
    assert "already submitted" in run_cli(capsys, *argv(src, name, mlflow_server))
    assert [j.submission_id for j in jobs_of(client, name)] == [sid]

    # A newer checkpoint lands: exactly one more job, for it.
    time.sleep(0.05)  # mtimes order the checkpoints
    make_checkpoint(src / "ckpt-2", "2")
    line = run_cli(capsys, *argv(src, name, mlflow_server))
    sid2 = f"dlite-{name}-{fingerprint(src / 'ckpt-2')}"
    assert line.startswith(f"[watch] submitted {sid2}"), line
    assert sorted(j.submission_id for j in jobs_of(client, name)) == sorted([sid, sid2])
    assert "already submitted" in run_cli(capsys, *argv(src, name, mlflow_server))
    assert len(jobs_of(client, name)) == 2


def test_crash_between_submit_and_record(tmp_path, ray_head, mlflow_server, repo_root):
    from ray.job_submission import JobSubmissionClient
    client, name, ckpt = JobSubmissionClient(ray_head), "wb", make_checkpoint(tmp_path / "ckpt", "b")
    cmd = [sys.executable, "-m", "jobs.watch_target", "--address", ray_head,
           *argv(ckpt, name, mlflow_server)]
    env = {**os.environ, watch.CRASH_ENV: "1"}
    run = lambda env: subprocess.run(cmd, check=False, cwd=repo_root, env=env, capture_output=True,
                                     text=True, timeout=600)
    # The cluster has token auth on: a watcher without RAY_AUTH_MODE=token says so, submits nothing.
    bare = run({k: v for k, v in env.items() if k != "RAY_AUTH_MODE"})
    assert bare.returncode == 1 and f"[watch] error: --address {ray_head}: Authentication required" \
        in bare.stdout, bare.stdout + bare.stderr[-2000:]
    assert jobs_of(client, name) == []
    crashed = run(env)
    assert crashed.returncode == -9, crashed.stdout + crashed.stderr
    sid = f"dlite-{name}-{fingerprint(ckpt)}"
    assert [j.submission_id for j in jobs_of(client, name)] == [sid]  # submitted, not recorded
    assert not any(k.startswith("dlite.watch.fp.") for k in watcher_tags(mlflow_server, name))

    env.pop(watch.CRASH_ENV)
    again = run(env)
    assert again.returncode == 0, again.stdout + again.stderr
    assert f"as {sid} (in Ray, recorded now)" in again.stdout, again.stdout
    assert [j.submission_id for j in jobs_of(client, name)] == [sid]
    tag = watcher_tags(mlflow_server, name)[f"dlite.watch.fp.{fingerprint(ckpt)}"]
    assert json.loads(tag)["submission_id"] == sid


def test_dry_run_and_registry_source(tmp_path, ray_head, mlflow_server, capsys, monkeypatch):
    """A registered model version as the source; `--dry-run` submits and records nothing."""
    from ray.job_submission import JobSubmissionClient
    monkeypatch.setenv("RAY_ADDRESS", ray_head)
    c, name, model = tracking.client(mlflow_server), "wc", "watch-test-target"
    run = c.create_run(c.create_experiment(f"models-{name}"))  # the registry wants a run's artifact
    tracking.log_artifact(mlflow_server, run.info.run_id, make_checkpoint(tmp_path / "v1", "c"), "model")
    c.create_registered_model(model)
    c.create_model_version(model, source=f"{run.info.artifact_uri}/model", run_id=run.info.run_id)
    c.set_registered_model_alias(model, "candidate", "1")
    line = run_cli(capsys, *argv(f"models:/{model}@candidate", name, mlflow_server, "--dry-run"))
    assert line.startswith(f"[watch] would submit dlite-{name}-"), line
    assert f"target.path=models:/{model}/1" in line, line  # pinned: the alias may move
    assert jobs_of(JobSubmissionClient(ray_head), name) == []
    assert tracking.client(mlflow_server).get_experiment_by_name(f"watch-{name}") is None
    assert watch_target.main(argv(f"models:/{model}@nope", name, mlflow_server)) == 1
    assert "error: --source: models:/watch-test-target@nope" in capsys.readouterr().out


def test_sources_pick_the_newest_complete_checkpoint(tmp_path):
    """The completeness rule, on a local directory and through pyarrow (file://, the
    code path S3 takes): sharded weights count only when every shard is there."""
    src = tmp_path / "ckpts"
    old, new = make_checkpoint(src / "a", "a"), make_checkpoint(src / "b", "b")
    os.utime(old / "config.json", (time.time() - 100,) * 2)
    index = {"weight_map": {"x": "model-2.safetensors"}}
    (new / "model.safetensors.index.json").write_text(json.dumps(index))
    cfg = OmegaConf.create({"tracking": {"uri": "unused"}, "target": {"name": "tiny"}})
    def opts(source, min_age=0.0):
        return watch.Options(source=str(source), config_path="c.yaml", min_age=min_age)

    assert watch.latest(cfg, opts(src)).uri == str(old)  # b misses a shard
    assert watch.latest(cfg, opts(src.as_uri())).uri == src.as_uri() + "/a"
    (new / "model-2.safetensors").write_bytes((new / "model.safetensors").read_bytes())
    local, remote = watch.latest(cfg, opts(src)), watch.latest(cfg, opts(src.as_uri()))
    assert (local.uri, local.fingerprint) == (str(new), fingerprint(new))
    assert remote.uri == src.as_uri() + "/b" and len(remote.fingerprint) == 16
    assert watch.latest(cfg, opts(new)).uri == str(new)  # one checkpoint dir
    assert watch.latest(cfg, opts(src, min_age=3600)) is None
    with pytest.raises(watch.WatchError, match="--source: no such directory"):
        watch.latest(cfg, opts(tmp_path / "missing"))
