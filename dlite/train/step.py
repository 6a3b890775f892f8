"""One training step's math, shared by every engine and every drafter architecture:
batch → drafter logits → per-slot data tokens and reference distributions → DeepSpec's
loss (DLITE.md §3). The reference is the target (its final hidden states re-projected
through the frozen lm_head, or stored top-k log-probs) or, while distilling, a frozen
teacher run on the same batch."""

import torch

from dlite.losses import (RowReference, block_targets, dlite_loss, expected_tau, gather_block_rows,
                          hidden_reference, logits_reference, topk_reference)


def reference_rows(batch: dict, anchors, gamma: int, vocab, teacher=None) -> RowReference:
    """Every slot's reference [B, A, γ, ...] as compact rows (target hidden states, top-k
    or teacher logits) that the loss turns into p_ref over the drafter's vocabulary
    (`vocab`: its FrozenVocab) one chunk of rows at a time. The target's distribution is
    computed over all V tokens (the softmax needs the whole normaliser) and then
    restricted to the draft ids; a teacher shares the student's draft vocabulary, so its
    softmax is already over N."""
    if teacher is not None:
        with torch.no_grad():
            return logits_reference(teacher.forward_train(batch))
    V, lm_head = vocab.embed_weight.shape[0], vocab.lm_head_weight
    # NOT renormalised over the draft vocabulary: with q zero outside it,
    # |q - p_N|_1 = 1 + p(N) - 2 sum_x min(q, p), so the L1 term is exactly the true
    # acceptance rate (mass outside the vocabulary counted as lost), and accept_est /
    # val_tau stay comparable with a full-vocabulary drafter's.
    ids = vocab.draft_ids
    if "ref_hidden_blocks" in batch:  # `anchors` storage: already one row per slot
        return hidden_reference(batch["ref_hidden_blocks"], lm_head, ids)
    if "topk_ids_blocks" in batch:
        return topk_reference(batch["topk_ids_blocks"], batch["topk_logprobs_blocks"], V, ids)
    if "ref_hidden" in batch:
        return hidden_reference(gather_block_rows(batch["ref_hidden"], anchors, gamma), lm_head, ids)
    return topk_reference(gather_block_rows(batch["topk_ids"], anchors, gamma),
                          gather_block_rows(batch["topk_logprobs"], anchors, gamma), V, ids)


def reference_probs(batch: dict, anchors, gamma: int, vocab, teacher=None) -> torch.Tensor:
    """p_ref [B, A, γ, N] for every slot of every block, all at once (tests, small
    batches; `reference_rows` says what it is). The loss never builds it whole."""
    return reference_rows(batch, anchors, gamma, vocab, teacher).full()


def compute_loss(model, batch: dict, teacher=None, ce_weight: float = 0.1,
                 l1_weight: float = 0.9, chunk_rows=None) -> tuple[torch.Tensor, dict]:
    """(loss, metrics) for a batch dict: input_ids [B,L], features [B,L,F], anchors [B,A],
    optional loss_mask [B,L], anchor_mask [B,A], seq_ids [B,L], and the reference
    (`ref_hidden` [B,L,H] or `topk_ids`/`topk_logprobs` [B,L,k]; per block, `*_blocks`
    [B,A,γ,...], from `anchors` storage) unless a teacher is given. With a draft
    vocabulary, data tokens outside it are left out of the CE term and counted
    (`oov_slots`, `oov_share` of valid slots). The loss runs over `chunk_rows` slot rows
    at a time (default: `dlite.losses.chunk_rows_for` the target vocabulary)."""
    anchors, gamma, vocab = batch["anchors"], model.gamma, model.vocab
    if any(k.endswith("_blocks") for k in batch) and (teacher is not None or model.needs_history):
        raise ValueError("an `anchors`-storage batch has features at its anchors only: it trains "
                         "a history-free student against the target, not a teacher, DSpark "
                         "or distillation")
    logits = model.forward_train(batch)
    targets, valid = block_targets(batch["input_ids"], anchors, gamma, batch.get("loss_mask"),
                                   batch.get("anchor_mask"), batch.get("seq_ids"))
    ref = reference_rows(batch, anchors, gamma, vocab, teacher)
    if vocab.draft_ids is None:
        return dlite_loss(logits, targets, valid, ref, ce_weight, l1_weight, chunk_rows=chunk_rows)
    targets = vocab.to_draft(targets)  # -1: outside the draft vocabulary, not learnable
    loss, m = dlite_loss(logits, targets, valid, ref, ce_weight, l1_weight, ce_valid=targets >= 0,
                         chunk_rows=chunk_rows)
    oov = int((valid & (targets < 0)).sum())
    return loss, {**m, "oov_slots": oov, "oov_share": oov / max(1, m["valid_slots"])}


@torch.no_grad()
def validate(model, batches) -> dict:
    """Teacher-forced validation against the target over fixed batches (stored anchors):
    `val_loss`, per-slot `val_accept_at_k_j` and `val_tau` = expected accepted length
    built from them -- exactly the one-batch `tau_est` / loss of all batches together:
    slot k's acceptance pooled by its valid count, the loss by its position weights;
    with a draft vocabulary also `val_oov_share` (valid slots whose data token lies
    outside it)."""
    was_training, model = model.training, model.eval()
    w_sum, loss_sum, slots, accept, n_at_k, oov = 0.0, 0.0, 0, None, None, 0
    for batch in batches:
        _, m = compute_loss(model, batch)
        loss_sum, w_sum = loss_sum + m["loss"] * m["loss_weight"], w_sum + m["loss_weight"]
        slots, oov = slots + m["valid_slots"], oov + m.get("oov_slots", 0)
        n = torch.tensor(m["valid_at_k"], dtype=torch.float64)
        a = torch.tensor(m["accept_est_at_k"], dtype=torch.float64) * n
        accept, n_at_k = (a, n) if accept is None else (accept + a, n_at_k + n)
    model.train(was_training)
    if not slots:
        raise ValueError("validation batches hold no valid slot")
    accept = (accept / n_at_k.clamp_min(1)).tolist()
    tau = expected_tau(accept)
    extra = {} if model.vocab.draft_ids is None else {"val_oov_share": oov / slots}
    return {"val_loss": loss_sum / w_sum, "val_tau": tau, **extra,
            **{f"val_accept_at_k_{i + 1}": a for i, a in enumerate(accept)}}
