"""Integration set-up: one real local Ray for the whole session (2 CPUs, no dashboard),
`ray start --head` clusters with token authentication on for job submission (this
process authenticates as the README says: RAY_AUTH_MODE=token, ~/.ray/auth_token),
and a random-weight tiny Qwen3 target saved with the shipped tokenizer, so collection
tests run against a real checkpoint directory without waiting for the trained one."""

import contextlib
import os
import shutil

import pytest


@pytest.fixture(scope="session")
def ray_session(repo_root):
    import ray
    # Workers inherit the environment of the raylet started here: make the repo importable
    # in them whatever the working directory.
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(repo_root),
                                                               os.environ.get("PYTHONPATH")])))
        if not ray.is_initialized():
            ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
        yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def random_target(tmp_path_factory) -> str:
    """A 4-layer, width-64 Qwen3 with random weights + the tiny tokenizer, in one dir."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM
    from dlite import tiny
    out = tmp_path_factory.mktemp("random_target")
    tok = tiny.load_tokenizer()
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(Qwen3Config(
        vocab_size=len(tok), hidden_size=64, num_hidden_layers=4, num_attention_heads=2,
        num_key_value_heads=1, head_dim=32, intermediate_size=128))
    model.save_pretrained(out)
    for f in tiny.TOKENIZER_PATH.iterdir():
        shutil.copy(f, out / f.name)
    return str(out)


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def ray_token():
    """Clients of this test process authenticate to token-auth heads as the README says:
    RAY_AUTH_MODE=token, the token in the default file ~/.ray/auth_token (made by
    `ray get-auth-token --generate` when missing, as any local `ray.init()` of Ray 2.60
    would). Yields the token, for the raw HTTP probes of `_wait_for_jobs_api`."""
    import subprocess
    import sys
    from pathlib import Path

    from ray._raylet import Config
    ray_cli = str(Path(sys.executable).with_name("ray"))
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    token = subprocess.run([ray_cli, "get-auth-token", "--generate"], env=env, check=True,
                           capture_output=True, text=True, timeout=120).stdout.strip()
    with pytest.MonkeyPatch.context() as mp:
        for k in ("RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"):  # the heads read the file
            mp.delenv(k, raising=False)
        mp.setenv("RAY_AUTH_MODE", "token")
        # Ray reads RAY_AUTH_MODE into its config once per process: re-read it, as
        # ray.init() itself does when it turns token auth on.
        Config.initialize("")
        yield token


@pytest.fixture(scope="session")
def ray_head(ray_token):
    """A real `ray start --head` cluster for the whole session: see `running_head`."""
    with running_head(ray_token) as (address, _):
        yield address


@pytest.fixture
def own_ray_head(ray_token):
    """`with own_ray_head() as (address, temp_dir):` a head of the test's own, stopped
    when the block ends (what a user's `ray stop` does), for checks made after Ray is gone."""
    return lambda: running_head(ray_token)


@contextlib.contextmanager
def running_head(token: str):
    """A real `ray start --head` cluster (dashboard on) for job submission; yields its
    job API address `http://127.0.0.1:<dashboard port>` for `JobSubmissionClient` /
    `ray job submit --address`, and its temp dir.

    - Token authentication on, as a default Ray 2.60 head has it: started without
      RAY_AUTH_MODE, it turns token auth on because ~/.ray/auth_token exists (see
      `ray_token`); checked here, so a head without it fails the fixture. Jobs inherit
      RAY_AUTH_MODE=token from it and their `ray.init()` reads the same file.
    - 2 logical CPUs, like `ray_session`: a whole pipeline submitted as a job needs its
      two Ray Train workers (cluster.num_workers=2) to fit.
    - A head that fails to start is retried (4 tries) on new ports: a port taken since
      it was picked, or -- seen on a loaded 2-core machine -- a raylet that waits for
      its Python agents longer than the 30 s `ray start` allows it to register.
    - Every port is a free one and the temp dir is private and short (Unix socket
      paths are limited to 107 bytes), so it coexists with the in-process
      `ray_session` and with other Ray clusters on the machine. Logs:
      <temp dir>/start.log and <temp dir>/session_latest/logs (kept if the head dies).
    - Job entrypoints run `python` from PATH: the venv's bin dir is put first so it is
      this interpreter. No MLFLOW_TRACKING_URI reaches the jobs from this process: a
      job's store is what its command line names, or its default.
    - `ray stop` would stop every Ray of this user, so the head runs as
      `ray start --block` in a session of its own: teardown stops unfinished jobs,
      SIGTERMs that process (it stops what it started; job drivers die with their
      supervisor) and SIGKILLs whatever of its session is left after 30 s.
    """
    import signal
    import subprocess
    import tempfile
    from pathlib import Path
    tmp = Path(tempfile.mkdtemp(prefix="dlite-rayhead-", dir="/tmp"))
    attempts = 4
    for attempt in range(attempts):
        head, address = _start_head(tmp)
        try:
            _wait_for_jobs_api(address, head, tmp / "start.log", token)
            break
        except RuntimeError:
            died = head.poll() is not None  # a start that failed, not one still going
            _kill_session(head.pid)
            if attempt == attempts - 1 or not died:
                shutil.rmtree(tmp, ignore_errors=True)
                raise
        except AssertionError:  # up, but without token auth: no retry helps
            _kill_session(head.pid)
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    try:
        yield address, tmp
    finally:
        died = head.poll() is not None  # under the tests' feet: keep its logs
        _stop_jobs(address)
        head.send_signal(signal.SIGTERM)
        try:
            head.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass
        _kill_session(head.pid)
        if died:
            print(f"ray_head: the head exited early (code {head.returncode}); logs kept in {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)


def _start_head(tmp):
    import subprocess
    import sys
    from pathlib import Path
    ports = {k: _free_port() for k in (
        "port", "dashboard-port", "ray-client-server-port", "dashboard-agent-listen-port",
        "dashboard-agent-grpc-port", "runtime-env-agent-port", "metrics-export-port",
        "node-manager-port", "object-manager-port")}
    venv_bin = str(Path(sys.executable).parent)
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("RAY_") and k != "MLFLOW_TRACKING_URI"}
    env.update(PATH=os.pathsep.join([venv_bin, env.get("PATH", "")]), RAY_USAGE_STATS_ENABLED="0")
    cmd = [str(Path(venv_bin) / "ray"), "start", "--head", "--block", "--num-cpus", "2",
           "--include-dashboard", "true", "--dashboard-host", "127.0.0.1",
           "--disable-usage-stats", "--temp-dir", str(tmp),
           *[a for k, v in ports.items() for a in (f"--{k}", str(v))]]
    with open(tmp / "start.log", "w") as log:  # the child keeps its own descriptor
        head = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=tmp, env=env,
                                start_new_session=True)
    return head, f"http://127.0.0.1:{ports['dashboard-port']}"


