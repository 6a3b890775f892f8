"""Unit tests for dlite.losses: the weighted CE + L1 loss and its per-slot metrics
against a hand computation and a closed-form two-token example, masking of invalid
slots, the acceptance estimate, both reference-signal kinds and the per-anchor
gathering of targets / reference rows."""

import math

import pytest
import torch

from dlite.losses import (block_targets, dlite_loss, gather_block_rows, position_weights,
                          ref_probs_from_hidden, ref_probs_from_topk)



def rand_case(N=3, g=4, V=11, seed=0):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(N, g, V, generator=gen, requires_grad=True)
    p_ref = torch.softmax(torch.randn(N, g, V, generator=gen), -1)
    targets = torch.randint(0, V, (N, g), generator=gen)
    return logits, targets, p_ref


def test_position_weights():
    w = position_weights(7)
    assert w[0] == 1.0 and math.isclose(w[4].item(), math.exp(-1.0), rel_tol=1e-6)
    assert torch.all(w[1:] < w[:-1])


def test_loss_matches_hand_computation_and_has_gradients():
    logits, targets, p_ref = rand_case()
    valid = torch.ones_like(targets, dtype=torch.bool)
    loss, metrics = dlite_loss(logits, targets, valid, p_ref)
    want, wsum = 0.0, 0.0
    for n in range(3):
        for k in range(4):
            lp = torch.log_softmax(logits[n, k], -1)
            term = 0.1 * -lp[targets[n, k]] + 0.9 * (lp.exp() - p_ref[n, k]).abs().sum()
            w = math.exp(-k / 4)
            want, wsum = want + w * term, wsum + w
    torch.testing.assert_close(loss, want / wsum)
    loss.backward()
    assert logits.grad.abs().sum() > 0
    assert metrics["valid_slots"] == 12 and metrics["valid_blocks"] == 3
    # The per-slot figures, recomputed: acceptance sum_x min(p, p_ref) averaged over the
    # blocks, and tau_est = 1 + a_1 + a_1 a_2 + ... (expected accepted length + bonus).
    p = torch.softmax(logits.detach(), -1)
    accept = torch.minimum(p, p_ref).sum(-1).mean(0)
    assert metrics["accept_est_at_k"] == pytest.approx(accept.tolist(), rel=1e-5)
    assert metrics["tau_est"] == pytest.approx(1 + accept.cumprod(0).sum().item(), rel=1e-5)
    acc = (logits.detach().argmax(-1) == targets).float().mean(0)
    assert metrics["acc_at_k"] == pytest.approx(acc.tolist())
    ce = -torch.log_softmax(logits.detach(), -1).gather(-1, targets[..., None])[..., 0]
    assert metrics["ce_at_k"] == pytest.approx(ce.mean(0).tolist(), rel=1e-5)


def test_loss_closed_form_on_a_two_token_vocabulary():
    """One block, two slots, V = 2, every figure known in closed form:
    slot 1: p = (3/4, 1/4), p_ref = (0, 1), target 1: CE ln 4, L1 3/2, accept 1/4, wrong;
    slot 2: p = p_ref = (1/4, 3/4), target 1: CE ln 4/3, L1 0, accept 1, right."""
    logits = torch.tensor([[[math.log(3), 0.0], [0.0, math.log(3)]]])
    p_ref = torch.tensor([[[0.0, 1.0], [0.25, 0.75]]])
    targets, valid = torch.tensor([[1, 1]]), torch.ones(1, 2, dtype=torch.bool)
    w2 = math.exp(-1 / 4)
    slot1, slot2 = 0.1 * math.log(4) + 0.9 * 1.5, 0.1 * math.log(4 / 3)
    loss, m = dlite_loss(logits, targets, valid, p_ref)
    assert loss.item() == pytest.approx((slot1 + w2 * slot2) / (1 + w2), rel=1e-5)
    assert m["loss_at_k"] == pytest.approx([slot1, slot2], rel=1e-5)
    assert m["l1"] == pytest.approx(0.75, rel=1e-5) and m["acc_at_k"] == [0.0, 1.0]
    assert m["accept_est_at_k"] == pytest.approx([0.25, 1.0], rel=1e-5)
    assert m["tau_est"] == pytest.approx(1 + 0.25 + 0.25 * 1.0, rel=1e-5)
    # Slot 2's token unlearnable (outside a draft vocabulary: target -1): its CE term
    # drops out, the slot still weighs in the mean (its L1 term, 0 here, stays), and it
    # never counts as correct.
    targets[0, 1] = -1
    loss, m = dlite_loss(logits, targets, valid, p_ref, ce_valid=targets >= 0)
    assert loss.item() == pytest.approx(slot1 / (1 + w2), rel=1e-5)
    assert m["ce"] == pytest.approx(math.log(4), rel=1e-5) and m["acc_at_k"] == [0.0, 0.0]


