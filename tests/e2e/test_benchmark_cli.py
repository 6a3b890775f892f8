"""`python -m jobs.benchmark` as a user runs it: the draft-cost report has the DLITE.md
§4 metric names for both drafters and the published-shape parameter counts."""

import json
import subprocess
import sys


def test_draft_cost_report(repo_root, tmp_path):
    out = tmp_path / "draft_cost.json"
    r = subprocess.run([sys.executable, "-m", "jobs.benchmark", "draft_cost", "--out", str(out),
                        "--rounds", "4", "--context-lengths", "64", "512"],
                       cwd=repo_root, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    rep = json.loads(out.read_text())
    assert set(rep["draft_ms"]) == {"dlite", "dspark"}
    assert set(rep["draft_ms"]["dlite"]) == {"64", "512"}
    assert rep["draft_cache_bytes"]["dlite"] == {"64": 0, "512": 0}
    assert rep["draft_cache_bytes"]["dspark"]["512"] > rep["draft_cache_bytes"]["dspark"]["64"]
    counts = rep["param_counts"]
    assert 0.4e9 < counts["dlite_qwen3_4b"]["trainable_params"] < 0.8e9
    assert rep["config"]["run"]["drafter"]["gamma"] == 7


def test_unknown_benchmark_is_refused(repo_root):
    r = subprocess.run([sys.executable, "-m", "jobs.benchmark", "nope"], cwd=repo_root,
                       capture_output=True, text=True)
    assert r.returncode == 2 and "usage" in r.stderr
