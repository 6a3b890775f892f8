"""One training step's math, shared by every engine and every drafter architecture:
batch → drafter logits → per-slot data tokens and reference distributions → DeepSpec's
loss (DLITE.md §3). The reference is the target (its final hidden states re-projected
through the frozen lm_head, or stored top-k log-probs) or, while distilling, a frozen
teacher run on the same batch."""

import torch

from dlite.losses import (block_targets, dlite_loss, gather_block_rows, ref_probs_from_hidden,
                          ref_probs_from_topk)


def reference_probs(batch: dict, anchors, gamma: int, lm_head_weight, vocab: int,
                    teacher=None) -> torch.Tensor:
    """p_ref [B, A, γ, V] for every slot of every block."""
    if teacher is not None:
        with torch.no_grad():
            return torch.softmax(teacher.forward_train(batch).float(), dim=-1)
    if "ref_hidden_blocks" in batch:  # `anchors` storage: already one row per slot
        return ref_probs_from_hidden(batch["ref_hidden_blocks"], lm_head_weight)
    if "topk_ids_blocks" in batch:
        return ref_probs_from_topk(batch["topk_ids_blocks"], batch["topk_logprobs_blocks"], vocab)
    if "ref_hidden" in batch:
        rows = gather_block_rows(batch["ref_hidden"], anchors, gamma)
        return ref_probs_from_hidden(rows, lm_head_weight)
    ids = gather_block_rows(batch["topk_ids"], anchors, gamma)
    lps = gather_block_rows(batch["topk_logprobs"], anchors, gamma)
    return ref_probs_from_topk(ids, lps, vocab)


def compute_loss(model, batch: dict, teacher=None, ce_weight: float = 0.1,
                 l1_weight: float = 0.9) -> tuple[torch.Tensor, dict]:
    """(loss, metrics) for a batch dict: input_ids [B,L], features [B,L,F], anchors [B,A],
    optional loss_mask [B,L], anchor_mask [B,A], seq_ids [B,L], and the reference
    (`ref_hidden` [B,L,H] or `topk_ids`/`topk_logprobs` [B,L,k]; per block, `*_blocks`
    [B,A,γ,...], from `anchors` storage) unless a teacher is given."""
    anchors, gamma = batch["anchors"], model.gamma
    if any(k.endswith("_blocks") for k in batch) and (teacher is not None or model.cfg.arch != "dlite"):
        raise ValueError("an `anchors`-storage batch has features at its anchors only: it trains "
                         "the DLite student against the target, not a teacher, DSpark or distillation")
    logits = model.forward_train(batch)
    targets, valid = block_targets(batch["input_ids"], anchors, gamma, batch.get("loss_mask"),
                                   batch.get("anchor_mask"), batch.get("seq_ids"))
    p_ref = reference_probs(batch, anchors, gamma, model.vocab.lm_head_weight, logits.shape[-1], teacher)
    return dlite_loss(logits, targets, valid, p_ref, ce_weight, l1_weight)



@torch.no_grad()
def validate(model, batches) -> dict:
    """Teacher-forced validation against the target over fixed batches (stored anchors):
    `val_loss`, per-slot `val_accept_at_k_j` and `val_tau` = expected accepted length
    built from them -- the same estimate as `tau_est`, pooled over all batches with
    each batch weighted by its valid slots."""
    was_training, model = model.training, model.eval()
    w_sum, loss_sum, accept = 0.0, 0.0, None
    for batch in batches:
        _, m = compute_loss(model, batch)
        w = float(m["valid_slots"])
        loss_sum, w_sum = loss_sum + m["loss"] * w, w_sum + w
        a = torch.tensor(m["accept_est_at_k"]) * w
        accept = a if accept is None else accept + a
    model.train(was_training)
    if not w_sum:
        raise ValueError("validation batches hold no valid slot")
    accept = (accept / w_sum).tolist()
    tau, run = 1.0, 1.0
    for a in accept:
        run *= a
        tau += run
    return {"val_loss": loss_sum / w_sum, "val_tau": tau,
            **{f"val_accept_at_k_{i + 1}": a for i, a in enumerate(accept)}}
