"""Forked rows (`data.regen_rows: forked`), the data side: a recorded-history regeneration
becomes the recorded conversation as an unsupervised trunk plus one branch per assistant
turn holding the target's answer, whose context is exactly the prompt the answer was
generated from; the target's states of a branch element, from the two-forward
`TargetFeatures.forked`, equal a plain prefill of that context; forked rows round-trip
through shards beside plain ones; the config key and the stage hashes."""

import numpy as np
import pyarrow as pa
import pytest
import torch

from dlite import tiny
from dlite.config import ConfigError, load_config
from dlite.corpus import trajectories as corpus
from dlite.data import chat, features, formats, shards
from dlite.data.render import encode, forked_sequences, sequences
from dlite.decoding.regenerate import BatchedRegenerator

NEW = 12


@pytest.fixture(scope="module")
def target():
    return tiny.load_target(), tiny.load_tokenizer()


@pytest.fixture(scope="module")
def regenerated(target):
    """3 conversations of 2-4 assistant turns, the last one cut after a tool result (the
    regeneration adds a final answer), answered with the recorded history; + a prompt."""
    model, tok = target
    recs = []
    for i, r in enumerate(corpus.generate("train", 3, 1, 3000, 5000)):
        r = formats.normalise(formats.to_canonical(r, f"c:{i}"))
        msgs, seen = [], 0
        for m in r["messages"]:
            seen += m["role"] == "assistant"
            if seen > 2 + i % 3 or (i == 2 and seen == 2 and m["role"] == "assistant"):
                break
            msgs.append(m)
        recs.append({**r, "index": i, "messages": msgs})
    recs.append({"id": "ask", "index": 3, "tools": [],
                 "messages": [{"role": "user", "content": "What does os.path.join do?"}]})
    done, bad = BatchedRegenerator(model, tok, NEW, batch_size=2, history="recorded").regenerate_many(recs)
    assert bad == []
    return recs, done


def test_each_branch_follows_the_prompt_its_answer_was_generated_from(target, regenerated):
    _, tok = target
    recs, done = regenerated
    (ask,) = forked_sequences(tok, done[-1], 4096, "split", 64, 0)  # nothing to fork: a plain row
    assert "branch_ids" not in ask and ask["input_ids"] == encode(tok, done[-1]["messages"], [])[0]
    for rec, d in zip(recs[:-1], done[:-1]):
        assert d["recorded_messages"] == rec["messages"]
        (row,) = forked_sequences(tok, d, 4096, "split", 64, 0)
        ids, mask = np.array(row["input_ids"]), np.array(row["loss_mask"])
        pos, br = np.array(row["position_ids"]), np.array(row["branch_ids"])
        turns = [i for i, m in enumerate(rec["messages"]) if m["role"] == "assistant"]
        trunk = int((br == 0).sum())
        added = rec["messages"][-1]["role"] != "assistant"  # an answer after the last message
        assert br.max() == len(turns) and d["turns"] == len(turns) + added
        # the trunk: the recorded conversation (+ the added answer, supervised in place)
        want_ids, want_mask = encode(tok, rec["messages"] + [m for m in d["messages"][-1:] if added],
                                     rec["tools"])
        assert ids[:trunk].tolist() == want_ids
        assert mask[:trunk].any() == added and (mask[:trunk] <= np.array(want_mask)).all()
        for k, i in enumerate(turns, 1):
            el = np.flatnonzero(br == k)
            fork = pos[el[0]]
            assert (pos[el] == fork + np.arange(len(el))).all() and ids[el[0]] == ids[fork]
            assert mask[el[0]] == 0 and mask[el[1:]].all()
            prompt = tok(chat.render(tok, rec["messages"][:i], rec["tools"], True),
                         add_special_tokens=False)["input_ids"]
            assert ids[:fork + 1].tolist() == prompt  # what the target read before answering
            # the branch holds that answer: what it generated, as the template renders it
            assert tok.decode(ids[el[1:]]).startswith(tok.decode(d["tokens"][k - 1][:4]))
        assert set(row["anchors"].tolist()) <= set(np.flatnonzero(mask).tolist())
    # the regenerated conversation read whole is still there (data.regen_rows: conversation)
    plain = sequences(tok, done[0], 4096, "split", 64, 0)
    assert "branch_ids" not in plain[0]


def test_split_parts_fork_their_own_turns(target, regenerated):
    _, tok = target
    _, done = regenerated
    d = done[1]
    whole = forked_sequences(tok, d, 4096, "split", 64, 0)[0]
    size = int(0.9 * len(encode(tok, d["recorded_messages"], d["tools"])[0]))
    parts = forked_sequences(tok, d, size, "split", 64, 0)
    assert len(parts) >= 2 and all((np.array(p["branch_ids"]) == 0).sum() <= size for p in parts)
    n = [int(np.max(p["branch_ids"])) for p in parts]
    assert sum(n) == int(np.max(whole["branch_ids"]))
    # each answer lands in the part holding its turn, with the same tokens
    first = np.array(whole["branch_ids"]) == 1 + n[0]
    later = np.array(parts[1]["branch_ids"]) == 1
    assert np.array(whole["input_ids"])[first][1:].tolist() == np.array(parts[1]["input_ids"])[later][1:].tolist()
    # truncated: the conversation's last turns, each still with its own answer
    (cut,) = forked_sequences(tok, d, size, "truncate", 64, 0)
    last = [np.array(r["input_ids"])[np.array(r["branch_ids"]) == np.max(r["branch_ids"])][1:].tolist()
            for r in (whole, cut)]
    assert last[0] == last[1] and np.max(cut["branch_ids"]) < np.max(whole["branch_ids"])


