"""The pipeline against an MLflow server with authentication on, as infra/k8s/mlflow.yaml
runs it: `mlflow server --app-name basic-auth` (its own basic_auth.ini, users in a temp
SQLite database, default permission READ), an admin who creates the experiment and the
registered model and grants the pipeline's service user EDIT on them (infra/README.md,
"MLflow users and permissions"), and a reviewer with nothing but an account.

  - a client without credentials is refused (401); a reviewer reads but cannot write
  - the preflight ends a launch with a wrong password or a read-only user in seconds,
    exit 2, one line naming the user and the missing permission
  - the service user runs the tiny pipeline (align -> evaluate -> publish at smoke
    size, from the session's finished collection); its gate (floors at 0 here, so that it passes and moves
    `production`) sets both aliases and records the move; the reviewer reads the
    decision and the figures it used
  - a later move of `production` by another user is reported by `jobs.publish`
"""

import contextlib
import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

from tests.mlflow_servers import mlflow_server
from tests.pipeline_runs import SMALLEST_STAGES, seed_stages

ADMIN, PIPELINE, REVIEWER = ("admin", "admin-pw-7f3a9c"), ("dlite-pipeline", "pipe-pw-2b8e41"), \
    ("reviewer", "review-pw-c51d07")
EXPERIMENT, MODEL = "auth-e2e", "dlite-tiny-auth"


@pytest.fixture(scope="module")
def auth_server(tmp_path_factory):
    """`mlflow server --app-name basic-auth` on a free port; yields its URI."""
    root = tmp_path_factory.mktemp("mlflow_auth")
    ini = root / "basic_auth.ini"
    ini.write_text("[mlflow]\ndefault_permission = READ\n"
                   f"database_uri = sqlite:///{root / 'auth.db'}\nadmin_username = {ADMIN[0]}\n"
                   "authorization_function = mlflow.server.auth:authenticate_request_basic_auth\n")
    env = {"MLFLOW_AUTH_CONFIG_PATH": str(ini), "MLFLOW_AUTH_ADMIN_PASSWORD": ADMIN[1],
           "MLFLOW_FLASK_SERVER_SECRET_KEY": "test-only-secret-key"}
    with mlflow_server(root, ["--app-name", "basic-auth"], env) as uri:
        yield uri


