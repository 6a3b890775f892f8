"""Scheduled retraining: notice a new target checkpoint and submit the pipeline for it
exactly once (`jobs/watch_target.py` is the command line).

Sources and the completeness rule: pipelines/retraining/checkpoints.py.

Exactly once: the Ray submission id is derived from (run.name, fingerprint), and a
Ray cluster refuses an id it already has. MLflow (experiment `tracking.experiment`)
keeps the record: one run per (watched source, run.name) (tag `dlite.kind=watcher`)
with a tag `dlite.watch.fp.<fingerprint>` per submission. A fingerprint is new only
when it is in neither: a crash between submit and record is healed by the next check (the job is in
Ray, so it is only recorded), and a recreated cluster that lost its job list does not
retrain a checkpoint MLflow says was already submitted.
"""

import hashlib
import json
import os
import re
import shlex
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import List, Optional

from dlite.config import REPO_ROOT  # uploaded as the job's working dir by default
from pipelines.common import tracking
from pipelines.retraining.checkpoints import Checkpoint, WatchError, latest  # noqa: F401 (watch's API)

# Never uploaded with the job (Ray also honours .gitignore): environments, outputs, stores.
EXCLUDES = [".venv", ".git", "runs", "mlruns", "mlartifacts", "*.db", "__pycache__",
            ".pytest_cache", ".cache"]
CRASH_ENV = "DLITE_WATCH_CRASH_AFTER_SUBMIT"  # the crash test's fault hook
TAG = "dlite.watch.fp."  # + fingerprint: the record of one submission


@dataclass
class Options:
    source: str
    config_path: str
    overrides: List[str] = field(default_factory=list)
    pipeline_args: str = ""
    address: Optional[str] = None  # None: $RAY_ADDRESS, as the Ray job CLI does
    working_dir: str = str(REPO_ROOT)
    min_age: float = 60.0
    dry_run: bool = False


# ---------------------------------------------------------------- the job

def submission_id(cfg, ckpt: Checkpoint) -> str:
    """One per (experiment, checkpoint): the same checkpoint watched for two experiments
    (say two drafter sizes) trains both, but each only once."""
    run = re.sub(r"[^a-z0-9]+", "-", cfg.run.name.lower()).strip("-") or "run"
    return f"dlite-{run}-{ckpt.fingerprint}"


def entrypoint(cfg, opts: Options, ckpt: Checkpoint) -> str:
    """The pipeline on the new checkpoint: the watcher's own overrides first, then the
    target and the tracking store it resolved (so the job logs where the watcher records)."""
    config = Path(opts.config_path)
    if config.is_absolute() and config.is_relative_to(opts.working_dir):
        config = config.relative_to(opts.working_dir)  # the job runs in the uploaded copy
    return shlex.join(["python", "-m", "jobs.pipeline", "--config", str(config), *opts.overrides,
                       f"target.path={ckpt.uri}", f"target.name={cfg.target.name}",
                       f"tracking.uri={cfg.tracking.uri}", *shlex.split(opts.pipeline_args)])


def job_status(client, sid: str) -> Optional[dict]:
    """The job's status and start time, or None when this cluster never saw `sid`."""
    try:
        info = client.get_job_info(sid)
    except RuntimeError as e:
        if "status code 404" in str(e):  # the SDK's wording for "no such job"
            return None
        raise
    return {"status": str(info.status.value), "start_time": (info.start_time or 0) / 1000}


def submit(client, sid: str, command: str, working_dir: str) -> bool:
    """True when this call created the job; False when Ray already had `sid` (another
    watcher won the race): the id is the lock, no second job can exist."""
    # The upload leaves .git behind: the commit travels as DLITE_GIT_COMMIT, which
    # publishing writes on the registry version (pipelines.stages.publish.git_commit).
    from pipelines.stages.publish import git_commit
    env = {"DLITE_GIT_COMMIT": git_commit()}
    try:
        client.submit_job(entrypoint=command, submission_id=sid,
                          runtime_env={"working_dir": working_dir, "excludes": EXCLUDES, "env_vars": env})
    except RuntimeError as e:
        if job_status(client, sid) is None:
            raise WatchError(f"submitting {sid} failed: {e}") from None
        return False
    return True


# ---------------------------------------------------------------- the record

