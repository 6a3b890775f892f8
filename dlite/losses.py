"""The drafter training loss (DeepSpec's, DLITE.md §3) and the helpers that cut the
per-slot targets and reference rows for a set of anchors out of a sequence.

Slot j (0-based) of the block anchored at position a predicts the token at a+j+1.
Its data token is input_ids[a+j+1]; its reference distribution is the target's at
position a+j (the row computed from hidden state a+j predicts token a+j+1)."""

from typing import Optional, Tuple

import torch
import torch.nn.functional as F

from dlite.models.common import gather_positions


def position_weights(gamma: int, decay: float = 4.0, device=None) -> torch.Tensor:
    """w_k = exp(-(k-1)/decay), k = 1..gamma: early slots matter most for acceptance."""
    return torch.exp(-torch.arange(gamma, device=device, dtype=torch.float32) / decay)


def block_targets(input_ids: torch.Tensor, anchors: torch.Tensor, gamma: int,
                  loss_mask: Optional[torch.Tensor] = None, anchor_mask: Optional[torch.Tensor] = None,
                  seq_ids: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """Data tokens [B, A, g] (input_ids at a+j+1) and `valid` [B, A, g]: inside the
    sequence, a supervised token (loss_mask), a real anchor, and in the anchor's segment."""
    L = input_ids.shape[1]
    pos = anchors[..., None] + 1 + torch.arange(gamma, device=anchors.device)
    valid = pos < L
    if loss_mask is not None:
        valid = valid & gather_positions(loss_mask.bool(), pos)
    if anchor_mask is not None:
        valid = valid & anchor_mask.bool()[..., None]
    if seq_ids is not None:
        valid = valid & (gather_positions(seq_ids, pos) == gather_positions(seq_ids, anchors)[..., None])
    return gather_positions(input_ids, pos), valid


def gather_block_rows(rows: torch.Tensor, anchors: torch.Tensor, gamma: int, offset: int = 0):
    """Per-slot rows [B, A, g, ...] from per-position rows [B, L, ...] at a+j+offset:
    offset 0 for reference hidden states / top-k log-probs (see the module docstring)."""
    pos = anchors[..., None] + offset + torch.arange(gamma, device=anchors.device)
    return gather_positions(rows, pos)


def ref_probs_from_hidden(ref_hidden: torch.Tensor, lm_head_weight: torch.Tensor) -> torch.Tensor:
    """The target's exact distribution from its final post-norm hidden states."""
    return torch.softmax(F.linear(ref_hidden.float(), lm_head_weight.float()), dim=-1)


def ref_probs_from_topk(topk_ids: torch.Tensor, topk_logprobs: torch.Tensor, vocab_size: int):
    """An APPROXIMATE reference from stored top-k (ids, log-probs): renormalised over the
    top-k support, i.e. the tail mass outside the top k is ignored (set to zero). Good
    when the target is peaked (k of 8-64 usually holds >95% of the mass)."""
    p = torch.zeros(*topk_ids.shape[:-1], vocab_size, device=topk_ids.device)
    p.scatter_(-1, topk_ids.long(), topk_logprobs.float().exp())
    return p / p.sum(-1, keepdim=True).clamp_min(1e-12)


def dlite_loss(logits: torch.Tensor, targets: torch.Tensor, valid: torch.Tensor,
               p_ref: torch.Tensor, ce_weight: float = 0.1, l1_weight: float = 0.9,
               decay: float = 4.0, ce_valid: Optional[torch.Tensor] = None):
    """loss = sum_k w_k (ce_w * CE(logits_k, x*_k) + l1_w * |softmax(logits_k) - p_ref_k|_1)
    / sum_k w_k, over valid slots only (a weighted mean: invalid slots drop out of both
    sums, so a block cut short by the sequence end still counts its early slots).

    logits [..., g, V], targets/valid [..., g], p_ref [..., g, V] (probabilities).
    `ce_valid` [..., g] (default `valid`) limits the CE term to slots whose data token the
    drafter can emit: with a draft vocabulary a token outside it has no logit (targets
    -1 there), so it is not learnable; the L1 term still counts on every valid slot.
    Returns (loss, metrics) with per-slot loss / CE / L1 / accuracy and the teacher-forced
    acceptance estimate sum_x min(p_draft, p_ref) per slot, and tau_est from it."""
    g = logits.shape[-2]
    logits = logits.reshape(-1, g, logits.shape[-1]).float()
    p_ref = p_ref.reshape(-1, g, p_ref.shape[-1])
    targets, valid = targets.reshape(-1, g), valid.reshape(-1, g).float()
    ce_on = valid if ce_valid is None else ce_valid.reshape(-1, g).float() * valid
    logp = torch.log_softmax(logits, -1)
    ce = -logp.gather(-1, targets.long().clamp_min(0)[..., None])[..., 0] * ce_on
    p = logp.exp()
    l1 = (p - p_ref.float()).abs().sum(-1)
    per_slot = ce_weight * ce + l1_weight * l1                       # [N, g]
    w = position_weights(g, decay, logits.device)[None] * valid
    loss = (per_slot * w).sum() / w.sum().clamp_min(1e-12)
    m = _metrics(loss, per_slot, ce, l1, p, p_ref, logits, targets, valid, ce_on)
    return loss, {**m, "loss_weight": float(w.sum())}  # what pools `loss` over batches


def expected_tau(accept_at_k) -> float:
    """Expected accepted length incl. the bonus token from per-slot acceptance rates:
    1 + a1 + a1*a2 + ... (a slot counts only if every earlier one was accepted)."""
    tau, run = 1.0, 1.0
    for a in accept_at_k:
        run *= a
        tau += run
    return tau


@torch.no_grad()
def _metrics(loss, per_slot, ce, l1, p, p_ref, logits, targets, valid, ce_on) -> dict:
    """Per-slot means over valid slots (CE: over `ce_on` slots), as Python floats ready
    to log. An unlearnable target (-1) never counts as correct in `acc_at_k`."""
    n = valid.sum(0).clamp_min(1)
    slot = lambda t: ((t.float() * valid).sum(0) / n).tolist()
    accept = slot(torch.minimum(p, p_ref.float()).sum(-1))
    tau = expected_tau(accept)
    nv = valid.sum().clamp_min(1)
    n_ce = ce_on.sum(0).clamp_min(1)
    return {"loss": loss.item(), "ce": ((ce * ce_on).sum() / ce_on.sum().clamp_min(1)).item(),
            "l1": ((l1 * valid).sum() / nv).item(), "loss_at_k": slot(per_slot),
            "ce_at_k": ((ce * ce_on).sum(0) / n_ce).tolist(),
            "acc_at_k": slot(logits.argmax(-1) == targets),
            "accept_est_at_k": accept, "tau_est": tau, "valid_slots": int(valid.sum().item()),
            "valid_at_k": valid.sum(0).long().tolist(),  # what pools accept_est_at_k
            "valid_blocks": int((valid.sum(-1) > 0).sum().item())}

