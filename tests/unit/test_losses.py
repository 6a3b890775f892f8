"""Unit tests for dlite.losses: the weighted CE + L1 loss and its per-slot metrics
against a hand computation and a closed-form two-token example, masking of invalid
slots, the acceptance estimate, both reference-signal kinds and the per-anchor
gathering of targets / reference rows; the chunked loss (issue 16) against the one-shot
oracle on random tensors and on a tiny drafter with every reference kind (target hidden
states, top-k, teacher, with and without a draft vocabulary), gradients included; and
the pinned slot-validity rule of `block_targets`."""

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F

from dlite import losses
from dlite.losses import (block_targets, dlite_loss, dlite_loss_unchunked, gather_block_rows,
                          hidden_reference, position_weights, ref_probs_from_hidden,
                          ref_probs_from_topk, topk_reference)
from dlite.models import LEARNED_MASK, DrafterConfig, build_drafter
from dlite.train.step import compute_loss, reference_probs



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


def test_greedy_replay_counts_leading_hits_inside_the_stop_rule():
    """Block-exact greedy acceptance: leading hits only, cut where the running product of
    the drafter's top probabilities falls below the stop probability; an invalid slot
    ends the run, a block whose first slot is invalid is not a block."""
    hit = torch.tensor([[1, 1, 0, 1], [1, 1, 1, 1], [0, 1, 1, 1], [1, 1, 1, 1], [1, 1, 1, 1]]).bool()
    top = torch.full((5, 4), 0.9)
    valid = torch.ones(5, 4, dtype=torch.bool)
    valid[3, 2], valid[4, 0] = False, False
    m = losses.greedy_replay(hit, top, valid, 0.0)
    assert m.pop("greedy_kept").tolist() == [2, 4, 0, 2, -1]  # the last block: no valid first slot
    assert m == {"greedy_accepted": 2 + 4 + 0 + 2.0, "greedy_blocks": 4}
    # 0.9, 0.81, 0.729: two slots survive a stop probability of 0.75
    m = losses.greedy_replay(hit, top, valid, 0.75)
    assert m.pop("greedy_kept").tolist() == [2, 2, 0, 2, -1]
    assert m == {"greedy_accepted": 2 + 2 + 0 + 2.0, "greedy_blocks": 4}


def test_greedy_hits_need_the_targets_argmax_beyond_the_draft_vocabulary():
    """Through the loss: a draft equal to the reference is accepted slot for slot, unless
    the reference (restricted, not renormalised) leaves enough mass outside the draft
    vocabulary for some other token to be the target's greedy one."""
    _, targets, p_ref = rand_case(N=3, g=4, V=11)
    valid = torch.ones_like(targets, dtype=torch.bool)
    _, m = dlite_loss(p_ref.log(), targets, valid, p_ref, greedy_stop=0.0)
    assert (m["greedy_accepted"], m["greedy_blocks"]) == (12.0, 3)
    restricted = p_ref.clone()
    restricted[1, 1] *= 0.4  # 60% of slot 1's mass outside: more than any token inside holds
    _, m = dlite_loss(restricted.log(), targets, valid, restricted, greedy_stop=0.0)
    assert m["greedy_accepted"] == 4 + 1 + 4.0


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


def assert_same(got, want, rel=1e-5):
    """Loss / metrics / gradients equal within relative 1e-5 (gradients: of their scale)."""
    if torch.is_tensor(want):
        torch.testing.assert_close(got.detach(), want.detach(), rtol=rel, atol=rel * float(want.detach().abs().max()))
    elif isinstance(want, dict):
        assert got.keys() == want.keys()
        for k in want:
            assert got[k] == pytest.approx(want[k], rel=rel, abs=1e-7), k
    else:
        assert got == pytest.approx(want, rel=rel)


@pytest.mark.parametrize("chunk_rows", [1, 5, 12, 1000])
def test_chunked_loss_matches_one_shot(chunk_rows):
    """12 rows (3 blocks x 4 slots) in chunks of 1, 5 (not a divisor), 12 and more."""
    logits, targets, p_ref = rand_case()
    valid = torch.ones_like(targets, dtype=torch.bool)
    valid[0, 2:], valid[2, 0] = False, False
    targets[1, 1] = -1                                       # outside a draft vocabulary
    runs = []
    for fn, kw in ((dlite_loss, {"chunk_rows": chunk_rows}), (dlite_loss_unchunked, {})):
        x = logits.detach().clone().requires_grad_()
        loss, m = fn(x, targets, valid, p_ref, ce_valid=targets >= 0, **kw)
        loss.backward()
        runs.append((loss, m, x.grad))
    for got, want in zip(runs[0], runs[1]):
        assert_same(got, want)
    with pytest.raises(RuntimeError, match="backward twice"):
        x = logits.detach().clone().requires_grad_()
        loss, _ = dlite_loss(x, targets, valid, p_ref, chunk_rows=chunk_rows)
        loss.backward(retain_graph=True)
        loss.backward()


