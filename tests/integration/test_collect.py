"""The collect stage on real local Ray with a real (random-weight) target checkpoint:
mixed good/bad input -> shards + quarantine with `read = written + quarantined`; a
SIGKILLed `python -m jobs.collect` resumes to exactly the uninterrupted result, whose
anchor-mode rows equal a direct target forward; systemic faults fail clearly; and the
shared SWE-bench prompts (prompt-only) are quarantined, or answered by the target when
regeneration is on."""

import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch

from dlite.config import load_config
from dlite.data import formats, shards
from dlite.data.formats import Quarantine
from dlite.data.shards import ShardError
from dlite.corpus import trajectories as corpus
from pipelines.stages.collect import CollectError, CollectSettings, collect, read_shards

SWE_PROMPTS = Path(__file__).resolve().parents[3] / "shared" / "data" / "swe-bench-prompts.jsonl"
FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "trajectories"
CHAT = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello there, friend."}]


def _cfg(target, *over):
    return load_config("configs/experiments/tiny.yaml", [
        f"target.path={target}", "target.name=rand", "data.max_seq_len=256",
        "data.anchors_per_seq=4", "cluster.num_workers=1", *over])


def _settings(cfg, **kw):
    return dataclasses.replace(CollectSettings.from_config(cfg), **kw)


def _lines(path: Path, items) -> None:
    path.write_bytes(b"".join(x if isinstance(x, bytes) else
                              json.dumps(x).encode() + b"\n" for x in items))


def _mixed_input(d: Path) -> dict:
    """12 records: 5 usable, 7 bad (one of each reason); returns the expected reasons."""
    d.mkdir()
    trajs = list(corpus.generate("heldout", 3, 0, 3000, 5000))
    _lines(d / "a.jsonl", [
        trajs[0], b"{broken json\n", {"id": "u", "messages": [{"role": "wizard", "content": "x"}]},
        trajs[1], {**trajs[0], "messages": CHAT},  # same id as trajs[0]: a duplicate
        {"id": "sg", "conversations": [{"from": "human", "value": "2+2?"},
                                       {"from": "gpt", "value": "It is four."}]},
        {"id": "t", "messages": [CHAT[0], {"role": "tool", "content": "out"}]},
        {"id": "img", "messages": [{"role": "user", "content": [{"type": "image_url"}]}, CHAT[1]]},
        {"id": "p", "turns": ["a prompt only"]}, b"\xff\xfe\n", trajs[2]])
    (d / "run.traj.json").write_text(json.dumps({"info": {"instance_id": "mini-1"}, "messages": CHAT}))
    return {"bad_json": 1, "unknown_role": 1, "duplicate_id": 1, "tool_without_call": 1,
            "non_text_content": 1, "no_assistant_turn": 1, "undecodable": 1}


def test_mixed_input_to_shards_with_quarantine(ray_session, random_target, tmp_path):
    reasons = _mixed_input(tmp_path / "in")
    cfg, out = _cfg(random_target), str(tmp_path / "out")
    m = collect(cfg, str(tmp_path / "in"), out, _settings(cfg, records_per_shard=4))
    c = m["counts"]
    assert (c["read"], c["written"], c["quarantined"]) == (12, 5, 7)
    assert c["read"] == c["written"] + c["quarantined"] and c["by_reason"] == reasons
    assert c["formats"] == {"deepspec": 1, "openai": 8, "sharegpt": 1, "unreadable": 2}
    q = [json.loads(x) for x in (tmp_path / "out" / "quarantine.jsonl").read_text().splitlines()]
    assert Counter(e["reason"] for e in q) == Counter(reasons)
    assert {e["where"] for e in q if e["reason"] == "bad_json"} == {"a.jsonl:2"}
    assert {e["id"] for e in q if e["reason"] == "duplicate_id"} == {"heldout-000000"}
    recs = list(shards.iter_records(out, expect_fingerprint=m["target_fingerprint"], verify=True))
    width = 64 * len(cfg.drafter.target_layer_ids)
    assert sorted(r["id"] for r in recs) == sorted(
        ["heldout-000000", "heldout-000001", "heldout-000002", "sg", "mini-1"])
    for r in recs:
        assert r["features"].shape == (r["n_tokens"], width) and r["n_tokens"] <= 256
        assert r["ref_hidden"].shape == (r["n_tokens"], 64) and r["loss_mask"].sum() > 0
        assert r["loss_mask"][r["anchors"]].all() and r["loss_mask"][r["anchors"] + 1].all()
    assert m["files"] and len(m["files"]) == 3 and m["length_policy"] == "truncate"
    assert read_shards(out, m["target_fingerprint"]).count() == c["sequences"]
    again = collect(cfg, str(tmp_path / "in"), out, _settings(cfg, records_per_shard=4))
    assert again["plan_id"] == m["plan_id"] and again["files"] == m["files"]  # finished: as is
    with pytest.raises(ShardError, match="storage_mode"):
        collect(_cfg(random_target, "data.storage_mode=anchors"), str(tmp_path / "in"), out,
                _settings(cfg, records_per_shard=4))


