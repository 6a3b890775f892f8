"""The agent-like corpus through the real stages on local Ray with a random-weight
target: `collect` reads its three scaffold layouts (counted per format, nothing
quarantined), and `regenerate` answers its turns plus `data.extra_prompts` (one user turn
each; a broken prompt line quarantined, read = written + quarantined); answered with the
recorded history, `collect` forks each session's turns off its recorded conversation."""

import json

from dlite.config import load_config
from pipelines.stages.collect import collect
from pipelines.stages.regenerate import regenerate


def _cfg(target, *over):
    return load_config("configs/experiments/tiny.yaml", [
        f"target.path={target}", "target.name=rand", "data.max_seq_len=2048", "data.anchors_per_seq=4",
        "cluster.num_workers=1", "data.corpus=agent", "data.n_train=3", "data.min_chars=3000",
        "data.max_chars=6000", *over])


def test_collect_reads_every_layout(ray_session, random_target, tmp_path):
    m = collect(_cfg(random_target), "builtin:train", str(tmp_path / "shards"))
    c = m["counts"]
    assert (c["read"], c["written"], c["quarantined"]) == (3, 3, 0)
    assert c["formats"] == {"mini-swe-agent": 1, "openhands": 1, "swe-agent": 1}
    assert c["supervised_tokens"] > 0


def test_regenerate_answers_sessions_and_extra_prompts(ray_session, random_target, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"turns": ["Fix the bug in parse()."]}) + "\n{broken\n")
    cfg = _cfg(random_target, "data.regenerate=true", f"data.extra_prompts={prompts}",
               "data.regen_max_new_tokens=4", "data.n_train=1")
    m = regenerate(cfg, "builtin:train", str(tmp_path / "regen"))
    c = m["counts"]
    assert (c["read"], c["written"], c["quarantined"]) == (3, 2, 1) and c["by_reason"] == {"bad_json": 1}
    rows = [json.loads(x) for f in sorted((tmp_path / "regen" / "conversations").glob("*.jsonl"))
            for x in f.read_text().splitlines()]
    prompt = next(r for r in rows if r["id"] == "prompt-1")
    assert [x["role"] for x in prompt["messages"]] == ["user", "assistant"] and prompt["turns"] == 1
    session = next(r for r in rows if r["id"].startswith("agent-train__") and r["id"].endswith("-000000"))
    assert session["turns"] == sum(x["role"] == "assistant" for x in session["messages"]) > 5


def test_recorded_history_sessions_are_collected_as_forked_rows(ray_session, random_target, tmp_path):
    import numpy as np
    from dlite.data import shards
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"turns": ["Fix the bug in parse()."]}) + "\n")
    cfg = _cfg(random_target, "data.regenerate=true", "data.regen_history=recorded", "data.n_train=1",
               f"data.extra_prompts={prompts}", "data.regen_max_new_tokens=4", "data.anchors_per_seq=64",
               "data.length_policy=split")  # every turn in some part
    regenerate(cfg, "builtin:train", str(tmp_path / "regen"))
    m = collect(cfg, str(tmp_path / "regen"), str(tmp_path / "shards"))
    assert (m["counts"]["read"], m["counts"]["written"]) == (2, 2)
    rows = list(shards.iter_records(str(tmp_path / "shards")))
    regen = [json.loads(x) for f in sorted((tmp_path / "regen" / "conversations").glob("*.jsonl"))
             for x in f.read_text().splitlines()]
    (rec,) = [r for r in regen if r["id"].startswith("agent-train__")]
    parts = [r for r in rows if r["id"] == rec["id"]]
    for part in parts:  # every supervised token (and anchor) in a branch; the trunk as recorded
        br, mask = part["branch_ids"], part["loss_mask"].astype(bool)
        trunk = int((br == 0).sum())
        assert br.max() >= 1 and not mask[:trunk].any() and (part["anchors"] >= trunk).all()
        assert part["features"].shape[0] == len(br) and np.isfinite(part["features"]).all()
    # one branch per recorded assistant turn, over the record's parts
    assert sum(int(p["branch_ids"].max()) for p in parts) == sum(
        m["role"] == "assistant" for m in rec["recorded_messages"]) > 5
    (prompt,) = [r for r in rows if r["id"] == "prompt-1"]
    assert "branch_ids" not in prompt and prompt["loss_mask"].any()