@pytest.mark.parametrize("kind", ["hidden", "hidden_bf16", "topk"])
def test_chunked_reference_rows_match_the_whole_reference(kind, monkeypatch):
    """The reference built per chunk from compact rows (draft vocabulary: every 3rd id,
    not renormalised) gives the one-shot loss on the whole p_ref; a bf16 lm_head is cast
    in blocks (LM_HEAD_BLOCK, shrunk here so that 11 does not divide V = 50)."""
    monkeypatch.setattr(losses, "LM_HEAD_BLOCK", 11)
    gen = torch.Generator().manual_seed(0)
    V, H, ids = 50, 6, torch.arange(0, 50, 3)
    lm_head, hidden = torch.randn(V, H, generator=gen), torch.randn(5, 4, H, generator=gen)
    if kind == "hidden_bf16":
        lm_head, hidden = lm_head.bfloat16(), hidden.bfloat16()
    ref = hidden_reference(hidden, lm_head, ids)
    if kind == "topk":
        top = torch.log_softmax(hidden @ lm_head.T, -1).topk(7, dim=-1)
        ref = topk_reference(top.indices, top.values, V, ids)
    else:
        whole = torch.softmax(F.linear(hidden.float(), lm_head.float()), -1)[..., ids]
        torch.testing.assert_close(ref.full(), whole)
    logits = torch.randn(5, 4, len(ids), generator=gen, requires_grad=True)
    targets, valid = torch.randint(-1, len(ids), (5, 4), generator=gen), torch.rand(5, 4, generator=gen) > 0.2
    got = dlite_loss(logits, targets, valid, ref, ce_valid=targets >= 0, chunk_rows=3)
    want = dlite_loss_unchunked(logits, targets, valid, ref.full(), ce_valid=targets >= 0)
    assert_same(got[1], want[1])
    assert_same(torch.autograd.grad(got[0], logits)[0], torch.autograd.grad(want[0], logits)[0])


VT, HT, KT = 40, 24, 2
DRAFT_IDS = torch.arange(1, VT, 2)
TINY = DrafterConfig(gamma=4, target_layer_ids=[0, 1], hidden_size=32, num_layers=1, num_heads=4,
                     num_kv_heads=2, head_dim=8, intermediate_size=64, head_hidden=32, markov_rank=8)


def tiny_drafter(arch="dlite", ids=None, seed=0):
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(123)
    embed, lm_head = torch.randn(VT, HT, generator=g), torch.randn(VT, HT, generator=g)
    cfg = dataclasses.replace(TINY, arch=arch, draft_vocab_size=None if ids is None else len(ids))
    return build_drafter(cfg, embed, lm_head, LEARNED_MASK, ids).train()


def tiny_batch(ref, B=2, L=24):
    g = torch.Generator().manual_seed(1)
    b = {"features": torch.randn(B, L, KT * HT, generator=g), "input_ids": torch.randint(0, VT, (B, L), generator=g),
         "anchors": torch.tensor([[2, 9, 20]] * B), "loss_mask": torch.rand(B, L, generator=g) > 0.2}
    hidden = torch.randn(B, L, HT, generator=g)
    if ref == "hidden":
        b["ref_hidden"] = hidden
    else:
        top = torch.log_softmax(hidden @ torch.randn(VT, HT, generator=g).T, -1).topk(5, dim=-1)
        b["topk_ids"], b["topk_logprobs"] = top.indices, top.values
    return b


def one_shot_loss(model, b, teacher=None):
    """compute_loss as it was before chunking: the whole p_ref, the one-shot loss."""
    logits = model.forward_train(b)
    targets, valid = block_targets(b["input_ids"], b["anchors"], model.gamma, b["loss_mask"])
    p_ref = reference_probs(b, b["anchors"], model.gamma, model.vocab, teacher)
    targets = model.vocab.to_draft(targets)
    return dlite_loss_unchunked(logits, targets, valid, p_ref, ce_valid=targets >= 0)


@pytest.mark.parametrize("ref", ["hidden", "topk", "teacher"])
@pytest.mark.parametrize("ids", [None, DRAFT_IDS], ids=["full_vocab", "draft_vocab"])
def test_compute_loss_chunked_matches_one_shot_with_parameter_gradients(ref, ids):
    """24 slot rows in chunks of 5: loss, every metric and every parameter gradient."""
    model, b = tiny_drafter(ids=ids), tiny_batch("topk" if ref == "topk" else "hidden")
    teacher = tiny_drafter("teacher", ids, seed=3) if ref == "teacher" else None
    runs = []
    for fn in (lambda: compute_loss(model, b, teacher, chunk_rows=5), lambda: one_shot_loss(model, b, teacher)):
        model.zero_grad()
        loss, m = fn()
        loss.backward()
        runs.append((loss, m, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}))
    (loss, m, grads), (loss0, m0, grads0) = runs
    assert_same(loss, loss0)
    assert_same({k: m[k] for k in m0}, m0)
    assert grads.keys() == grads0.keys() and len(grads) > 5
    for n in grads0:
        assert_same(grads[n], grads0[n])


def test_block_targets_slot_validity_rule():
    """Pinned (see block_targets): a slot's validity is its own position's loss_mask, not
    its earlier slots'; the sequence end and a seq_ids boundary cut every later slot."""
    ids = torch.arange(12)[None] + 100
    sup = torch.tensor([[1, 1, 1, 0, 1, 1, 1, 1, 1, 0, 0, 1]], dtype=torch.bool)
    anchors = torch.tensor([[1, 6, 9]])
    _, valid = block_targets(ids, anchors, 4, loss_mask=sup)
    assert valid[0, 0].tolist() == [True, False, True, True]     # unsupervised -> supervised
    assert valid[0, 1].tolist() == [True, True, False, False]    # supervised -> unsupervised
    assert valid[0, 2].tolist() == [False, True, False, False]   # after tool tokens; then the end
    seq = torch.tensor([[0] * 5 + [1] * 4 + [2] * 3])
    _, valid = block_targets(ids, torch.tensor([[2, 6]]), 4, loss_mask=torch.ones(1, 12, dtype=torch.bool), seq_ids=seq)
    assert valid[0, 0].tolist() == [True, True, False, False]    # packing boundary after position 4
    assert valid[0, 1].tolist() == [True, True, False, False]    # 9 starts sequence 2
