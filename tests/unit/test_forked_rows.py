"""Forked training rows (a trunk, then branches that fork off it, `position_ids` /
`branch_ids`): the packed history mask sees a branch's fork and never another branch,
a block is cut where its branch ends, `collate` pads the new keys (and adds none for
old rows), and a forked row trains the teacher / DSpark exactly like the separate
unforked rows it stands for."""

import dataclasses

import numpy as np
import pytest
import torch

from dlite.losses import block_targets
from dlite.models import DrafterConfig, build_drafter
from dlite.models.history import packed_block_mask
from dlite.train.data import collate
from dlite.train.step import compute_loss

V, HT, K = 40, 24, 2
CFG = DrafterConfig(gamma=4, target_layer_ids=[0, 1], hidden_size=32, num_layers=2, num_heads=4,
                    num_kv_heads=2, head_dim=8, intermediate_size=64, head_hidden=32, markov_rank=8)
# trunk of 6 (positions 0..5); branch 1 forks at position 2 (indices 6..8, positions 2..4),
# branch 2 at position 4 (indices 9..10, positions 4..5)
POS = [0, 1, 2, 3, 4, 5, 2, 3, 4, 4, 5]
BRANCH = [0, 0, 0, 0, 0, 0, 1, 1, 1, 2, 2]


def _mask_batch(anchors, branched=True):
    b = {"input_ids": torch.zeros(1, len(POS), dtype=torch.long), "anchors": torch.tensor([anchors])}
    return {**b, "position_ids": torch.tensor([POS]), "branch_ids": torch.tensor([BRANCH])} if branched else b


@pytest.mark.parametrize("window,want", [
    (None, {3: [0, 1, 2], 5: [0, 1, 2, 3, 4], 7: [0, 1, 6], 8: [0, 1, 6, 7], 10: [0, 1, 2, 3, 9]}),
    (2, {3: [1, 2], 5: [3, 4], 7: [1, 6], 8: [6, 7], 10: [3, 9]}),  # window in positions
])
def test_forked_mask_sees_the_fork_and_its_own_branch(window, want):
    anchors, g = list(want), 2
    hist = packed_block_mask(_mask_batch(anchors), g, 1, window)[0, 0, :, :len(POS)]
    for i, a in enumerate(anchors):
        for q in range(i * g, (i + 1) * g):  # every query of the block alike
            assert hist[q].nonzero().flatten().tolist() == want[a], (a, q)


@pytest.mark.parametrize("window", [None, 3])
def test_one_branch_mask_is_the_plain_mask(window):
    """A row that is all trunk (branch 0, positions 0..L-1) is masked as a plain row."""
    b = {"input_ids": torch.zeros(1, 12, dtype=torch.long), "anchors": torch.tensor([[2, 7, 10]])}
    plain = packed_block_mask(b, 3, 1, window)
    forked = {**b, "position_ids": torch.arange(12)[None], "branch_ids": torch.zeros(1, 12, dtype=torch.long)}
    assert torch.equal(packed_block_mask(forked, 3, 1, window), plain)


def test_forked_block_is_cut_at_its_branch_end():
    """The block ends where it leaves its branch, even where branch 0 comes back (padding
    after the last branch, here with no loss_mask to drop it)."""
    ids = torch.arange(14)[None] + 100
    br = torch.tensor([BRANCH + [0, 0, 0]])
    _, valid = block_targets(ids, torch.tensor([[7, 2]]), 4, branch_ids=br)
    assert valid[0, 0].tolist() == [True, False, False, False]  # 8 in branch 1; 9 starts branch 2
    assert valid[0, 1].tolist() == [True, True, True, False]   # trunk 3..5; 6 starts branch 1
    _, valid = block_targets(ids, torch.tensor([[4]]), 8, branch_ids=br)
    assert valid[0, 0].tolist() == [True] + [False] * 7         # padding 11, 12 stays cut
    _, plain = block_targets(ids, torch.tensor([[4]]), 8)
    assert plain[0, 0].all()


def _row(n, seed, **extra):
    rng = np.random.default_rng(seed)
    return {"input_ids": rng.integers(0, V - 1, n), "loss_mask": np.ones(n, np.int8),
            "anchors": np.array([1, 2], np.int32), "features": rng.standard_normal((n, K * HT), np.float32),
            **extra}


