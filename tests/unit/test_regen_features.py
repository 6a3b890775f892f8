"""Collection's states kept by the regenerator (`dlite.data.regen_features`, data.regen_features)
on the tiny target in fp32: the answers are the same tokens as without keeping them, and
every row it hands back is the row collection makes of the finished record (same tokens,
mask, anchors, fork layout) with the stored arrays collection's own forward gives, up to
float noise -- for forked rows (recorded history) and plain ones (generated history),
with the shared prompt prefix and lookup drafts on, and for a conversation split into
windows."""

import numpy as np
import pytest

from dlite import tiny
from dlite.corpus import trajectories as corpus
from dlite.data import formats
from dlite.data.features import TargetFeatures, extract
from dlite.data.regen_features import RowStates, StateCapture
from dlite.data.render import training_rows
from dlite.decoding.regenerate import BatchedRegenerator

NEW, LAYERS, SEED = 24, [0, 1], 3
SPEC = {"storage_mode": "full", "reference": "last_hidden", "topk": None, "gamma": None}


@pytest.fixture(scope="module")
def target():
    return tiny.load_target(), tiny.load_tokenizer()


@pytest.fixture(scope="module")
def records():
    """4 conversations of ~1-4K tokens, each cut after its 2nd-4th assistant turn."""
    raw = list(corpus.generate("train", 2, 1, 3000, 5000)) + list(corpus.generate("heldout", 2, 2, 9000, 16000))
    out = []
    for i, r in enumerate(raw):
        r = formats.normalise(formats.to_canonical(r, f"c:{i}"))
        turns, msgs = 0, []
        for m in r["messages"]:
            turns += m["role"] == "assistant"
            if turns > 2 + i % 3:
                break
            msgs.append(m)
        out.append({**r, "index": i, "where": f"c:{i}", "messages": msgs})
    return out


def _rows(tok, max_len=8192, policy="truncate"):
    return lambda rec: training_rows(tok, rec, max_len, policy, 8, SEED, True)


def _regenerate(model, tok, records, history, capture=None, lookup=0):
    regen = BatchedRegenerator(model, tok, NEW, batch_size=3, history=history, lookup=lookup, capture=capture)
    done, bad = regen.regenerate_many(records)
    assert bad == []
    return done, regen.stats


def _check_rows(model, tok, done, rows_of):
    """Every kept row is collection's row, with collection's arrays (fp16) up to float noise."""
    tf, n = TargetFeatures(model, LAYERS), 0
    for d in done:
        mine = rows_of({k: v for k, v in d.items() if k != "features"})
        assert len(d["features"]) == len(mine) > 0
        ref, _ = extract(tf, mine, SPEC, 0, 0)
        for got, want, arrays in zip(d["features"], mine, ref):
            for k in ("input_ids", "loss_mask", "anchors", "position_ids", "branch_ids"):
                assert np.array_equal(np.asarray(got.get(k, [])), np.asarray(want.get(k, []))), k
            for k in ("features", "ref_hidden"):
                assert got[k].shape == arrays[k].shape and got[k].dtype == np.float16
                np.testing.assert_allclose(got[k].astype(np.float32), arrays[k].astype(np.float32),
                                           rtol=2e-3, atol=2e-3)
            n += 1
    return n


@pytest.mark.parametrize("history,lookup", [("recorded", 0), ("recorded", 3), ("generated", 0)])
def test_kept_states_are_collections_and_the_answers_do_not_change(target, records, history, lookup):
    model, tok = target
    plain, _ = _regenerate(model, tok, records, history, lookup=lookup)
    capture = StateCapture(model, LAYERS, SPEC, _rows(tok))
    kept, stats = _regenerate(model, tok, records, history, capture, lookup)
    assert [d["tokens"] for d in kept] == [d["tokens"] for d in plain]
    assert [d["messages"] for d in kept] == [d["messages"] for d in plain]
    n = _check_rows(model, tok, kept, _rows(tok))
    assert stats["feature_rows"] == n and stats["feature_s"] > 0
    tokens = sum(len(r["input_ids"]) for d in kept for r in d["features"])
    assert stats["feature_tokens_kept"] + stats["feature_tokens_run"] == tokens
    if history == "recorded":  # forked rows: a trunk and one branch per answer
        assert all(np.asarray(r["branch_ids"]).max() >= 1 for d in kept for r in d["features"])
        # what is run again: the answers (the branches) and the last recorded turn
        answers = sum(len(t) for d in kept for t in d["tokens"])
        assert stats["feature_tokens_kept"] > 0.7 * tokens and stats["feature_tokens_run"] < 3 * answers


def test_a_conversation_split_into_windows(target, records):
    """Later windows start over (their trunk's first tokens are the system prompt): the
    kept states serve as far as the tokens agree, the rest is run."""
    model, tok = target
    rows_of = _rows(tok, 2500, "split")
    kept, _ = _regenerate(model, tok, records[2:], "recorded", StateCapture(model, LAYERS, SPEC, rows_of))
    assert max(len(d["features"]) for d in kept) > 1  # some conversation made several parts
    _check_rows(model, tok, kept, rows_of)


def test_row_states_keep_what_they_were_given():
    import torch
    s = RowStates()
    s.put(0, torch.ones(4, 2), torch.ones(4, 1))
    head = s.head(3)
    s.put(2, torch.zeros(3, 2), torch.zeros(3, 1))
    assert s.n == 5 and s.feats[:2].eq(1).all() and s.feats[2:].eq(0).all()
    assert head.n == 3 and head.feats.eq(1).all()  # a head is not changed by later puts
    with pytest.raises(ValueError, match="only 5"):
        s.put(6, torch.zeros(1, 2), torch.zeros(1, 1))
