"""Where a run started as a Ray job keeps what must outlive it: the job's working dir is
Ray's temporary unpacked copy of `--working-dir`, so a relative `run.output_dir` or
MLflow store is refused (naming the key) before any work, and with no store configured
the record goes beside the outputs in `run.output_dir`. By hand nothing changes."""

import pytest

from dlite import config
from dlite.config import ConfigError, load_config
from jobs.cli import parse_args
from pipelines.common import tracking

TINY = str(config.REPO_ROOT / "configs/experiments/tiny.yaml")


@pytest.fixture
def ray_job(monkeypatch, tmp_path):
    """The environment Ray's job supervisor gives an entrypoint, run from elsewhere."""
    monkeypatch.setenv(config.RAY_JOB_ENV, '{"runtime_env": {}}')
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_by_hand_the_store_stays_in_the_current_directory(tmp_path, monkeypatch):
    monkeypatch.delenv(config.RAY_JOB_ENV, raising=False)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.chdir(tmp_path)
    assert not config.in_ray_job()
    cfg = load_config(TINY)  # relative run.output_dir is fine here
    assert cfg.run.output_dir == "runs" and cfg.tracking.uri == f"sqlite:///{tmp_path / 'mlflow.db'}"


def test_job_default_store_lives_beside_the_outputs(ray_job):
    out = ray_job / "shared" / "runs"
    cfg = load_config(TINY, [f"run.output_dir={out}"])
    assert cfg.tracking.uri == f"sqlite:///{out / 'mlflow.db'}"
    # ... with its artifacts next to it, and the printed `mlflow ui` command names it.
    assert tracking._artifact_root(cfg.tracking.uri) == (out / "mlartifacts").as_uri()


def test_job_refuses_a_relative_output_dir(ray_job):
    with pytest.raises(ConfigError, match=r"^run\.output_dir: 'runs' is relative, and this runs as a Ray job"):
        load_config(TINY)


@pytest.mark.parametrize("uri", ["sqlite:///mlflow.db", "file:mlruns", "file://./mlruns", "mlruns"])
def test_job_refuses_a_relative_store(ray_job, uri):
    out = f"run.output_dir={ray_job / 'runs'}"
    with pytest.raises(ConfigError, match=r"^tracking\.uri: .* is relative, and this runs as a Ray job"):
        load_config(TINY, [out, f"tracking.uri={uri}"])


def test_job_refuses_a_relative_store_from_the_environment(ray_job, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "sqlite:///mlflow.db")
    with pytest.raises(ConfigError, match=r"^MLFLOW_TRACKING_URI: 'sqlite:///mlflow.db' is relative"):
        load_config(TINY, [f"run.output_dir={ray_job / 'runs'}"])


@pytest.mark.parametrize("uri", ["http://mlflow:5000", "sqlite:////shared/mlflow.db", "file:///shared/mlruns",
                                 "postgresql://u@db/mlflow", "databricks"])
def test_job_accepts_servers_and_absolute_stores(ray_job, uri):
    cfg = load_config(TINY, [f"run.output_dir={ray_job / 'runs'}", f"tracking.uri={uri}"])
    assert cfg.tracking.uri == uri


def test_job_is_also_recognised_by_its_unpacked_working_dir(tmp_path, monkeypatch):
    pkg = tmp_path / "session_x" / "runtime_resources" / "working_dir_files" / "_ray_pkg_0123"
    pkg.mkdir(parents=True)
    monkeypatch.delenv(config.RAY_JOB_ENV, raising=False)
    monkeypatch.chdir(pkg)
    assert config.in_ray_job()


def test_job_refusal_is_one_line_and_exit_2(ray_job, capsys):
    with pytest.raises(SystemExit) as stop:
        parse_args(["--config", TINY, "--dry-run"])
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("config error: run.output_dir: ") and err.count("\n") == 1, err


def test_watcher_refuses_to_submit_a_job_that_would_refuse(tmp_path, monkeypatch):
    """Else the checkpoint would count as submitted and never be trained."""
    from pipelines.retraining import watch
    monkeypatch.delenv(config.RAY_JOB_ENV, raising=False)
    cfg = load_config(TINY, [f"tracking.uri=sqlite:///{tmp_path / 'm.db'}"])
    opts = watch.Options(source=str(tmp_path), config_path=TINY)
    with pytest.raises(watch.WatchError, match=r"^run\.output_dir: 'runs' is relative"):
        watch.check(cfg, opts)
    assert watch.REPO_ROOT == config.REPO_ROOT  # the default upload is the whole repo
