"""The `regenerate` stage on real local Ray with the tiny built-in target: a mixed input
(usable trajectories, a prompt-only record, broken JSON, a history beyond the target's
positions) becomes JSONL shards of the target's own conversations + a manifest with
read = written + quarantined; a rerun is skipped, a crashed run resumes writing only the
missing shard, and `collect` reads the regenerated shards."""

import json
import os

import pytest

from dlite import tiny
from dlite.config import load_config
from dlite.corpus import trajectories as corpus
from dlite.data import formats, shards
from dlite.decoding.regenerate import BatchedRegenerator
from pipelines.stages.collect import collect
from pipelines.stages.regenerate import regenerate


def _two_turns(rec: dict) -> dict:
    """The trajectory up to (not including) its third assistant turn."""
    out, seen = [], 0
    for m in rec["messages"]:
        seen += m["role"] == "assistant"
        if seen == 3:
            break
        out.append(m)
    return {**rec, "messages": out}


@pytest.fixture(scope="module")
def mixed(tmp_path_factory):
    """6 records in 2 shards of 3: 4 usable (one prompt-only), 2 quarantined."""
    path = tmp_path_factory.mktemp("regen_in") / "in.jsonl"
    trajs = [_two_turns(t) for t in corpus.generate("train", 3, 0, 3000, 6000)]
    huge = {"id": "huge", "messages": [{"role": "user", "content": "read this " * 40000}]}
    prompt = {"id": "ask", "messages": [{"role": "user", "content": "What does os.path.join do?"}]}
    lines = [json.dumps(trajs[0]), "{broken json", json.dumps(prompt), json.dumps(trajs[1]),
             json.dumps(huge), json.dumps(trajs[2])]
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture(scope="module")
def cfg():
    return load_config("configs/experiments/tiny.yaml", [
        "data.regen_max_new_tokens=8", "data.regen_batch_size=3", "data.records_per_shard=3",
        "data.regen_lookup=3",  # verified lookup drafts in the actors: the same answers as without
        "cluster.num_workers=1", "data.max_seq_len=1024", "data.anchors_per_seq=4"])


@pytest.fixture(scope="module")
def regenerated(ray_session, mixed, cfg, tmp_path_factory):
    out = tmp_path_factory.mktemp("regen_out") / "regen"
    return out, regenerate(cfg, str(mixed), str(out))


def test_stage_writes_manifest_quarantine_and_resumes(regenerated, mixed, cfg):
    out, m = regenerated
    c = m["counts"]
    assert (c["read"], c["written"], c["quarantined"]) == (6, 4, 2) == (6, c["rows"], 2)
    assert c["by_reason"] == {"bad_json": 1, "too_long": 1}
    assert m["kind"] == "regenerated" and m["target_fingerprint"]["name"] == "tiny"
    assert m["sampling"] == {"max_new_tokens": 8, "temperature": 0.0, "top_p": None, "samples": 1, "seed": 0}
    # Each trajectory: its 2 turns replaced + 1 after the tool results it ends with; 1 for the prompt.
    assert c["turns"] == 3 * 3 + 1 and 0 < c["tokens_generated"] <= 10 * 8
    assert m["prefill_tokens_per_s"] > 0 and m["decode_tokens_per_s"] > 0
    assert m["lookup"]["draft_tokens"] == 3 and c["accepted"] <= c["drafted"]
    q = [json.loads(x) for x in (out / "quarantine.jsonl").read_text().splitlines()]
    assert {(e["where"], e["reason"]) for e in q} == {("in.jsonl:2", "bad_json"), ("in.jsonl:5", "too_long")}
    rows = [json.loads(x) for f in m["files"] for x in (out / f["path"]).read_text().splitlines()]
    assert [r["id"] for r in rows] == ["train-000000", "ask", "train-000001", "train-000002"]
    # The stage's answers are the library's (same target, same greedy decoding, no lookup).
    model, tok = tiny.load_target(), tiny.load_tokenizer()
    rec = formats.normalise(formats.to_canonical(json.loads(mixed.read_text().splitlines()[3]), "x"))
    (direct,), _ = BatchedRegenerator(model, tok, 8).regenerate_many([rec])
    assert rows[2]["messages"] == direct["messages"]

    again = regenerate(cfg, str(mixed), str(out))  # finished: skipped, manifest as it was
    assert again == m
    os.remove(out / shards.MANIFEST)  # a crash after shard 1, before the manifest
    os.remove(out / "shards" / "shard-00001.json")
    first = (out / "conversations" / "shard-00000.jsonl").stat().st_mtime_ns
    resumed = regenerate(cfg, str(mixed), str(out))
    # What was written is the same; prefill counts and timings depend on what the actor
    # had prefilled before (a shared prompt prefix is kept from shard to shard).
    content = lambda c: {k: c[k] for k in ("read", "written", "quarantined", "rows", "turns",  # noqa: E731
                                           "tokens_generated", "by_reason")}
    assert content(resumed["counts"]) == content(c) and resumed["files"] == m["files"]
    assert (out / "conversations" / "shard-00000.jsonl").stat().st_mtime_ns == first


