"""Held-out data through the format layer (issue 32): a directory of agent runs in mixed
formats works as `data.heldout_path`, malformed and unusable records are quarantined
with a reason and counted (`read = used + quarantined`), prompt records stay prompts,
and every usable record is one the replay can turn into tasks."""

import json
import shutil
from pathlib import Path

import pytest

from dlite.config import load_config
from dlite.data.heldout import read_heldout
from dlite.decoding.replay import iter_tasks
from dlite.tiny import load_tokenizer

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "trajectories"


@pytest.fixture()
def runs_dir(tmp_path) -> Path:
    """Real agent-run files (.traj, .traj.json, Anthropic, Responses, ShareGPT) plus a
    broken file, a user-only conversation and a repeated id."""
    d = tmp_path / "runs"
    d.mkdir()
    for f in ("swe_agent.traj", "mini_swe_agent_toolcall.traj.json", "mini_swe_agent_bare.traj.json",
              "anthropic_messages.json", "responses_api.json"):
        shutil.copy(FIXTURES / f, d / f)
    (d / "zz_broken.traj.json").write_text('{"messages": [ {"role": "user", ')
    (d / "zz_user_only.json").write_text(json.dumps({"id": "u1", "messages": [{"role": "user", "content": "hi"}]}))
    (d / "zz_prompts.jsonl").write_text("\n".join(json.dumps(r) for r in (
        {"id": "p1", "turns": ["Fix the failing test in utils.py"]},
        {"id": "p2", "turns": ["fine", ""]},
        {"id": "p1", "turns": ["the same id again"]})) + "\n")
    return d


def test_a_directory_of_agent_runs_reads_with_counts(runs_dir):
    records, counts, bad = read_heldout(str(runs_dir), limit=100)
    assert counts["read"] == counts["used"] + counts["quarantined"] == 10
    assert counts["used"] == len(records) == 6 and counts["quarantined"] == len(bad) == 4
    assert counts["reasons"] == {"bad_json": 1, "no_assistant_turn": 1, "bad_turns": 1, "duplicate_id": 1}
    assert all(b["where"] and b["detail"] for b in bad)
    trajectories = [r for r in records if "messages" in r]
    assert len(trajectories) == 5 and all(any(m["role"] == "assistant" for m in r["messages"]) for r in trajectories)
    (prompt,) = [r for r in records if "turns" in r]
    assert prompt == {"id": "p1", "turns": ["Fix the failing test in utils.py"]}
    tok = load_tokenizer()
    for r in records:  # the replay takes every one of them
        tasks = list(iter_tasks(tok, r, max_turns=2))
        assert tasks and all(t["prompt_ids"] for t in tasks)


def test_reading_stops_at_the_limit(runs_dir):
    records, counts, _ = read_heldout(str(runs_dir), limit=2)
    assert len(records) == counts["used"] == 2 and counts["read"] == counts["used"] + counts["quarantined"]


def test_the_evaluation_reads_heldout_through_the_format_layer(runs_dir):
    from pipelines.stages.evaluate import heldout_set
    cfg = load_config("configs/experiments/tiny.yaml", [f"data.heldout_path={runs_dir}", "eval.n_trajectories=3"])
    records, held = heldout_set(cfg)
    assert len(records) == held["used"] == 3 and held["path"] == str(runs_dir)
    assert held["read"] == held["used"] + held["quarantined"]
    (runs_dir / "only.jsonl").write_text("not json\n")
    empty = load_config("configs/experiments/tiny.yaml", [f"data.heldout_path={runs_dir / 'only.jsonl'}"])
    with pytest.raises(ValueError, match=r"data.heldout_path .*only.jsonl: no usable record .*bad_json"):
        heldout_set(empty)
