"""Feature shards and the target forward behind them, without Ray: rows round-trip with
their shapes, shards are written atomically with checksums, readers refuse another
target / schema version / column set, and the captured features equal HF's hidden
states (hooks only, no `output_hidden_states`), in full and anchors mode, padded or not."""

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from dlite.data import features, shards
from dlite.data.shards import ShardError, Store

FP = {"id": "w123-t456"}


def _manifest(mode="full", reference="last_hidden", files=()):
    return {"schema_version": shards.SCHEMA_VERSION, "target_fingerprint": FP,
            "storage_mode": mode, "reference": reference, "gamma": 3, "topk": 4,
            "feature_dim": 6, "hidden_size": 2, "files": list(files)}


def _record(i, mode, reference, n=10, a=(2, 5)):
    rows = n if mode == "full" else len(a)
    blk = (rows,) if mode == "full" else (rows, 3)
    rec = {"id": f"r{i}", "part": 0, "index": i, "input_ids": np.arange(n), "loss_mask": np.ones(n),
           "anchors": np.array(a), "features": np.random.rand(rows, 6).astype(np.float16)}
    if reference == "last_hidden":
        rec["ref_hidden"] = np.random.rand(*blk, 2).astype(np.float16)
    else:
        rec["topk_ids"] = np.random.randint(0, 99, (*blk, 4)).astype(np.int32)
        rec["topk_logprobs"] = -np.random.rand(*blk, 4).astype(np.float16)
    return rec


@pytest.mark.parametrize("mode, reference", [("full", "last_hidden"), ("anchors", "topk"),
                                             ("anchors", "last_hidden"), ("full", "topk")])
def test_rows_round_trip(mode, reference):
    rec = _record(0, mode, reference)
    row = shards.encode_row(rec)
    table = pa.Table.from_pylist([row], schema=shards.shard_schema(reference))
    back = shards.decode_row(table.to_pylist()[0], _manifest(mode, reference))
    for k in ("features", "ref_hidden", "topk_ids", "topk_logprobs", "input_ids", "anchors"):
        if k in rec:
            assert back[k].shape == np.asarray(rec[k]).shape, k
            np.testing.assert_array_equal(back[k], np.asarray(rec[k]).astype(back[k].dtype))
    assert back["features"].dtype == np.float16 and back["features"].flags.writeable


def _finished(tmp_path, n_shards=2, reference="last_hidden"):
    store, sides = Store(str(tmp_path / "out")), []
    for s in range(n_shards):
        recs = [_record(2 * s + k, "full", reference) for k in range(2)]
        sides.append(shards.write_shard(store, s, recs, reference, {"plan": "p1", "quarantine": []}))
    files = [{"path": x["file"], "sha256": x["sha256"], "bytes": x["bytes"], "rows": x["rows"]}
             for x in sides]
    shards.write_manifest(store, _manifest("full", reference, files))
    return store, sides


def test_shard_written_atomically_and_found_again(tmp_path):
    store, sides = _finished(tmp_path)
    names = sorted(p.name for p in (tmp_path / "out" / "shards").iterdir())
    assert names == ["shard-00000.json", "shard-00000.parquet", "shard-00001.json",
                     "shard-00001.parquet"]
    assert sides[0]["sha256"] == store.sha256("shards/shard-00000.parquet") and sides[0]["rows"] == 2
    assert shards.finished_shard(store, 0, "p1")["sha256"] == sides[0]["sha256"]
    assert shards.finished_shard(store, 0, "other-plan") is None
    assert shards.finished_shard(store, 7, "p1") is None
    (tmp_path / "out" / "shards" / "shard-00001.parquet").write_bytes(b"torn")
    assert shards.finished_shard(store, 1, "p1") is None  # size no longer matches
    (tmp_path / "out" / "shards" / "shard-00002.parquet.tmp-abcd").write_bytes(b"x")
    assert store.remove_tmp("shards") == 1


def test_iter_records_and_refusals(tmp_path):
    _finished(tmp_path)
    out = str(tmp_path / "out")
    recs = list(shards.iter_records(out, expect_fingerprint=FP, verify=True))
    assert [r["id"] for r in recs] == ["r0", "r1", "r2", "r3"]
    assert recs[0]["features"].shape == (10, 6) and recs[0]["ref_hidden"].shape == (10, 2)
    with pytest.raises(ShardError, match="target"):
        shards.read_manifest(out, expect_fingerprint="another-target")
    m = json.loads((tmp_path / "out" / "manifest.json").read_text())
    (tmp_path / "out" / "manifest.json").write_text(json.dumps({**m, "schema_version": 99}))
    with pytest.raises(ShardError, match="schema version 99"):
        shards.read_manifest(out)
    (tmp_path / "out" / "manifest.json").write_text(json.dumps({**m, "reference": "topk"}))
    with pytest.raises(ShardError, match="do not match"):
        list(shards.iter_records(out))
    (tmp_path / "out" / "manifest.json").write_text(json.dumps(m))
    pq.write_table(pq.read_table(tmp_path / "out" / m["files"][1]["path"]).slice(0, 1),
                   tmp_path / "out" / m["files"][1]["path"])
    with pytest.raises(ShardError, match="checksum"):
        list(shards.iter_records(out, verify=True))
    with pytest.raises(ShardError, match="unfinished"):
        shards.read_manifest(str(tmp_path / "nowhere"))