def test_collate_pads_forked_keys_only_when_rows_have_them():
    plain = collate([_row(5, 0), _row(7, 1)])
    assert "position_ids" not in plain and "branch_ids" not in plain
    forked = _row(len(POS), 2, position_ids=np.array(POS, np.int32), branch_ids=np.array(BRANCH, np.int32))
    one = collate([forked])
    assert one["position_ids"].dtype == one["branch_ids"].dtype == torch.long
    assert one["position_ids"][0].tolist() == POS and one["branch_ids"][0].tolist() == BRANCH
    mixed = collate([_row(5, 0), forked, _row(13, 1)])
    assert mixed["position_ids"].tolist() == [list(range(13)), POS + [11, 12], list(range(13))]
    assert mixed["branch_ids"].tolist() == [[0] * 13, BRANCH + [0, 0], [0] * 13]


def _forked_and_plain_rows(seed=3):
    """A forked row (trunk of 8; branch 1 forks at position 3 with 4 new tokens, branch 2
    at position 5 with 3) and the three plain rows it stands for (the trunk; trunk
    prefix + each branch), with anchors that match one for one."""
    rng = np.random.default_rng(seed)
    n, forks = 8, [(3, 5), (5, 4)]                                  # (fork position, branch length)
    total = n + sum(m for _, m in forks)
    ids, feats = rng.integers(0, V - 1, total), rng.standard_normal((total, K * HT), np.float32)
    ref = rng.standard_normal((total, HT), np.float32)
    pos, br, mask = list(range(n)), [0] * n, [1] * n
    plain = [dict(idx=list(range(n)), anchors=[2, 5])]
    start = n
    for k, (p, m) in enumerate(forks, 1):
        pos += list(range(p, p + m))
        br += [k] * m
        mask += [0] + [1] * (m - 1)           # element 0 repeats the trunk's token at p
        plain.append(dict(idx=list(range(p)) + list(range(start, start + m)), anchors=[p + 1, p + 2]))
        start += m
    anchors = [2, 5, 9, 10, 14, 15]            # trunk; branch 1 elements 1, 2; branch 2 elements 1, 2
    forked = {"input_ids": ids, "features": feats, "ref_hidden": ref, "loss_mask": np.array(mask, np.int8),
              "anchors": np.array(anchors, np.int32), "position_ids": np.array(pos, np.int32),
              "branch_ids": np.array(br, np.int32)}
    rows = [{"input_ids": ids[r["idx"]], "features": feats[r["idx"]], "ref_hidden": ref[r["idx"]],
             "loss_mask": np.array(mask, np.int8)[r["idx"]], "anchors": np.array(r["anchors"], np.int32)}
            for r in plain]
    return forked, rows


@pytest.mark.parametrize("arch,window", [("teacher", None), ("teacher", 3), ("dspark", None)])
def test_forked_row_trains_like_its_plain_rows(arch, window):
    """Same logits on every valid slot and the same loss: the mask, the positions and the
    branch cut of a forked row are those of the separate rows. A longer plain row in both
    batches pads the forked one (mixed rows)."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(123)
    embed, lm_head = torch.randn(V, HT, generator=g), torch.randn(V, HT, generator=g)
    cfg = dataclasses.replace(CFG, arch=arch, history_window=window)
    model = build_drafter(cfg, embed, lm_head, V - 1).eval()
    forked, rows = _forked_and_plain_rows()
    extra = {**rows[0], "input_ids": np.arange(20) % (V - 1), "loss_mask": np.ones(20, np.int8),
             "features": np.ones((20, K * HT), np.float32), "ref_hidden": np.ones((20, HT), np.float32)}
    fb, pb = collate([forked, extra]), collate(rows + [extra])
    with torch.no_grad():
        lf, mf = compute_loss(model, fb)
        lp, mp = compute_loss(model, pb)
        zf, zp = model.forward_train(fb), model.forward_train(pb)
    _, vf = block_targets(fb["input_ids"], fb["anchors"], CFG.gamma, fb["loss_mask"], fb["anchor_mask"],
                          branch_ids=fb["branch_ids"])
    _, vp = block_targets(pb["input_ids"], pb["anchors"], CFG.gamma, pb["loss_mask"], pb["anchor_mask"])
    vf0, vp0 = vf[0], vp[:3, :2].reshape(6, -1)                  # forked blocks = plain blocks in order
    assert torch.equal(vf0, vp0) and vf0[:, 0].all() and not vf0.all()  # some block is cut
    torch.testing.assert_close(zf[0][vf0], zp[:3, :2].reshape(6, *zp.shape[2:])[vp0], rtol=1e-5, atol=1e-5)
    assert mf["valid_slots"] == mp["valid_slots"]
    assert lf.item() == pytest.approx(lp.item(), rel=1e-5)