def test_collect_reads_the_regenerated_shards(regenerated, cfg, tmp_path):
    regen, _ = regenerated
    m = collect(cfg, str(regen), str(tmp_path / "shards"))
    assert (m["counts"]["read"], m["counts"]["written"]) == (4, 4)
    assert m["regenerated"]["counts"]["quarantined"] == 2
    ids = {r["id"] for r in shards.iter_records(str(tmp_path / "shards"))}
    assert ids == {"train-000000", "ask", "train-000001", "train-000002"}


# The stage at the fixture's sizes, reading the recorded history, keeping collection's states.
KEPT = ["data.regen_max_new_tokens=8", "data.regen_batch_size=3", "data.records_per_shard=3",
        "cluster.num_workers=1", "data.max_seq_len=1024", "data.anchors_per_seq=4",
        "data.regen_history=recorded", "data.regen_features=true"]


def test_collect_takes_the_states_the_regeneration_kept(ray_session, mixed, tmp_path):
    """`data.regen_features`: the actors keep collection's states while they regenerate (the
    recorded history: forked rows), and `collect` writes those rows from them -- every
    row, each equal to the target forward's arrays on it up to float noise; a collection
    with other layers runs the target itself."""
    import numpy as np
    from dlite.data.features import TargetFeatures, extract
    from pipelines.stages.regenerate import feature_spec
    kept_cfg = load_config("configs/experiments/tiny.yaml", KEPT)
    regen = regenerate(kept_cfg, str(mixed), str(tmp_path / "regen"))
    assert regen["features"] == feature_spec(kept_cfg) and regen["counts"]["feature_rows"] > 0
    assert regen["counts"]["feature_tokens_kept"] > regen["counts"]["feature_tokens_run"] > 0
    assert sorted(p.name for p in (tmp_path / "regen" / "features" / "shards").glob("*.parquet")) == \
        ["shard-00000.parquet", "shard-00001.parquet"]

    m = collect(kept_cfg, str(tmp_path / "regen"), str(tmp_path / "kept"))
    c = m["counts"]
    assert (c["read"], c["written"]) == (4, 4) and c["precomputed_sequences"] == c["sequences"] > 0
    tf = TargetFeatures(tiny.load_target(), list(kept_cfg.drafter.target_layer_ids))
    spec = {"storage_mode": "full", "reference": "last_hidden", "topk": None, "gamma": None}
    rows = list(shards.iter_records(str(tmp_path / "kept")))
    assert any(r.get("branch_ids") is not None for r in rows)  # forked rows among them
    for row in rows:
        (want,), _ = extract(tf, [row], spec, 0, 0)
        for k in ("features", "ref_hidden"):
            np.testing.assert_allclose(row[k].astype(np.float32), want[k].astype(np.float32), rtol=2e-3, atol=2e-3)

    other = load_config("configs/experiments/tiny.yaml", [*KEPT, "drafter.target_layer_ids=[0]"])
    m2 = collect(other, str(tmp_path / "regen"), str(tmp_path / "other_layers"))
    assert m2["counts"]["precomputed_sequences"] == 0 and m2["counts"]["sequences"] == c["sequences"]
    # A shard whose sidecar names other settings (a resumed regeneration's first run) is not read.
    side = tmp_path / "regen" / "features" / "shards" / "shard-00000.json"
    info = json.loads(side.read_text())
    side.write_text(json.dumps({**info, "settings": {**info["settings"], "layer_ids": [0]}}))
    m3 = collect(kept_cfg, str(tmp_path / "regen"), str(tmp_path / "one_shard"))
    assert 0 < m3["counts"]["precomputed_sequences"] < m3["counts"]["sequences"] == c["sequences"]
