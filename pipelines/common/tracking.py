"""MLflow tracking for every stage (ARCHITECTURE.md §5), in one place.

  experiment   one per target (`tracking.experiment`, default `dlite-<target.name>`)
  parent run   one per pipeline execution; the driver picks it and records its id in
               the pipeline's output dir, so a restarted pipeline reopens the same run
  child run    one per stage under the parent (tag `dlite.stage`); a stage's output dir
               remembers its run id, and a parent's existing child for the stage is
               reused, so restarts never duplicate runs

Everything goes through `MlflowClient` with an explicit tracking URI (the resolved
`tracking.uri`): no global `mlflow.set_tracking_uri`, so Ray workers, tests and
several stores in one process cannot cross wires. A local SQLite store keeps its
artifacts beside the database (`<db dir>/mlartifacts`), not under whatever directory
the process happens to run in.

The store is checked once before any work by `pipelines.common.preflight` (re-exported
here as `preflight`, `TrackingError`, `probe_write`).
"""

import contextlib
import functools
import json
import time
from pathlib import Path
from typing import Optional

from omegaconf import OmegaConf

from pipelines.common.preflight import TrackingError, preflight, probe_write  # noqa: F401 (the jobs' API)

RUN_FILE = "mlflow_run.json"


@functools.lru_cache(maxsize=8)
def client(uri: str):
    """One client per process and store (rank 0 logs every step)."""
    from mlflow import MlflowClient
    return MlflowClient(tracking_uri=uri)


def experiment_id(cfg) -> str:
    c, name = client(cfg.tracking.uri), cfg.tracking.experiment
    exp = c.get_experiment_by_name(name)
    if exp is not None:
        return exp.experiment_id
    return c.create_experiment(name, artifact_location=_artifact_root(cfg.tracking.uri),
                               tags={"dlite.target": cfg.target.name})


def _artifact_root(uri: str) -> Optional[str]:
    """Beside the SQLite file for a local store; the server's choice otherwise."""
    prefix = "sqlite:///"
    if uri.startswith(prefix):
        return (Path(uri[len(prefix):]).parent / "mlartifacts").resolve().as_uri()
    return None


def _read(path: Path) -> Optional[dict]:
    return json.loads(path.read_text()) if path.is_file() else None


def _remember(output: Path, run_id: str, uri: str) -> None:
    output.mkdir(parents=True, exist_ok=True)
    tmp = output / f".{RUN_FILE}.tmp"
    tmp.write_text(json.dumps({"run_id": run_id, "uri": uri}))
    tmp.rename(output / RUN_FILE)


def _reopen(output: Path, uri: str) -> Optional[str]:
    saved = _read(output / RUN_FILE)
    if not saved or saved.get("uri") != uri:
        return None  # another store: this output dir's run is not in it
    client(uri).update_run(saved["run_id"], status="RUNNING")
    return saved["run_id"]


def open_parent(cfg, output: Path, name: str, tags: Optional[dict] = None) -> str:
    """The pipeline's run: reopened when `output` already has one, else created."""
    uri = cfg.tracking.uri
    run_id = _reopen(output, uri)
    if run_id is None:
        run_id = client(uri).create_run(experiment_id(cfg), run_name=name,
                                        tags={"dlite.kind": "pipeline", **(tags or {})}).info.run_id
        log_config(uri, run_id, cfg)
        _remember(output, run_id, uri)
    return run_id


def open_child(cfg, stage: str, output: Path, parent_run_id: Optional[str]) -> str:
    """The stage's run id: the one this output dir already used, else the parent's
    existing child for this stage, else a new one."""
    uri = cfg.tracking.uri
    run_id = _reopen(output, uri)
    if run_id is not None:
        return run_id
    c, found = client(uri), []
    if parent_run_id:  # the child lives in its parent's experiment
        exp_id = c.get_run(parent_run_id).info.experiment_id
        found = c.search_runs([exp_id], f"tags.mlflow.parentRunId = '{parent_run_id}' "
                                        f"and tags.`dlite.stage` = '{stage}'")
    else:
        exp_id = experiment_id(cfg)
    tags = {"dlite.stage": stage, **({"mlflow.parentRunId": parent_run_id} if parent_run_id else {})}
    run_id = found[0].info.run_id if found else c.create_run(exp_id, tags=tags, run_name=stage).info.run_id
    if not found:
        log_config(uri, run_id, cfg)
    _remember(output, run_id, uri)
    return run_id


def flatten(d: dict, prefix: str = "") -> dict:
    """{"a": {"b": 1}} -> {"a.b": 1}: the resolved config as MLflow params."""
    out = {}
    for k, v in d.items():
        out.update(flatten(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out


def log_config(uri: str, run_id: str, cfg) -> None:
    """Params = the resolved config (100 per call: the tracking API's limit)."""
    from mlflow.entities import Param
    items = list(flatten(OmegaConf.to_container(cfg, resolve=True)).items())
    for i in range(0, len(items), 100):
        client(uri).log_batch(run_id, params=[Param(k, str(v)[:6000]) for k, v in items[i:i + 100]])


def log_metrics(uri: str, run_id: str, step: int, metrics: dict) -> None:
    from mlflow.entities import Metric
    now = int(time.time() * 1000)
    client(uri).log_batch(run_id, metrics=[Metric(k, float(v), now, step) for k, v in metrics.items()])


def last_step(uri: str, run_id: str, key: str) -> int:
    """The highest step logged for `key` (-1 when none): a resumed loop starts logging
    after it, so steps redone since the last checkpoint are not logged twice."""
    hist = client(uri).get_metric_history(run_id, key)
    return max((m.step for m in hist), default=-1)


def set_tags(uri: str, run_id: str, tags: dict) -> None:
    for k, v in tags.items():
        client(uri).set_tag(run_id, k, str(v))


def log_artifact(uri: str, run_id: str, path, artifact_path: Optional[str] = None) -> None:
    """A file or a whole directory (e.g. the drafter) into the run's artifacts."""
    p = Path(path)
    if p.is_dir():
        client(uri).log_artifacts(run_id, str(p), artifact_path)
    else:
        client(uri).log_artifact(run_id, str(p), artifact_path)


def finish(uri: str, run_id: str, status: str = "FINISHED") -> None:
    client(uri).set_terminated(run_id, status)


@contextlib.contextmanager
def closing(uri: str, run_id: str):
    """Yield `run_id`; end the run FINISHED, or FAILED (and re-raise) if the body raises.
    Every stage's MLflow run is closed through this one place."""
    try:
        yield run_id
    except BaseException:
        finish(uri, run_id, "FAILED")
        raise
    finish(uri, run_id)


def child_run(cfg, stage: str, output: Path, parent_run_id: Optional[str]):
    """`open_child`'s run as a context manager that closes it (`closing`)."""
    return closing(cfg.tracking.uri, open_child(cfg, stage, output, parent_run_id))


def run_link(uri: str, run_id: str) -> str:
    """Where a reviewer finds the run: a URL for a server, the store + id otherwise."""
    run = client(uri).get_run(run_id)
    if uri.startswith(("http://", "https://")):
        return f"{uri.rstrip('/')}/#/experiments/{run.info.experiment_id}/runs/{run_id}"
    return f"{uri} (experiment {run.info.experiment_id}, run {run_id}; `mlflow ui --backend-store-uri {uri}`)"