def test_claim_refuses_another_plan(tmp_path):
    store = Store(str(tmp_path))
    shards.claim(store, {"target": "a", "storage_mode": "full"})
    shards.claim(store, {"target": "a", "storage_mode": "full"})  # same plan: resume
    with pytest.raises(ShardError, match="storage_mode"):
        shards.claim(store, {"target": "a", "storage_mode": "anchors"})


# ---------------------------------------------------------------- the target forward

@pytest.fixture(scope="module")
def target():
    torch.manual_seed(0)
    return Qwen3ForCausalLM(Qwen3Config(
        vocab_size=97, hidden_size=32, num_hidden_layers=3, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, intermediate_size=64)).eval()


def test_hooks_equal_hidden_states_without_asking_for_them(target, monkeypatch):
    ids = torch.randint(0, 97, (1, 12))
    with torch.no_grad():
        ref = target(ids, output_hidden_states=True)
    seen = []
    inner = target.model.forward
    monkeypatch.setattr(target.model, "forward", lambda *a, **k: seen.append(k) or inner(*a, **k))
    tf = features.TargetFeatures(target, [0, 2])
    feats, final = tf(ids, torch.ones_like(ids))
    assert not any(k.get("output_hidden_states") for k in seen)
    torch.testing.assert_close(feats[..., :32], ref.hidden_states[1])
    # HF's last hidden_states entry is post-norm; the hook sees the raw layer output.
    torch.testing.assert_close(target.model.norm(feats[..., 32:]), ref.hidden_states[3])
    torch.testing.assert_close(final, ref.hidden_states[-1])  # post-norm
    tk_ids, tk_lp = tf.topk(final[0], 5, chunk=4)
    want = torch.log_softmax(ref.logits[0].float(), -1).topk(5, -1)
    torch.testing.assert_close(tk_lp, want.values)
    assert torch.equal(tk_ids.long(), want.indices)
    with pytest.raises(ValueError, match="target_layer_ids"):
        features.TargetFeatures(target, [3])


def test_extract_full_and_anchor_rows_agree_padded_or_not(target):
    torch.manual_seed(1)
    seqs = [{"input_ids": torch.randint(0, 97, (n,)).tolist(), "anchors": np.array([1, 4, n - 2])}
            for n in (9, 16, 12)]
    tf = features.TargetFeatures(target, [1])
    spec = {"storage_mode": "full", "reference": "last_hidden", "topk": 4, "gamma": 3}
    full, _ = features.extract(tf, seqs, spec, token_budget=64, pad_id=0)
    # On CPU every sequence runs alone whatever the budget (a padding mask costs more than
    # batching saves there); a GPU batches under it. Both give the same rows.
    assert features.forward_budget(64, "cpu") == 0 and features.forward_budget(64, "cuda") == 64
    padded, _ = tf(*features.pad_group(seqs, [0, 1, 2], 0))
    for r, (a, s) in enumerate(zip(full, seqs)):
        assert a["features"].shape == (len(s["input_ids"]), 32)
        np.testing.assert_allclose(a["features"], padded[r, :len(s["input_ids"])].numpy(), atol=2e-3)
    anc, _ = features.extract(tf, seqs, {**spec, "storage_mode": "anchors", "reference": "topk"}, 64, 0)
    for a, f, s in zip(anc, full, seqs):
        n, pos = len(s["input_ids"]), s["anchors"]
        np.testing.assert_array_equal(a["features"], f["features"][pos - 1])
        assert a["topk_ids"].shape == (3, 3, 4) and a["topk_logprobs"].dtype == np.float16
        assert (a["topk_logprobs"][..., 0] >= a["topk_logprobs"][..., 1]).all()
        assert n - 1 in (pos[:, None] + np.arange(3)).clip(max=n - 1)


def test_length_buckets_bound_padding():
    groups = features.length_buckets([5, 100, 7, 98, 6], token_budget=200)
    assert groups == [[0, 4, 2], [3, 1]]
    assert sorted(i for g in groups for i in g) == list(range(5))


def test_write_features_streams_buckets_and_drops_overflow(target):
    class Rows(list):
        write = list.extend
    with torch.no_grad():
        emb = target.model.embed_tokens.weight
        saved = emb[5].clone()
        emb[5] = 1e6  # token 5 drives the residual stream past float16's range
    try:
        seq = lambda i, part, ids: {"index": i, "id": f"r{i}", "part": part, "input_ids": ids,
                                    "loss_mask": [1] * len(ids), "anchors": np.array([1, 2])}
        seqs = [seq(0, 0, [1, 2, 3, 4]), seq(1, 0, [5, 2, 3, 4]), seq(2, 0, [5, 1, 1]),
                seq(2, 1, [2, 2, 2, 2, 2, 2])]
        spec = {"storage_mode": "anchors", "reference": "last_hidden", "topk": 4, "gamma": 2}
        rows = Rows()
        stats, written, lost = features.write_features(features.TargetFeatures(target, [0]),
                                                       seqs, spec, rows, 8, 0)
    finally:
        with torch.no_grad():
            emb[5] = saved
    assert sorted((r["id"], r["part"]) for r in rows) == [("r0", 0), ("r2", 1)]
    assert written == {(0, "r0"), (2, "r2")} and [s["id"] for s in lost] == ["r1"]
    assert stats["sequences"] == 2 and stats["tokens"] == 10 and stats["anchors"] == 4
    assert rows[0]["features"].shape == (2, 32) and rows[0]["ref_hidden"].shape == (2, 2, 32)