def watcher_run(cfg, source: str, create: bool = True) -> Optional[str]:
    """The record run of (source, run.name) -- the pair a submission id is made of --
    found by tag, so every (ephemeral) cron pod reuses it."""
    c = tracking.client(cfg.tracking.uri)
    if not create and c.get_experiment_by_name(cfg.tracking.experiment) is None:
        return None  # a dry run creates nothing, not even the experiment
    exp = tracking.experiment_id(cfg)
    key = hashlib.sha256(f"{cfg.run.name}|{source}".encode()).hexdigest()[:16]
    query = f"tags.`dlite.kind` = 'watcher' and tags.`dlite.watch.key` = '{key}'"
    found = c.search_runs([exp], query, order_by=["attributes.start_time ASC"], max_results=1)
    if found or not create:
        return found[0].info.run_id if found else None
    run = c.create_run(exp, run_name=f"watch-target-{cfg.run.name}", tags={
        "dlite.kind": "watcher", "dlite.watch.source": source, "dlite.watch.key": key,
        "dlite.watch.run_name": cfg.run.name})
    tracking.finish(cfg.tracking.uri, run.info.run_id)  # a record, not a running process
    return run.info.run_id


def recorded(cfg, run_id: Optional[str], fingerprint: str) -> Optional[dict]:
    if run_id is None:
        return None
    value = tracking.client(cfg.tracking.uri).get_run(run_id).data.tags.get(TAG + fingerprint)
    return json.loads(value) if value else None


def record(cfg, run_id: str, ckpt: Checkpoint, sid: str, submitted_at: float) -> None:
    stamp = lambda t: time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t))
    tracking.set_tags(cfg.tracking.uri, run_id, {
        TAG + ckpt.fingerprint: json.dumps({"submission_id": sid, "checkpoint": ckpt.uri,
                                            "submitted_at": stamp(submitted_at),
                                            "recorded_at": stamp(time.time())}),
        "dlite.watch.latest": ckpt.fingerprint})


# ---------------------------------------------------------------- one check

def connect(address: Optional[str]):
    """The job API client. A token-auth cluster (Ray's default once a token exists) needs
    RAY_AUTH_MODE=token and the token in this process's environment (RAY_AUTH_TOKEN,
    RAY_AUTH_TOKEN_PATH or ~/.ray/auth_token): the client sends it on every request."""
    from ray.exceptions import AuthenticationError
    from ray.job_submission import JobSubmissionClient
    try:
        return JobSubmissionClient(address)
    except AuthenticationError as e:
        raise WatchError(f"--address {address or '$RAY_ADDRESS'}: {e}") from None


def check(cfg, opts: Options) -> str:
    """Look once; submit when the newest checkpoint is new. Returns the decision line."""
    if not Path(cfg.run.output_dir).is_absolute():
        # The job would refuse it (dlite.config: a job's working dir is Ray's temporary
        # copy), yet the checkpoint would count as submitted and never be trained.
        raise WatchError(f"run.output_dir: {cfg.run.output_dir!r} is relative; the pipeline job "
                         "needs an absolute path every Ray node sees")
    ckpt = latest(cfg, opts)
    if ckpt is None:
        return f"nothing new: no complete checkpoint at {opts.source}"
    client = connect(opts.address)
    sid = submission_id(cfg, ckpt)
    run_id = watcher_run(cfg, opts.source, create=not opts.dry_run)
    seen, job = recorded(cfg, run_id, ckpt.fingerprint), job_status(client, sid)
    if seen:
        where = f"job {job['status']}" if job else "recorded in MLflow, unknown to this cluster"
        return f"already submitted: {ckpt.uri} ({ckpt.fingerprint}) as {sid} ({where})"
    command = entrypoint(cfg, opts, ckpt)
    if opts.dry_run:
        verb = "would record" if job else "would submit"
        return f"{verb} {sid} for {ckpt.uri} ({ckpt.fingerprint}): {command}"
    created = job is None and submit(client, sid, command, opts.working_dir)
    if created and os.environ.get(CRASH_ENV) == "1":
        os.kill(os.getpid(), signal.SIGKILL)  # the crash test: die before the record
    at = time.time() if created else (job or job_status(client, sid))["start_time"]
    record(cfg, run_id, ckpt, sid, at)
    if created:
        return f"submitted {sid} for new checkpoint {ckpt.uri} ({ckpt.fingerprint})"
    return f"already submitted: {ckpt.uri} ({ckpt.fingerprint}) as {sid} (in Ray, recorded now)"


def watch(cfg, opts: Options, once: bool, interval: float, say=print) -> int:
    """`once` (cron): one check; a source that cannot be watched exits 1, anything else
    raises (the traceback is the cron log). Otherwise check every `interval` seconds
    and carry on past a failed check: the cluster or the store may be back next time."""
    while True:
        try:
            say(f"[watch] {check(cfg, opts)}")
        except WatchError as e:
            say(f"[watch] error: {e}")
            if once:
                return 1
        except Exception as e:  # a daemon outlives a failed check
            if once:
                raise
            say(f"[watch] check failed: {type(e).__name__}: {e}")
        if once:
            return 0
        time.sleep(interval)