def _wait_for_jobs_api(address: str, head, log_path, token: str, timeout: float = 300.0) -> None:
    """Up when `ray start` says it started (the dashboard answers before that, and a
    raylet slower than Ray's fixed 30 s still fails the start) and the job API answers
    with the token -- and refuses without it (a head without token auth is an error)."""
    import time
    import urllib.error
    import urllib.request
    deadline = time.time() + timeout
    url = f"{address}/api/jobs/"
    while True:
        if "block forever" in log_path.read_text():  # `--block` prints it once started
            try:
                req = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"})
                with urllib.request.urlopen(req, timeout=5) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
        if head.poll() is not None or time.time() > deadline:
            raise RuntimeError(f"ray head did not start: {log_path.read_text()[-3000:]}")
        time.sleep(1)
    try:
        urllib.request.urlopen(url, timeout=5).close()
    except urllib.error.HTTPError as e:
        if e.code == 401:  # "Unauthorized: Missing authentication token"
            return
    raise AssertionError(f"{address}: the job API answers without a token (token auth is off)")


def _stop_jobs(address: str) -> None:
    try:
        from ray.job_submission import JobSubmissionClient
        client = JobSubmissionClient(address)
        for job in client.list_jobs():
            if job.submission_id and not job.status.is_terminal():
                client.stop_job(job.submission_id)
    except Exception as e:  # noqa: BLE001 -- teardown goes on to kill the processes anyway
        print(f"ray_head teardown: could not stop jobs: {e}")


def _kill_session(sid: int) -> None:
    """SIGKILL the processes left in the head's session (Ray workers keep it; job
    drivers start their own and die with their supervisor)."""
    import signal
    from pathlib import Path
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if os.getsid(int(proc.name)) == sid:
                os.kill(int(proc.name), signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
