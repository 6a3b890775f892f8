"""`python -m jobs.evaluate` on the embedded target with drafter artifacts saved to disk:
the report has the DLITE.md §4 metrics, and greedy speculative decoding is token-for-
token identical to plain decoding over multi-turn trajectories (random-weight DLite
and DSpark-style drafters here; a trained one in tests/integration)."""

import json
import subprocess
import sys

import pytest
import torch
from omegaconf import OmegaConf

from dlite import target as tgt
from dlite.config import load_config
from dlite.export import save_drafter
from dlite.models import build_drafter


@pytest.fixture(scope="module")
def tiny_cfg():
    return load_config("configs/experiments/tiny.yaml")


def _save_random(cfg, arch, out):
    model, tok = tgt.load(cfg.target)
    dcfg = OmegaConf.to_object(cfg.drafter)
    dcfg.arch = arch
    torch.manual_seed(0)
    drafter = build_drafter(dcfg, *tgt.shared_vocab(model, tok))
    save_drafter(drafter, out, {"target_fingerprint": tgt.fingerprint(cfg.target)["id"]})
    return out


@pytest.mark.parametrize("arch", ["dlite", "dspark"])
def test_evaluate_report_is_lossless(repo_root, tmp_path, tiny_cfg, arch):
    d = _save_random(tiny_cfg, arch, tmp_path / arch)
    out = tmp_path / "report.json"
    r = subprocess.run([sys.executable, "-m", "jobs.evaluate", "--drafter", str(d), "--out", str(out),
                        "eval.n_trajectories=2", "eval.max_turns=3", "eval.max_new_tokens=24",
                        "eval.temperatures=[0.0,1.0]"],
                       cwd=repo_root, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    rep = json.loads(out.read_text())
    assert rep["lossless"] is True and rep["by_temperature"]["0.0"]["lossless"] is True
    assert rep["n_tasks"] == 6
    assert 1.0 <= rep["tau"] <= 8.0 and len(rep["accept_at_k"]) == 7
    assert rep["tau_by_bucket"] and rep["speedup_vs_ar"] > 0
    assert set(rep["by_temperature"]) == {"0.0", "1.0"}
    assert rep["config"]["drafter"]["gamma"] == 7 and rep["env"]["torch"]
