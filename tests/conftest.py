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


@pytest.fixture(autouse=True, scope="session")
def one_thread():
    """Tiny ops on a shared 2-core machine run ~10x faster single-threaded: intra-op
    threads only contend with each other and with Ray workers."""
    import torch
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