def test_every_on_disk_format_is_collected_and_supervised(ray_session, random_target, tmp_path):
    """tests/fixtures/trajectories (one file per format users have on disk, detected from
    content): every record written, counted by format, its assistant turns supervised."""
    from dlite.tiny import load_tokenizer
    cfg, out = _cfg(random_target, "data.max_seq_len=1024"), str(tmp_path / "fmt")
    m = collect(cfg, str(FIXTURES), out, _settings(cfg))
    c = m["counts"]
    assert (c["read"], c["written"], c["quarantined"]) == (12, 12, 0)
    assert c["formats"] == {"anthropic": 1, "mini-swe-agent": 2, "mini-swe-agent/responses": 1,
                            "openai": 2, "responses": 1, "sharegpt": 2, "swe-agent": 1, "openhands": 2}
    tok, rows = load_tokenizer(), list(shards.iter_records(out, verify=True))
    assert len({r["id"] for r in rows}) == 12
    for r in rows:
        said = tok.decode(r["input_ids"][r["loss_mask"].astype(bool)])
        assert said.endswith("<|im_end|>") and "<tool_response>" not in said, r["id"]
        if r["id"].startswith("fix-typo-") and r["id"] != "fix-typo-swe-agent":
            assert "cat hello.py" in said and "now prints 'hello world'" in said, r["id"]


def _assert_rows_match_target(out: str, cfg) -> None:
    """Anchor-mode rows = a direct forward of the target: feature row i at anchors[i]-1,
    top-k row (i, j) at anchors[i]+j (clipped to the sequence)."""
    from dlite import target
    from dlite.data.features import TargetFeatures
    tf = TargetFeatures(target.load(cfg.target)[0], cfg.drafter.target_layer_ids)
    r = next(shards.iter_records(out))
    a, g, k = r["anchors"], cfg.drafter.gamma, cfg.data.topk
    assert r["features"].shape == (len(a), 64 * len(cfg.drafter.target_layer_ids))
    assert r["topk_ids"].shape == (len(a), g, k)
    ids = torch.as_tensor(r["input_ids"], dtype=torch.long)[None]
    feats, final = tf(ids, torch.ones_like(ids))
    np.testing.assert_allclose(r["features"], feats[0, a - 1].numpy(), atol=2e-2, rtol=1e-2)
    pos = np.minimum(a[:, None] + np.arange(g), ids.shape[1] - 1)
    want_ids, want_lp = tf.topk(final[0, pos.reshape(-1)], k)
    assert (r["topk_ids"].reshape(-1, k)[:, 0] == want_ids[:, 0].numpy()).all()
    np.testing.assert_allclose(r["topk_logprobs"].reshape(-1, k), want_lp.numpy(), atol=1e-2)


def test_sigkilled_run_resumes_to_the_uninterrupted_result(ray_session, random_target, tmp_path,
                                                          repo_root):
    """`python -m jobs.collect` (anchors mode, top-k reference) killed after its first
    shard, rerun: same ids, counts and shard bytes as a run never interrupted."""
    src = tmp_path / "chats.jsonl"
    _lines(src, [{"id": f"c{i}", "messages": [{"role": "user", "content": f"Q{i}?"},
                                              {"role": "assistant", "content": f"A{i} is {7 * i}."}]}
                 for i in range(150)] + [b"not json\n"])
    over = [f"target.path={random_target}", "target.name=rand", "cluster.num_workers=1",
            "data.max_seq_len=64", "data.anchors_per_seq=4", "data.storage_mode=anchors",
            "data.reference=topk", "data.topk=5"]
    crashed = tmp_path / "crashed"
    # The job joins this session's Ray as a second driver: its death ends its actors.
    env = {**os.environ, "DLITE_COLLECT_CRASH_AFTER": "1",
           "RAY_ADDRESS": ray_session.get_runtime_context().gcs_address}
    p = subprocess.run([sys.executable, "-m", "jobs.collect", "--config", "configs/experiments/tiny.yaml", "--input", str(src), "--output",
                        str(crashed), *over], cwd=repo_root, env=env, capture_output=True,
                       text=True, timeout=300)
    assert p.returncode == -signal.SIGKILL, p.stderr[-2000:]
    done = sorted(x.name for x in (crashed / "shards").glob("*.json"))
    assert "shard-00000.json" in done and not (crashed / "manifest.json").exists()
    if len(done) == 3:  # the actor outran the kill: as if it had come one shard earlier
        for f in (crashed / "shards").glob("shard-00002.*"):
            f.unlink()
    (crashed / "shards" / "shard-00002.parquet.tmp-dead").write_bytes(b"half")  # torn write
    cfg = load_config("configs/experiments/tiny.yaml", over)
    resumed = collect(cfg, str(src), str(crashed))
    clean = collect(cfg, str(src), str(tmp_path / "clean"))
    assert resumed["counts"] == {**clean["counts"], "forward_s": resumed["counts"]["forward_s"]}
    assert resumed["counts"]["read"] == 151 and resumed["counts"]["written"] == 150
    assert [f["sha256"] for f in resumed["files"]] == [f["sha256"] for f in clean["files"]]
    ids = [r["id"] for r in shards.iter_records(str(crashed), verify=True)]
    assert len(ids) == len(set(ids)) == 150
    assert not list((crashed / "shards").glob("*.tmp-*"))
    _assert_rows_match_target(str(tmp_path / "clean"), cfg)


