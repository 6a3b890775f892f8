"""The drafter training loss (DeepSpec's, DLITE.md §3; with the authors' published
recipe's terms too: KL to a teacher for stage 1, CE on the target's greedy token, no
slot decay -- `dlite.train.step.LossSpec`) and the helpers that cut the per-slot
targets and reference rows for a set of anchors out of a sequence.

Slot j (0-based) of the block anchored at position a predicts the token at a+j+1.
Its data token is input_ids[a+j+1]; its reference distribution is the target's at
position a+j (the row computed from hidden state a+j predicts token a+j+1).

Memory (issue 16): a [rows, V] fp32 tensor over all B*A*γ slot rows is 8.7 GB at
Qwen3-4B's B=4, A=512, γ=7, V=151936, and the one-shot loss makes several. `dlite_loss`
walks the rows in chunks (`chunk_rows`, default ~256 MiB per fp32 [rows, widest] block):
each chunk builds its reference probabilities from compact per-slot rows
(`RowReference`: target hidden states, top-k, logits or probabilities) and its gradient
at once, so no full-size intermediate exists and backward hands back one buffer shaped
like the logits. `dlite_loss_unchunked` is the one-shot version, kept as the oracle the
chunked loss is tested against and as the baseline of dlite/bench/loss_memory.py."""

from dataclasses import dataclass
from typing import Callable, Optional, Tuple

import torch
import torch.nn.functional as F

from dlite.models.common import gather_positions, stop_rule_keeps

# Bytes of one chunk's widest fp32 [rows, width] block: 441 rows at V = 151936. A chunk
# holds two such blocks (logits, softmax) at its peak: ~0.5 GB at Qwen3-4B, measured.
CHUNK_BYTES = 256 * 2**20
# lm_head rows cast to fp32 at a time: a bf16 lm_head is never copied whole (1.6 GB).
LM_HEAD_BLOCK = 16384


