"""Shared test set-up: tiers by folder (unit / integration / e2e markers), the repo root
on sys.path, and CPU-only engines (DeepSpeed's CPU accelerator, no tokenizer threads)."""

import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def pytest_collection_modifyitems(items):
    for item in items:
        tier = Path(str(item.fspath)).parent.name
        if tier in ("integration", "e2e"):
            item.add_marker(getattr(pytest.mark, tier))


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return ROOT


@pytest.fixture(scope="session")
def smoke_pipeline() -> list:
    """Overrides that run the whole pipeline of the embedded default in a few minutes."""
    return ["data.n_train=16", "train.batch_size=2", "train.steps_teacher=4", "train.steps_align=4",
            "train.steps_dspark=4", "train.eval_every=2", "eval.n_trajectories=2", "eval.max_turns=2",
            "eval.max_new_tokens=16", "eval.speed_trajectories=1"]


@pytest.fixture(autouse=True, scope="session")
def one_thread():
    """Tiny ops on a shared 2-core machine run ~10x faster single-threaded: intra-op
    threads only contend with each other and with Ray workers."""
    import torch
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def mlflow_server(tmp_path_factory):
    """A real `mlflow server` on a free localhost port (SQLite backend, local artifact
    dir, one worker) for the whole session; yields its http:// tracking URI."""
    import socket
    import subprocess
    import time
    import urllib.request
    root = tmp_path_factory.mktemp("mlflow_server")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mlflow = Path(sys.executable).with_name("mlflow")
    log = open(root / "server.log", "w")
    proc = subprocess.Popen(
        [str(mlflow), "server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
         "--backend-store-uri", f"sqlite:///{root / 'mlflow.db'}",
         "--artifacts-destination", str(root / "artifacts")],
        stdout=log, stderr=subprocess.STDOUT, cwd=root,
        # The server's background job runners (three huey consumers) are for GenAI
        # features we do not use; on 2 cores they only take CPU from the tests.
        env={**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"})
    uri = f"http://127.0.0.1:{port}"
    deadline = time.time() + 300  # a loaded 2-core machine takes minutes to import it
    while True:
        try:
            with urllib.request.urlopen(f"{uri}/health", timeout=2) as r:
                if r.status == 200:
                    break
        except OSError:
            pass
        if proc.poll() is not None or time.time() > deadline:
            proc.kill()
            raise RuntimeError(f"mlflow server did not start: {(root / 'server.log').read_text()[-2000:]}")
        time.sleep(0.5)
    yield uri
    proc.terminate()
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
    log.close()