def test_forked_states_equal_a_prefill_of_each_branch_context(target, regenerated):
    model, tok = target
    _, done = regenerated
    (row,) = forked_sequences(tok, done[0], 4096, "split", 64, 0)
    tf = features.TargetFeatures(model, [0, 1])
    f, h = tf.forked(row["input_ids"], row["position_ids"], row["branch_ids"])
    ids, pos, br = (np.array(row[k]) for k in ("input_ids", "position_ids", "branch_ids"))
    trunk = int((br == 0).sum())
    ref_f, ref_h = tf(torch.tensor(ids[:trunk])[None], torch.ones(1, trunk, dtype=torch.long))
    torch.testing.assert_close(f[:trunk], ref_f[0], atol=1e-4, rtol=1e-4)
    for k in range(1, br.max() + 1):
        el = np.flatnonzero(br == k)
        ctx = np.concatenate([ids[:pos[el[0]]], ids[el]])
        ref_f, ref_h = tf(torch.tensor(ctx)[None], torch.ones(1, len(ctx), dtype=torch.long))
        torch.testing.assert_close(f[el], ref_f[0, -len(el):], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(h[el], ref_h[0, -len(el):], atol=1e-4, rtol=1e-4)
    # extract: a forked row runs alone (its own two forwards) beside plain ones, any budget
    seqs = [{**row, "anchors": np.asarray(row["anchors"])},
            {"input_ids": ids[:50].tolist(), "anchors": np.array([3, 9])}]
    spec = {"storage_mode": "anchors", "reference": "last_hidden", "topk": 4, "gamma": 3}
    assert features.forward_groups(seqs, 1 << 20, "cuda") == [[1], [0]]
    out, _ = features.extract(tf, seqs, spec, 1 << 20, 0)
    a = np.asarray(row["anchors"])
    np.testing.assert_array_equal(out[0]["features"], f[a - 1].to(torch.float16).numpy())


def test_forked_and_plain_rows_share_a_shard(tmp_path):
    store = shards.Store(str(tmp_path))
    plain = {"id": "p", "part": 0, "index": 0, "input_ids": np.arange(6), "loss_mask": np.ones(6),
             "anchors": np.array([2]), "features": np.zeros((6, 4), np.float16),
             "ref_hidden": np.zeros((6, 2), np.float16)}
    forked = {**plain, "id": "f", "index": 1, "position_ids": [0, 1, 2, 3, 4, 5, 2, 3],
              "branch_ids": [0, 0, 0, 0, 0, 0, 1, 1], "input_ids": np.arange(8), "loss_mask": np.ones(8),
              "features": np.zeros((8, 4), np.float16), "ref_hidden": np.zeros((8, 2), np.float16)}
    side = shards.write_shard(store, 0, [plain, forked], "last_hidden", {"plan": "p", "quarantine": []})
    m = {"schema_version": shards.SCHEMA_VERSION, "target_fingerprint": {"id": "x"}, "storage_mode": "full",
         "reference": "last_hidden", "gamma": 3, "topk": None, "feature_dim": 4, "hidden_size": 2,
         "files": [{"path": side["file"], "sha256": side["sha256"], "bytes": side["bytes"], "rows": 2}]}
    shards.write_manifest(store, m)
    back = {r["id"]: r for r in shards.iter_records(str(tmp_path))}
    assert "branch_ids" not in back["p"] and "position_ids" not in back["p"]
    assert back["f"]["branch_ids"].tolist() == forked["branch_ids"]
    assert back["f"]["position_ids"].dtype == np.int32
    # a version-1 collection (no fork columns) is still read
    v1 = pa.Table.from_pylist([{k: v for k, v in shards.encode_row(plain).items()
                                if k not in shards.FORK_COLUMNS}], schema=shards.shard_schema("last_hidden", 1))
    (row,) = v1.to_pylist()
    assert "branch_ids" not in shards.decode_row(row, {**m, "schema_version": 1})


def test_the_key_is_checked_and_moves_collect_only():
    from pipelines.orchestration import dag
    with pytest.raises(ConfigError, match="data.regen_rows"):
        load_config("configs/experiments/tiny.yaml", ["data.regen_rows=trees"])
    base = ["data.regenerate=true", "data.regen_history=recorded"]
    forked = {s.name: s.hash for s in dag.plan(load_config("configs/experiments/tiny.yaml", base))}
    whole = {s.name: s.hash for s in dag.plan(load_config("configs/experiments/tiny.yaml",
                                                          base + ["data.regen_rows=conversation"]))}
    assert forked["regenerate"] == whole["regenerate"] and forked["collect"] != whole["collect"]
    # without regeneration the key at its default leaves every hash as it was
    plain = load_config("configs/experiments/tiny.yaml")
    assert "regen_rows" in plain.data
