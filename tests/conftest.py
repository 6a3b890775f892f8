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


@pytest.fixture(scope="session")
def smoke_collection(repo_root, tmp_path_factory, smoke_pipeline) -> Path:
    """The smoke-size `collect` stage of the embedded default, run once per session
    (`jobs.pipeline --only collect`, its own SQLite store); yields its finished stage dir.
    Runs of the same settings start from it through `seed_stages` instead of collecting
    again: the pipeline finds the stage finished and reuses it, as a rerun would."""
    import subprocess
    from tests.pipeline_runs import SMALLEST_STAGES
    out = tmp_path_factory.mktemp("smoke_collection")
    r = subprocess.run([sys.executable, "-m", "jobs.pipeline", "--config", "configs/experiments/tiny.yaml",
                        "--only", "collect", f"run.output_dir={out}", f"tracking.uri=sqlite:///{out / 'mlflow.db'}",
                        *smoke_pipeline, *SMALLEST_STAGES], cwd=repo_root, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    (stage,) = (out / "stages").glob("collect-*")
    assert (stage / "stage.json").is_file()
    return stage


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
    from tests.mlflow_servers import mlflow_server as serve
    with serve(tmp_path_factory.mktemp("mlflow_server")) as uri:
        yield uri