def chunk_rows_for(width: int, chunk_bytes: int = CHUNK_BYTES) -> int:
    """Rows per loss chunk such that one fp32 [rows, width] block is ~chunk_bytes."""
    return max(1, chunk_bytes // (4 * width))


def position_weights(gamma: int, decay: Optional[float] = 4.0, device=None) -> torch.Tensor:
    """w_k = exp(-(k-1)/decay), k = 1..gamma: early slots matter most for acceptance.
    decay None: every slot alike (the authors' two-stage student; their per-slot decay,
    where set, is this same exp(-offset/gamma) with offset 0 at the first proposal)."""
    k = torch.arange(gamma, device=device, dtype=torch.float32)
    return torch.ones_like(k) if decay is None else torch.exp(-k / decay)


def block_targets(input_ids: torch.Tensor, anchors: torch.Tensor, gamma: int,
                  loss_mask: Optional[torch.Tensor] = None, anchor_mask: Optional[torch.Tensor] = None,
                  seq_ids: Optional[torch.Tensor] = None,
                  branch_ids: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """Data tokens [B, A, g] (input_ids at a+j+1) and `valid` [B, A, g]: inside the
    sequence, a supervised token (loss_mask), a real anchor, in the anchor's segment and,
    in a forked row (`branch_ids`: trunk 0, branch k >= 1), in the anchor's branch.

    Slot j's validity does NOT require slots < j to be valid (decided, issue 16): with
    teacher forcing slot j sees the data tokens before it, so its data token and the
    target's distribution at a+j are a well-defined target even after an unsupervised
    slot (an assistant token after a chat-template or tool token inside the block);
    acceptance chaining is an inference matter, applied by tau_est's product of per-slot
    rates. The sequence end, a packing boundary (seq_ids) and a branch's end do cut every
    later slot."""
    L = input_ids.shape[1]
    pos = anchors[..., None] + 1 + torch.arange(gamma, device=anchors.device)
    valid = pos < L
    if loss_mask is not None:
        valid = valid & gather_positions(loss_mask.bool(), pos)
    if anchor_mask is not None:
        valid = valid & anchor_mask.bool()[..., None]
    if seq_ids is not None:
        valid = valid & (gather_positions(seq_ids, pos) == gather_positions(seq_ids, anchors)[..., None])
    if branch_ids is not None:
        same = gather_positions(branch_ids, pos) == gather_positions(branch_ids, anchors)[..., None]
        # A document never recurs, so equality alone cuts every later slot; branch 0 does
        # recur (padding after the last branch), so the block ends where it first leaves.
        valid = valid & same.long().cumprod(-1).bool()
    return gather_positions(input_ids, pos), valid


def gather_block_rows(rows: torch.Tensor, anchors: torch.Tensor, gamma: int, offset: int = 0):
    """Per-slot rows [B, A, g, ...] from per-position rows [B, L, ...] at a+j+offset:
    offset 0 for reference hidden states / top-k log-probs (see the module docstring)."""
    pos = anchors[..., None] + offset + torch.arange(gamma, device=anchors.device)
    return gather_positions(rows, pos)


def ref_probs_from_hidden(ref_hidden: torch.Tensor, lm_head_weight: torch.Tensor) -> torch.Tensor:
    """The target's exact distribution from its final post-norm hidden states, in fp32.
    A low-precision lm_head is cast LM_HEAD_BLOCK rows at a time, not copied whole."""
    h = ref_hidden.float()
    if lm_head_weight.dtype == torch.float32:
        return torch.softmax(F.linear(h, lm_head_weight), dim=-1)
    V = lm_head_weight.shape[0]
    logits = h.new_empty(*h.shape[:-1], V)
    for i in range(0, V, LM_HEAD_BLOCK):
        logits[..., i:i + LM_HEAD_BLOCK] = F.linear(h, lm_head_weight[i:i + LM_HEAD_BLOCK].float())
    return torch.softmax(logits, dim=-1)


def ref_probs_from_topk(topk_ids: torch.Tensor, topk_logprobs: torch.Tensor, vocab_size: int):
    """An APPROXIMATE reference from stored top-k (ids, log-probs): renormalised over the
    top-k support, i.e. the tail mass outside the top k is ignored (set to zero). Good
    when the target is peaked (k of 8-64 usually holds >95% of the mass)."""
    p = torch.zeros(*topk_ids.shape[:-1], vocab_size, device=topk_ids.device)
    p.scatter_(-1, topk_ids.long(), topk_logprobs.float().exp())
    return p / p.sum(-1, keepdim=True).clamp_min(1e-12)


def restrict(p: torch.Tensor, draft_ids: Optional[torch.Tensor]) -> torch.Tensor:
    """p's columns at the draft ids, NOT renormalised (see step.reference_rows)."""
    return p if draft_ids is None else p.index_select(-1, draft_ids)


@dataclass
class RowReference:
    """Every slot's reference as compact rows, turned into fp32 probabilities [rows, N]
    one chunk at a time (`probs`), so the whole [..., γ, N] p_ref never has to exist.
    `rows`: tensors [..., γ, F] with the same leading shape; `to_probs(*rows)` maps them
    to probabilities over the last dim; `width`: the widest row it builds (V when it
    re-projects through the target's lm_head), which sizes the default chunk."""
    rows: Tuple[torch.Tensor, ...]
    to_probs: Callable
    width: int

    def probs(self, start: int = 0, stop: Optional[int] = None) -> torch.Tensor:
        """Probabilities of the flattened rows start..stop."""
        return self.to_probs(*(r.reshape(-1, r.shape[-1])[start:stop] for r in self.rows))

    def full(self) -> torch.Tensor:
        """All of p_ref [..., γ, N] at once (tests, small batches)."""
        return self.to_probs(*self.rows)


def hidden_reference(ref_hidden, lm_head_weight, draft_ids=None) -> RowReference:
    """The target's exact distribution from final hidden states [..., γ, H]."""
    return RowReference((ref_hidden,), lambda h: restrict(ref_probs_from_hidden(h, lm_head_weight), draft_ids),
                        lm_head_weight.shape[0])


def topk_reference(topk_ids, topk_logprobs, vocab_size: int, draft_ids=None) -> RowReference:
    """The approximate top-k reference (`ref_probs_from_topk`) from [..., γ, k] rows."""
    return RowReference((topk_ids, topk_logprobs),
                        lambda i, lp: restrict(ref_probs_from_topk(i, lp, vocab_size), draft_ids), vocab_size)


def logits_reference(logits) -> RowReference:
    """softmax of a teacher's logits [..., γ, N] (already over the student's vocabulary)."""
    return RowReference((logits,), lambda z: torch.softmax(z.float(), dim=-1), logits.shape[-1])


def probs_reference(p_ref) -> RowReference:
    """Probabilities [..., γ, N] given as they are."""
    return RowReference((p_ref,), lambda p: p.float(), p_ref.shape[-1])


def _row_terms(z: torch.Tensor, targets: torch.Tensor, p_ref: torch.Tensor):
    """Per-row CE of the data token, L1 distance to the reference, KL(p_ref || p) and
    the draft's p, for logits rows z [rows, N] (fp32 inside; -1 targets read column 0,
    masked later). KL's p_ref log p_ref is 0 where p_ref is (xlogy)."""
    logp = torch.log_softmax(z.float(), -1)
    ce = -logp.gather(-1, targets.long().clamp_min(0)[..., None])[..., 0]
    p, q = logp.exp(), p_ref.float()
    kl = (torch.xlogy(q, q) - q * logp).sum(-1)
    return ce, (p - q).abs().sum(-1), kl, p


def _chunk(z, targets, coefs, ref, grad, i: int, j: int, ref_labels: bool, replay: bool):
    """Rows i..j of `_ChunkedLoss`: their gradient into grad[i:j] (when grad is given) and
    their small per-row results. A function of its own so that the chunk's [rows, V] and
    [rows, N] tensors are freed on return, before the next chunk allocates its own.
    `ref_labels`: CE's label is the reference's argmax instead of `targets`. `replay`:
    also the greedy-replay hit and the drafter's top probability (validation only)."""
    p_ref = ref.probs(i, j)  # grad mode is off in forward: the reference has no graph
    t = p_ref.argmax(-1) if ref_labels else targets[i:j]
    with torch.enable_grad():
        zc = z[i:j].detach().requires_grad_(grad is not None)
        ce, l1, kl, p = _row_terms(zc, t, p_ref)
        if grad is not None:
            c_ce, c_l1, c_kl = (c[i:j] for c in coefs)
            grad[i:j] = torch.autograd.grad((c_ce * ce + c_l1 * l1 + c_kl * kl).sum(), zc)[0]
    out = (ce.detach(), l1.detach(), kl.detach(), torch.minimum(p.detach(), p_ref).sum(-1),
           zc.detach().argmax(-1) == t)
    if not replay:
        return out
    # What a greedy replay accepts: the drafter's argmax is the target's, and no token
    # outside a draft vocabulary outweighs it (p_ref is not renormalised there, so its
    # missing mass bounds them); with the drafter's top probability for the stop rule.
    q_top, greedy = p_ref.max(-1)
    top, mine = p.detach().max(-1)
    return (*out, (mine == greedy) & (q_top > 1 - p_ref.sum(-1)), top)


class _ChunkedLoss(torch.autograd.Function):
    """sum_r coef_ce[r] CE_r + coef_l1[r] L1_r + coef_kl[r] KL_r over flat rows, one chunk at a time. Each
    chunk's gradient is taken in forward, with autograd over the same ops as the one-shot
    loss, into one buffer like z that backward returns (scaled): nothing [rows, V] outlives
    its chunk and nothing is recomputed. Also returns per-row CE, L1, KL, acceptance
    sum_x min(p, p_ref) and argmax hit (with `replay`, also the greedy-replay hit and
    the drafter's top probability), without gradient."""

    @staticmethod
    def forward(ctx, z, targets, coefs, ref, chunk_rows, need_grad, ref_labels, replay):
        grad = torch.empty_like(z) if need_grad else None
        out = [_chunk(z, targets, coefs, ref, grad, i, i + chunk_rows, ref_labels, replay)
               for i in range(0, z.shape[0], chunk_rows)]
        rows = [torch.cat(t) for t in zip(*out)]  # ce, l1, kl, accept, hit(, greedy, top)
        ctx.grad = grad
        ctx.mark_non_differentiable(*rows)
        return sum((c * x).sum() for c, x in zip(coefs, rows[:3])), *rows

    @staticmethod
    def backward(ctx, g_loss, *_):
        if ctx.grad is None:
            raise RuntimeError("dlite_loss: its gradient was already handed back (backward twice?)")
        grad, ctx.grad = ctx.grad, None  # in place, once: no second [rows, N] buffer
        return grad.mul_(g_loss), None, None, None, None, None, None, None


def dlite_loss(logits: torch.Tensor, targets: torch.Tensor, valid: torch.Tensor, p_ref,
               ce_weight: float = 0.1, l1_weight: float = 0.9, decay: Optional[float] = 4.0,
               ce_valid: Optional[torch.Tensor] = None, chunk_rows: Optional[int] = None,
               kl_weight: float = 0.0, ref_labels: bool = False, greedy_stop: Optional[float] = None):
    """loss = sum_k w_k (ce_w * CE(logits_k, x*_k) + l1_w * |softmax(logits_k) - p_ref_k|_1
    + kl_w * KL(p_ref_k || softmax(logits_k))) / sum_k w_k, over valid slots only (a
    weighted mean: invalid slots drop out of both sums, so a block cut short by the
    sequence end still counts its early slots). The L1 term is the authors' "TV" term
    (they sum |p - q| without the 1/2); KL is their stage-1 distillation term.

    logits [..., g, N], targets/valid [..., g]; p_ref: probabilities [..., g, N] or a
    `RowReference` building them chunk by chunk. `ce_valid` [..., g] (default `valid`)
    limits the CE term to slots whose data token the drafter can emit: with a draft
    vocabulary a token outside it has no logit (targets -1 there), so it is not
    learnable; the L1 term still counts on every valid slot. `ref_labels`: CE's label is
    p_ref's argmax (the target's greedy token) instead of `targets`. `greedy_stop` (a stop
    probability): also `greedy_replay`'s block-exact greedy acceptance. `chunk_rows`: slot
    rows per chunk (default `chunk_rows_for` the widest of N and the reference's width).
    Returns (loss, metrics) with per-slot loss / CE / L1 / KL / accuracy and the teacher-forced
    acceptance estimate sum_x min(p_draft, p_ref) per slot, and tau_est from it."""
    g, N = logits.shape[-2], logits.shape[-1]
    ref = p_ref if isinstance(p_ref, RowReference) else probs_reference(p_ref)
    if ref.rows[0].numel() // ref.rows[0].shape[-1] != logits.numel() // N:
        raise ValueError(f"reference rows {tuple(ref.rows[0].shape)} do not match logits {tuple(logits.shape)}")
    targets, valid = targets.reshape(-1, g), valid.reshape(-1, g).float()
    ce_on = valid if ce_valid is None else ce_valid.reshape(-1, g).float() * valid
    w = position_weights(g, decay, logits.device)[None] * valid
    scale = (w / w.sum().clamp_min(1e-12)).reshape(-1)
    need_grad = torch.is_grad_enabled() and logits.requires_grad
    coefs = (ce_weight * ce_on.reshape(-1) * scale, l1_weight * scale, kl_weight * scale)
    loss, ce, l1, kl, accept, hit, *replay = _ChunkedLoss.apply(
        logits.reshape(-1, N), targets.reshape(-1), coefs, ref,
        chunk_rows or chunk_rows_for(max(N, ref.width)), need_grad, ref_labels, greedy_stop is not None)
    ce, l1, kl = ce.view(-1, g) * ce_on, l1.view(-1, g), kl.view(-1, g)
    per_slot = ce_weight * ce + l1_weight * l1 + kl_weight * kl     # [rows / g, g]
    m = _metrics(loss, per_slot, ce, l1, accept.view(-1, g), hit.view(-1, g), valid, ce_on, kl)
    if greedy_stop is not None:
        m.update(greedy_replay(*(r.view(-1, g) for r in replay), valid, greedy_stop))
    return loss, {**m, "loss_weight": float(w.sum())}  # what pools `loss` over batches


@torch.no_grad()
def greedy_replay(greedy_hit: torch.Tensor, top: torch.Tensor, valid: torch.Tensor, stop_prob: float) -> dict:
    """What a greedy replay would accept of each block, teacher forced (the evaluation's
    tau counts these plus the bonus token; `tau_est` is a pooled soft estimate): slot k
    counts when the drafter's argmax is the target's greedy token and every earlier slot
    counted, and the block ends where the drafter's stop rule cuts it
    (`dlite.models.common.stop_rule_keeps`, as `sample_rows`; greedy: chosen = top). Inputs
    [blocks, g]; returns the sum over blocks whose first slot is valid and their count,
    which pool over batches, and `greedy_kept` [blocks] (-1 where the first slot is
    invalid) for `dlite.train.step.replay_walk`."""
    kept = (greedy_hit & valid.bool() & stop_rule_keeps(top, top, stop_prob)).long().cumprod(-1).sum(-1)
    first = valid[:, 0].bool()
    return {"greedy_accepted": float(kept[first].sum()), "greedy_blocks": int(first.sum()),
            "greedy_kept": torch.where(first, kept, torch.full_like(kept, -1))}


def dlite_loss_unchunked(logits: torch.Tensor, targets: torch.Tensor, valid: torch.Tensor,
                         p_ref: torch.Tensor, ce_weight: float = 0.1, l1_weight: float = 0.9,
                         decay: float = 4.0, ce_valid: Optional[torch.Tensor] = None):
    """`dlite_loss` in one shot (p_ref: probabilities [..., g, N]), every [rows, N] fp32
    intermediate at once: the oracle the chunked loss is tested against, and the
    memory benchmark's baseline. Not for training at production sizes."""
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
    with torch.no_grad():
        accept, hit = torch.minimum(p, p_ref.float()).sum(-1), logits.argmax(-1) == targets
        kl = (torch.xlogy(p_ref.float(), p_ref.float()) - p_ref.float() * logp).sum(-1)
    m = _metrics(loss, per_slot, ce, l1, accept, hit, valid, ce_on, kl)
    return loss, {**m, "loss_weight": float(w.sum())}


def expected_tau(accept_at_k) -> float:
    """Expected accepted length incl. the bonus token from per-slot acceptance rates:
    1 + a1 + a1*a2 + ... (a slot counts only if every earlier one was accepted)."""
    tau, run = 1.0, 1.0
    for a in accept_at_k:
        run *= a
        tau += run
    return tau


@torch.no_grad()
def _metrics(loss, per_slot, ce, l1, accept, hit, valid, ce_on, kl) -> dict:
    """Per-slot means over valid slots (CE: over `ce_on` slots), as Python floats ready
    to log, from per-slot [blocks, g] terms, acceptance sum_x min(p, p_ref) and argmax
    hits. An unlearnable target (-1) never counts as correct in `acc_at_k`."""
    n = valid.sum(0).clamp_min(1)
    slot = lambda t: ((t.float() * valid).sum(0) / n).tolist()
    accept = slot(accept)
    tau = expected_tau(accept)
    nv = valid.sum().clamp_min(1)
    n_ce = ce_on.sum(0).clamp_min(1)
    return {"loss": loss.item(), "ce": ((ce * ce_on).sum() / ce_on.sum().clamp_min(1)).item(),
            "l1": ((l1 * valid).sum() / nv).item(), "kl": ((kl * valid).sum() / nv).item(),
            "loss_at_k": slot(per_slot),
            "ce_at_k": ((ce * ce_on).sum(0) / n_ce).tolist(),
            "acc_at_k": slot(hit), "accept_est_at_k": accept, "tau_est": tau,
            "valid_slots": int(valid.sum().item()),
            "valid_at_k": valid.sum(0).long().tolist(),  # what pools accept_est_at_k
            "valid_blocks": int((valid.sum(-1) > 0).sum().item())}