def test_invalid_slots_do_not_count():
    logits, targets, p_ref = rand_case()
    valid = torch.ones_like(targets, dtype=torch.bool)
    valid[0, 2:] = False
    valid[2] = False
    loss, metrics = dlite_loss(logits, targets, valid, p_ref)
    noisy = logits.detach().clone()
    noisy[0, 2:] += 100.0
    noisy[2] = -noisy[2]
    targets2 = targets.clone()
    targets2[~valid] = 0
    loss2, _ = dlite_loss(noisy, targets2, valid, p_ref)
    torch.testing.assert_close(loss2, loss.detach())
    assert metrics["valid_blocks"] == 2 and metrics["valid_slots"] == 6


def test_perfect_draft_has_zero_l1_and_full_acceptance():
    _, targets, p_ref = rand_case()
    valid = torch.ones_like(targets, dtype=torch.bool)
    loss, metrics = dlite_loss(p_ref.log(), targets, valid, p_ref)
    assert metrics["l1"] < 1e-5
    assert all(abs(a - 1.0) < 1e-5 for a in metrics["accept_est_at_k"])
    assert abs(metrics["tau_est"] - 5.0) < 1e-4


def test_reference_from_hidden_and_from_topk():
    gen = torch.Generator().manual_seed(0)
    lm_head, hidden = torch.randn(11, 6, generator=gen), torch.randn(2, 4, 6, generator=gen)
    p = ref_probs_from_hidden(hidden, lm_head)
    torch.testing.assert_close(p, torch.softmax(hidden @ lm_head.T, -1))
    top = torch.log_softmax(hidden @ lm_head.T, -1).topk(3, dim=-1)
    q = ref_probs_from_topk(top.indices, top.values, 11)
    torch.testing.assert_close(q.sum(-1), torch.ones(2, 4))
    assert ((q > 0).sum(-1) == 3).all()
    # renormalised over the support: ratios inside the top-k are the target's ratios
    sel = p.gather(-1, top.indices)
    torch.testing.assert_close(q.gather(-1, top.indices), sel / sel.sum(-1, keepdim=True))


def test_block_targets_and_rows():
    ids = torch.arange(10)[None] + 100                     # token at position p is 100 + p
    anchors = torch.tensor([[2, 7]])
    loss_mask = torch.ones(1, 10, dtype=torch.bool)
    loss_mask[0, 4] = False
    targets, valid = block_targets(ids, anchors, 3, loss_mask=loss_mask)
    assert targets[0, 0].tolist() == [103, 104, 105]      # slot j -> token at a+j+1
    assert valid[0, 0].tolist() == [True, False, True]
    assert valid[0, 1].tolist() == [True, True, False]    # runs past the end
    rows = gather_block_rows(torch.arange(10.0)[None, :, None], anchors, 3)
    assert rows[0, 0, :, 0].tolist() == [2.0, 3.0, 4.0]   # reference row for slot j: a+j
    _, valid = block_targets(ids, anchors, 3, anchor_mask=torch.tensor([[True, False]]),
                             seq_ids=torch.tensor([[0, 0, 0, 0, 1, 1, 1, 1, 1, 1]]))
    assert valid[0, 0].tolist() == [True, False, False] and not valid[0, 1].any()
