"""An MLflow store or output directory the job cannot use costs seconds, not minutes:
each job that talks to MLflow checks it once before any work (`tracking.preflight`,
`dag.check_writable`) and ends with exit 2 and one line on stderr naming the URI or
path and what to do. Real processes, real sockets: a port nobody listens on, a path
with a file in the way (what root cannot write either), a read-only directory when
not root. `--dry-run` checks nothing and still plans."""

import os
import socket
import subprocess
import sys
import time

import pytest

TINY = "configs/experiments/tiny.yaml"


def _closed_port_uri() -> str:
    """http://127.0.0.1:<port> with nothing listening (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


def _run(repo, module, *args, timeout=60):
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}
    t0 = time.time()
    r = subprocess.run([sys.executable, "-m", module, "--config", TINY, *args], cwd=repo, env=env,
                       capture_output=True, text=True, timeout=timeout)
    return r, time.time() - t0


def _one_line(r, starts: str) -> str:
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1, (r.returncode, r.stderr[-2000:])
    assert lines[0].startswith(starts) and "Traceback" not in r.stdout
    return lines[0]


@pytest.mark.parametrize("module,args", [
    ("jobs.pipeline", []),
    ("jobs.train", ["--stage", "teacher", "--input", "/nonexistent/shards", "--output", "OUT/t"]),
    ("jobs.watch_target", ["--source", "OUT", "--once"]),
], ids=["pipeline", "train", "watch_target"])
def test_an_unreachable_server_ends_the_job_in_seconds(repo_root, tmp_path, module, args):
    uri = _closed_port_uri()
    args = [a.replace("OUT", str(tmp_path)) for a in args]
    r, seconds = _run(repo_root, module, f"tracking.uri={uri}", f"run.output_dir={tmp_path}", *args)
    line = _one_line(r, "tracking error: ")
    assert f"MLflow tracking server {uri} is not reachable" in line and "tracking.uri" in line
    assert seconds < 15, seconds
    assert not (tmp_path / "stages").exists()


def test_a_dry_run_does_not_ask_the_server(repo_root, tmp_path):
    r, _ = _run(repo_root, "jobs.pipeline", "--dry-run", f"tracking.uri={_closed_port_uri()}",
                f"run.output_dir={tmp_path}")
    assert r.returncode == 0, r.stderr[-2000:]
    assert not any(tmp_path.iterdir())


def test_an_unwritable_output_dir_ends_the_pipeline_before_any_work(repo_root, tmp_path):
    (tmp_path / "file").write_text("in the way")
    out = tmp_path / "file" / "runs"
    r, seconds = _run(repo_root, "jobs.pipeline", f"run.output_dir={out}",
                      f"tracking.uri=sqlite:///{tmp_path / 'mlflow.db'}")
    line = _one_line(r, "pipeline error: run.output_dir: ")
    assert str(out) in line and "not a directory" in line.lower()
    assert seconds < 15, seconds


def test_an_unwritable_local_store_ends_the_pipeline(repo_root, tmp_path):
    (tmp_path / "file").write_text("in the way")
    store = f"sqlite:///{tmp_path / 'file' / 'mlflow.db'}"
    r, _ = _run(repo_root, "jobs.pipeline", f"run.output_dir={tmp_path / 'runs'}", f"tracking.uri={store}")
    line = _one_line(r, "tracking error: ")
    assert f"MLflow store {store}: cannot write" in line


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into a read-only directory")
def test_a_read_only_output_dir_is_refused(tmp_path):
    from dlite.config import load_config
    from pipelines.orchestration.dag import PipelineError, check_writable
    ro = tmp_path / "ro"
    ro.mkdir(mode=0o500)
    cfg = load_config(TINY, [f"run.output_dir={ro / 'runs'}", f"tracking.uri=sqlite:///{tmp_path}/m.db"])
    with pytest.raises(PipelineError, match="Permission denied"):
        check_writable(cfg)


def test_a_writable_store_and_output_dir_pass_and_leave_nothing_behind(tmp_path):
    from dlite.config import load_config
    from pipelines.common import tracking
    from pipelines.orchestration.dag import check_writable
    cfg = load_config(TINY, [f"run.output_dir={tmp_path / 'runs'}",
                             f"tracking.uri=sqlite:///{tmp_path / 'store' / 'mlflow.db'}"])
    check_writable(cfg)
    tracking.preflight(cfg, registry=True)
    assert [p.name for p in tmp_path.rglob("*") if p.is_file()] == []
