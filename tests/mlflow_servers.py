"""Real `mlflow server` processes for tests: one helper that starts a server on a free
localhost port (SQLite backend, local artifact dir, one worker), waits for /health, and
stops it -- shared by the session's plain server (tests/conftest.py) and the basic-auth
server of tests/integration/test_mlflow_auth.py."""

import contextlib
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_healthy(uri: str, proc, log: Path, timeout: float) -> None:
    deadline = time.time() + timeout
    while True:
        try:
            with urllib.request.urlopen(f"{uri}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        if proc.poll() is not None or time.time() > deadline:
            proc.kill()
            raise RuntimeError(f"mlflow server did not start: {log.read_text()[-2000:]}")
        time.sleep(0.5)


@contextlib.contextmanager
def mlflow_server(root: Path, extra_args=(), env=None, timeout: float = 300):
    """Yields the http:// URI of a server storing under `root`; `extra_args` go to
    `mlflow server` (e.g. `--app-name basic-auth`), `env` is added to the environment.
    The wait is long: a loaded 2-core machine takes minutes to import MLflow."""
    # The server's background job runners (three huey consumers) are for GenAI features
    # we do not use; on 2 cores they only take CPU from the tests.
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false", **(env or {})}
    port, log_path = free_port(), root / "server.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [str(Path(sys.executable).with_name("mlflow")), "server", *extra_args,
             "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
             "--backend-store-uri", f"sqlite:///{root / 'mlflow.db'}",
             "--artifacts-destination", str(root / "artifacts")],
            stdout=log, stderr=subprocess.STDOUT, cwd=root, env=env)
        uri = f"http://127.0.0.1:{port}"
        try:
            _wait_healthy(uri, proc, log_path, timeout)
            yield uri
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