@contextlib.contextmanager
def as_user(user):
    """MLflow clients of this process send `user`'s credentials (read on every request)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("MLFLOW_TRACKING_TOKEN", raising=False)
        mp.setenv("MLFLOW_TRACKING_USERNAME", user[0])
        mp.setenv("MLFLOW_TRACKING_PASSWORD", user[1])
        yield


@pytest.fixture(scope="module")
def accounts(auth_server):
    """The README's set-up: users, the admin's experiment and model, EDIT for the pipeline."""
    from mlflow import MlflowClient
    from mlflow.server.auth.client import AuthServiceClient
    with as_user(ADMIN):
        auth, c = AuthServiceClient(auth_server), MlflowClient(auth_server)
        for user, password in (PIPELINE, REVIEWER):
            auth.create_user(user, password)
        exp = c.create_experiment(EXPERIMENT)
        c.create_registered_model(MODEL)
        auth.grant_user_permission(PIPELINE[0], "experiment", exp, "EDIT")
        auth.grant_user_permission(PIPELINE[0], "registered_model", MODEL, "EDIT")
    return auth_server


def _job(repo, module, uri, user, *args, timeout=900):
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_TRACKING_")}
    env.update(MLFLOW_TRACKING_USERNAME=user[0], MLFLOW_TRACKING_PASSWORD=user[1])
    t0 = time.time()
    r = subprocess.run([sys.executable, "-m", module, "--config", "configs/experiments/tiny.yaml",
                        f"tracking.uri={uri}", f"tracking.experiment={EXPERIMENT}",
                        f"tracking.registered_model={MODEL}", *args],
                       cwd=repo, env=env, capture_output=True, text=True, timeout=timeout)
    return r, time.time() - t0


@pytest.fixture(scope="module")
def pipeline_run(repo_root, accounts, smoke_pipeline, smoke_collection, tmp_path_factory):
    """The point here is who may write, not the drafter: the smallest pipeline, from the
    session's finished collection (its MLflow record stays in that run's own store)."""
    out = tmp_path_factory.mktemp("auth_pipeline")
    seed_stages(out, smoke_collection)
    r, _ = _job(repo_root, "jobs.pipeline", accounts, PIPELINE, f"run.output_dir={out}",
                *smoke_pipeline, *SMALLEST_STAGES, "gate.min_tau=0", "gate.min_speedup=0", timeout=1800)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    (summary,) = out.glob("tiny-*/summary.json")
    return json.loads(summary.read_text())


def test_a_client_without_credentials_is_refused(accounts):
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(f"{accounts}/api/2.0/mlflow/experiments/search?max_results=1", timeout=10)
    assert refused.value.code == 401
    with urllib.request.urlopen(f"{accounts}/health", timeout=10) as r:  # kubelet's probe
        assert r.status == 200


@pytest.mark.parametrize("user,says", [
    ((PIPELINE[0], "wrong-password"), f"refused user '{PIPELINE[0]}' (401 Unauthorized)"),
    (REVIEWER, f"user '{REVIEWER[0]}' has READ on experiment '{EXPERIMENT}'; this job needs EDIT"),
], ids=["bad-password", "read-only-user"])
def test_preflight_refuses_in_seconds_with_one_line(repo_root, accounts, tmp_path, user, says):
    r, seconds = _job(repo_root, "jobs.pipeline", accounts, user, f"run.output_dir={tmp_path}",
                      timeout=120)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1, r.stderr[-2000:]
    assert lines[0].startswith("tracking error: ") and says in lines[0] and accounts in lines[0]
    assert seconds < 15 and "Traceback" not in r.stdout + r.stderr
    assert not list(tmp_path.glob("stages/*")), "no stage may start"


@pytest.mark.timeout(1800)
def test_service_user_runs_the_pipeline_and_its_gate_moves_the_aliases(pipeline_run, accounts):
    from mlflow import MlflowClient
    pub = pipeline_run["results"]["publish"]
    assert pub["gate"]["passed"] is True and pub["aliases"] == ["candidate", "production"]
    with as_user(ADMIN):
        c = MlflowClient(accounts)
        rm, tags = c.get_registered_model(MODEL), c.get_model_version(MODEL, pub["version"]).tags
    assert rm.aliases == {"candidate": pub["version"], "production": pub["version"]}
    assert tags["dlite.gate"] == "passed" and tags["dlite.gate.alias_set_by"] == PIPELINE[0]
    assert rm.tags["dlite.gate.production_version"] == pub["version"]


def test_a_reviewer_reads_the_decision_but_cannot_write(pipeline_run, accounts):
    from mlflow import MlflowClient
    from mlflow.exceptions import MlflowException
    pub = pipeline_run["results"]["publish"]
    with as_user(REVIEWER):
        c = MlflowClient(accounts)
        parent = c.get_run(pipeline_run["mlflow_run"])
        publish_run = c.get_run(pub["run_id"])
        version = c.get_model_version(MODEL, pub["version"])
        assert c.get_registered_model(MODEL).aliases["production"] == pub["version"]
        for write in (lambda: c.set_registered_model_alias(MODEL, "production", pub["version"]),
                      lambda: c.set_model_version_tag(MODEL, pub["version"], "dlite.gate", "passed"),
                      lambda: c.set_registered_model_tag(MODEL, "k", "v"),
                      lambda: c.create_run(parent.info.experiment_id)):
            with pytest.raises(MlflowException) as refused:
                write()
            assert refused.value.error_code == "PERMISSION_DENIED" and "403" in str(refused.value)
    assert parent.info.status == "FINISHED" and parent.data.metrics
    # The gate's decision and the figures it read: tags on the version, metrics on the run.
    assert version.tags["dlite.gate"] == "passed" and version.tags["dlite.gate.reasons"] == "none"
    ev = pipeline_run["results"]["evaluate"]["methods"]["dlite"]
    assert json.loads(version.tags["dlite.metric.speedup_vs_ar"]) == pytest.approx(ev["speedup_vs_ar"])
    assert json.loads(version.tags["dlite.metric.tau"]) == pytest.approx(ev["tau"])
    assert publish_run.data.metrics["gate_passed"] == 1.0
    assert publish_run.data.metrics["speedup_vs_ar"] == pytest.approx(ev["speedup_vs_ar"])


def test_a_production_move_by_someone_else_is_reported(pipeline_run, accounts, repo_root, tmp_path):
    from mlflow import MlflowClient
    from pipelines.stages import registry_audit
    pub = pipeline_run["results"]["publish"]
    with as_user(ADMIN):  # a second version, never gated, moved to production by hand
        c = MlflowClient(accounts)
        other = c.create_model_version(MODEL, pub["source"], run_id=pub["run_id"]).version
        c.set_registered_model_alias(MODEL, "production", other)
    with as_user(REVIEWER):  # reading is enough to audit
        found = registry_audit.audit_production(MlflowClient(accounts), MODEL)
    assert len(found) == 2, found
    assert f"production -> v{other}, which the release gate did not pass (dlite.gate=missing)" in found[0]
    assert f"the gate last set v{pub['version']} ({PIPELINE[0]} at " in found[1]
    assert all("not recorded as a manual move" in f for f in found)
    # jobs.publish, as the service user, warns before its gate decides again.
    r, _ = _job(repo_root, "jobs.publish", accounts, PIPELINE, "--drafter",
                pipeline_run["results"]["align"]["drafter"], "--report",
                pipeline_run["results"]["evaluate"]["report"], "--out", str(tmp_path / "s.json"),
                "--output", str(tmp_path / "publish"), "gate.min_tau=0", "gate.min_speedup=0")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "[publish] warning: " in r.stderr and "moved by someone other than the gate" in r.stderr
    summary = json.loads((tmp_path / "s.json").read_text())
    assert summary["gate"]["production_audit"] == found
    with as_user(REVIEWER):
        tag = MlflowClient(accounts).get_run(summary["run_id"]).data.tags["dlite.gate.production_audit"]
    assert f"production -> v{other}" in tag


def test_a_recorded_manual_move_names_its_author(pipeline_run, accounts):
    from mlflow import MlflowClient
    from mlflow.exceptions import MlflowException
    from pipelines.stages import registry_audit
    pub = pipeline_run["results"]["publish"]
    with as_user(REVIEWER):  # READ: the server refuses the move itself
        with pytest.raises(MlflowException, match="403"):
            registry_audit.set_production_by_hand(MlflowClient(accounts), MODEL, pub["version"], "try")
    with as_user(ADMIN):
        c = MlflowClient(accounts)
        other = c.create_model_version(MODEL, pub["source"], run_id=pub["run_id"]).version
        registry_audit.set_production_by_hand(c, MODEL, other, "rollback drill")
        assert c.get_registered_model(MODEL).aliases["production"] == other
        found = registry_audit.audit_production(c, MODEL)
    assert found and all(f"(set by hand by {ADMIN[0]} at " in f and "rollback drill" in f for f in found)
