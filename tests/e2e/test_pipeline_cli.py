"""The README's main job as a user runs it: `python -m jobs.pipeline` in a fresh
process — dry run, a real run on the embedded default, and a bad key failing fast."""

import json
import subprocess
import sys


def _run(repo, tmp_path, *args):
    return subprocess.run([sys.executable, "-m", "jobs.pipeline", *args], cwd=repo,
                          capture_output=True, text=True, timeout=600)


def test_dry_run_prints_plan_and_config(repo_root, tmp_path):
    r = _run(repo_root, tmp_path, "--dry-run", f"run.output_dir={tmp_path}")
    assert r.returncode == 0, r.stderr
    assert "prepare   run" in r.stdout and "drafter:" in r.stdout
    assert not any(tmp_path.iterdir()), "a dry run must not write anything"


def test_bad_key_fails_before_work(repo_root, tmp_path):
    r = _run(repo_root, tmp_path, "drafter.gamma=1", f"run.output_dir={tmp_path}")
    assert r.returncode == 2 and "drafter.gamma" in r.stderr
    r = _run(repo_root, tmp_path, "train.nope=3")
    assert r.returncode == 2 and "train.nope" in r.stderr


def test_pipeline_runs_on_embedded_default(repo_root, tmp_path):
    r = _run(repo_root, tmp_path, f"run.output_dir={tmp_path}", "data.n_train=4", "data.n_heldout=2")
    assert r.returncode == 0, r.stderr[-3000:]
    (summary_path,) = tmp_path.glob("*/summary.json")
    prep = json.loads(summary_path.read_text())["prepare"]
    assert len(prep["target_fingerprint"]["id"]) == 33
    lines = (summary_path.parent / "train.jsonl").read_text().splitlines()
    assert len(lines) == 4 and json.loads(lines[0])["messages"][0]["role"] == "system"
    assert prep["prompt_tokens"] > 500 and prep["sample"]