def test_systemic_faults_fail_clearly(random_target, tmp_path):
    src = tmp_path / "in.jsonl"
    _lines(src, [{"messages": CHAT}])
    broken = tmp_path / "broken"
    shutil.copytree(random_target, broken)
    (broken / "model.safetensors").write_bytes(b"garbage")
    with pytest.raises(CollectError, match="target.path: .* does not load"):
        collect(_cfg(broken), str(src), str(tmp_path / "out"))
    (broken / "tokenizer.json").unlink()
    with pytest.raises(CollectError, match="target.path"):
        collect(_cfg(broken), str(src), str(tmp_path / "out"))
    with pytest.raises(FileNotFoundError, match="--input"):
        collect(_cfg(random_target), str(tmp_path / "missing.jsonl"), str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()


def test_jobs_collect_dry_run(repo_root, tmp_path):
    p = subprocess.run([sys.executable, "-m", "jobs.collect", "--config", "configs/experiments/tiny.yaml", "--dry-run", "--input",
                        "builtin:heldout", "--output", str(tmp_path / "o")], cwd=repo_root,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and "builtin:heldout" in p.stdout and not (tmp_path / "o").exists()


@pytest.mark.skipif(not SWE_PROMPTS.exists(), reason=f"{SWE_PROMPTS} absent (no ../shared)")
def test_swe_bench_prompts_are_prompt_only(tmp_path):
    """All 300 real prompts (CRLF, code fences, unicode) read, adapt and validate; with no
    assistant turn each is `no_assistant_turn` -- unless regeneration will add one."""
    specs, _ = formats.plan_input(str(SWE_PROMPTS), per_shard=64)
    n, crlf, reasons = 0, 0, Counter()
    for spec in specs:
        for _, where, raw in formats.read_spec(spec):
            rec = formats.to_canonical(raw, where)
            n, crlf = n + 1, crlf + ("\r\n" in rec["messages"][0]["content"])
            assert formats.normalise(rec, require_assistant=False)["messages"][0]["role"] == "user"
            with pytest.raises(Quarantine) as e:
                formats.normalise(rec)
            reasons[e.value.reason] += 1
    assert n == 300 and crlf > 0 and reasons == {"no_assistant_turn": 300}


@pytest.mark.skipif(not SWE_PROMPTS.exists(), reason=f"{SWE_PROMPTS} absent (no ../shared)")
def test_swe_bench_prompts_through_the_stage(ray_session, random_target, tmp_path):
    """With regeneration on, 3 real prompts get an assistant turn (8 new tokens) from the
    target and become supervised sequences."""
    three = tmp_path / "three.jsonl"
    three.write_bytes(b"".join(SWE_PROMPTS.read_bytes().splitlines(keepends=True)[:3]))
    cfg = _cfg(random_target)
    st = _settings(cfg, regenerate=True, regen_max_new_tokens=8)
    m = collect(cfg, str(three), str(tmp_path / "regen"), st)
    assert m["regenerate"] and (m["counts"]["read"], m["counts"]["written"]) == (3, 3)
    for r in shards.iter_records(str(tmp_path / "regen")):
        # ~8 generated tokens (re-tokenised) + <|im_end|>, the last supervised token.
        assert 2 <= r["loss_mask"].sum() <= 40 and r["loss_mask"][-2] == 1
