"""One training step's math, shared by every engine and every drafter architecture:
batch → drafter logits → per-slot data tokens and reference distributions → DeepSpec's
loss (DLITE.md §3). The reference is the target (its final hidden states re-projected
through the frozen lm_head, or stored top-k log-probs) or, while distilling, a frozen
teacher run on the same batch."""

from dataclasses import dataclass
from typing import Optional

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


@dataclass(frozen=True)
class LossSpec:
    """What a step's loss is made of (`train.*` keys of the same names; the teacher stage's
    are `train.teacher_*`). Stage 2 (against the target): ce_weight x CE + tv_weight x L1,
    slots weighted by `loss_decay`.
    Stage 1 (against the teacher): the same terms (recipe "teacher_init") or kl_weight x
    KL(teacher || student) (recipe "published", `distill_kl`)."""
    ce_weight: float = 0.1
    tv_weight: float = 0.9
    loss_decay: Optional[float] = 4.0
    kl_weight: float = 1.0
    distill_kl: bool = False
    ce_target_argmax: bool = False  # CE's label = the reference's argmax, not the data token

    @classmethod
    def from_train(cls, t) -> "LossSpec":
        """The align and DSpark stages' loss: stage 2 from the `train.*` keys, stage 1 by
        `train.recipe`."""
        return cls(t.ce_weight, t.tv_weight, t.loss_decay, t.kl_weight, t.recipe == "published",
                   t.ce_labels == "target_argmax")

    @classmethod
    def for_teacher(cls, t) -> "LossSpec":
        """The teacher stage's loss from its own `train.teacher_*` keys: it trains against
        the target only, so no stage-1 term and no recipe reach it."""
        return cls(t.teacher_ce_weight, t.teacher_tv_weight, t.teacher_loss_decay,
                   ce_target_argmax=t.teacher_ce_labels == "target_argmax")


def compute_loss(model, batch: dict, teacher=None, spec: LossSpec = LossSpec(),
                 teacher_share: float = 1.0, chunk_rows=None,
                 greedy_stop: Optional[float] = None) -> tuple[torch.Tensor, dict]:
    """(loss, metrics) for a batch dict: input_ids [B,L], features [B,L,F], anchors [B,A],
    optional loss_mask [B,L], anchor_mask [B,A], seq_ids [B,L], position_ids / branch_ids
    [B,L] (a forked row: `dlite.train.data.collate`), and the reference
    (`ref_hidden` [B,L,H] or `topk_ids`/`topk_logprobs` [B,L,k]; per block, `*_blocks`
    [B,A,γ,...], from `anchors` storage) unless a teacher is given. With a teacher, the
    loss is teacher_share x (stage 1 against it) + (1 - teacher_share) x (stage 2 against
    the target): 1 = stage 1 alone, in between = the blend (both on the same logits).
    With a draft vocabulary, data tokens outside it are left out of the CE term and
    counted (`oov_slots`, `oov_share` of valid slots). The loss runs over `chunk_rows`
    slot rows at a time (default: `dlite.losses.chunk_rows_for` the target vocabulary).
    `greedy_stop`: also the greedy replay's acceptance against the target at that stop
    probability (`dlite.losses.greedy_replay`)."""
    anchors, gamma, vocab = batch["anchors"], model.gamma, model.vocab
    if any(k.endswith("_blocks") for k in batch) and (teacher is not None or model.needs_history):
        raise ValueError("an `anchors`-storage batch has features at its anchors only: it trains "
                         "a history-free student against the target, not a teacher, DSpark "
                         "or distillation")
    logits = model.forward_train(batch)
    targets, valid = block_targets(batch["input_ids"], anchors, gamma, batch.get("loss_mask"),
                                   batch.get("anchor_mask"), batch.get("seq_ids"), batch.get("branch_ids"))
    ce_valid = None
    if vocab.draft_ids is not None:
        targets = vocab.to_draft(targets)  # -1: outside the draft vocabulary, not learnable
        ce_valid = None if spec.ce_target_argmax else targets >= 0
    share = 0.0 if teacher is None else teacher_share
    loss, m = 0.0, None
    if share < 1:  # stage 2: the target
        ref = reference_rows(batch, anchors, gamma, vocab)
        loss2, m = dlite_loss(logits, targets, valid, ref, spec.ce_weight, spec.tv_weight, spec.loss_decay,
                              ce_valid, chunk_rows, ref_labels=spec.ce_target_argmax, greedy_stop=greedy_stop)
        loss = (1 - share) * loss2
    if share > 0:  # stage 1: the teacher
        ref = reference_rows(batch, anchors, gamma, vocab, teacher)
        terms = (0.0, 0.0, spec.kl_weight) if spec.distill_kl else (spec.ce_weight, spec.tv_weight, 0.0)
        loss1, m1 = dlite_loss(logits, targets, valid, ref, terms[0], terms[1], spec.loss_decay, ce_valid,
                               chunk_rows, kl_weight=terms[2])
        loss = loss + share * loss1
        m = m1 if m is None else {**m, "stage1_loss": m1["loss"], "stage1_kl": m1["kl"]}
    m = {**m, "loss": float(loss.detach()), "teacher_share": share}
    if vocab.draft_ids is None:
        return loss, m
    oov = int((valid & (targets < 0)).sum())
    return loss, {**m, "oov_slots": oov, "oov_share": oov / max(1, m["valid_slots"])}


def walk_runs(kept: dict, runs) -> tuple:
    """(tokens, rounds) of a greedy replay over supervised runs [start, end), given each
    anchor's kept drafts: a run's first token is the first round's anchor (the token the
    prefill gave), a round at anchor a yields kept[a] drafts + the bonus token, and the
    next round starts where that left off, until the run's last token."""
    tokens = rounds = 0
    for start, end in runs:
        a = start
        while a < end - 1:
            step = min(max(kept.get(a, 0), 0) + 1, end - 1 - a)
            tokens, rounds, a = tokens + step, rounds + 1, a + step
    return tokens, rounds


def walkable(rows) -> bool:
    """Whether `replay_walk` can score `rows`: not rows that keep features at their
    anchors only (`anchors` storage), where other positions cannot be scored."""
    return bool(rows) and not any(r.get("fixed_anchors") for r in rows)


@torch.no_grad()
def replay_walk(model, rows, stop_prob: float, anchors_per_call: int = 256) -> tuple:
    """The evaluation's greedy replay, teacher forced, on validation rows (`walkable`):
    every supervised position scored as a block (`greedy_replay` at `stop_prob`), each
    run of supervised tokens (a forked row's branch: one answer after its recorded
    history) walked as the replay decodes it (`walk_runs`). Returns (tokens, rounds),
    sums that ranks walking parts of the rows can add; tokens / rounds is
    `val_tau_replay`. The mean over sampled blocks (`val_tau_greedy`) counts a long
    accepted run once per position in it, where the replay crosses it in one round."""
    from dlite.data.anchors import candidate_anchors, supervised_runs
    from dlite.train.data import collate
    from dlite.train.loop import to_device
    device, tokens, rounds = next(model.parameters()).device, 0, 0
    for r in rows:
        cand, kept = candidate_anchors(r["loss_mask"]), {}
        for i in range(0, len(cand), anchors_per_call):
            a = cand[i:i + anchors_per_call]
            batch = to_device(collate([{**r, "anchors": a}]), device)
            _, m = compute_loss(model, batch, greedy_stop=stop_prob)
            kept.update(zip(a.tolist(), m["greedy_kept"][:len(a)].tolist()))
        t, n = walk_runs(kept, supervised_runs(r["loss_mask"]))
        tokens, rounds = tokens + t, rounds + n
    return tokens, rounds


def _val_sums(model, batches, stop_prob: float) -> torch.Tensor:
    """Validation's additive totals over `batches`, float64: [loss x weight, weight,
    valid slots, out-of-vocabulary slots, greedy accepted, greedy blocks, then per slot
    k the pooled acceptance (estimate x valid count) and the valid count]."""
    out = None
    for batch in batches:
        _, m = compute_loss(model, batch, greedy_stop=stop_prob)
        n = torch.tensor(m["valid_at_k"], dtype=torch.float64)
        a = torch.tensor(m["accept_est_at_k"], dtype=torch.float64) * n
        x = torch.cat([torch.tensor([m["loss"] * m["loss_weight"], m["loss_weight"], m["valid_slots"],
                                     m.get("oov_slots", 0), m["greedy_accepted"], m["greedy_blocks"]],
                                    dtype=torch.float64), a, n])
        out = x if out is None else out + x
    if out is None:
        raise ValueError("no validation batches")
    return out


@torch.no_grad()
def validate(model, batches, stop_prob: float = 0.0, walk_rows=None, part=(0, 1), reduce=None) -> dict:
    """Teacher-forced validation against the target over fixed batches (stored anchors):
    `val_loss`, per-slot `val_accept_at_k_j` and `val_tau` = expected accepted length
    built from them -- exactly the one-batch `tau_est` / loss of all batches together:
    slot k's acceptance pooled by its valid count, the loss by its position weights;
    with a draft vocabulary also `val_oov_share` (valid slots whose data token lies
    outside it). `val_tau_greedy`: the mean accepted length of a greedy replay of the
    same blocks, each cut by the evaluation's stop rule at `stop_prob`
    (`eval.draft_stop_prob`) -- the in-training figure of what the evaluation's greedy
    tau measures, where `val_tau` is a soft (T = 1) estimate of full blocks. With
    `walk_rows` (the rows of `batches`), `val_tau_replay`: `replay_walk`'s tokens per
    round over them (absent when the rows are not `walkable`).

    `part` = (rank, world) with `reduce` (a sum over ranks, e.g. an all-reduce): rank r
    scores batches r, r + world, ... and walks rows r, r + world, ..., and the totals are
    summed, so the ranks share one validation instead of each repeating it (the same
    figures up to float64 summation order). Every rank must call it. Batches (or walk
    rows) fewer than the ranks are scored by every rank and counted once."""
    rank, world = part if reduce is not None else (0, 1)
    walk = walkable(walk_rows)
    split_batches, split_walk = len(batches) >= world, walk and len(walk_rows) >= world
    was_training, model = model.training, model.eval()
    sums = _val_sums(model, batches[rank::world] if split_batches else batches, stop_prob)
    if not split_batches and rank > 0:
        sums.zero_()  # rank 0's copy is the one counted
    t = (0, 0)
    if walk and (split_walk or rank == 0):
        t = replay_walk(model, walk_rows[rank::world] if split_walk else walk_rows, stop_prob)
    sums = torch.cat([sums, torch.tensor(t, dtype=torch.float64)])
    model.train(was_training)
    if world > 1:
        sums = reduce(sums)
    gamma = (len(sums) - 8) // 2  # slots per block
    loss_sum, w_sum, slots, oov, greedy, blocks = sums[:6].tolist()
    accept, n_at_k = sums[6:6 + gamma], sums[6 + gamma:6 + 2 * gamma]
    tokens, rounds = sums[-2:].tolist()
    if not slots:
        raise ValueError("validation batches hold no valid slot")
    accept = (accept / n_at_k.clamp_min(1)).tolist()
    tau = expected_tau(accept)
    extra = {} if model.vocab.draft_ids is None else {"val_oov_share": oov / slots}
    return {"val_loss": loss_sum / w_sum, "val_tau": tau,
            "val_tau_greedy": 1 + greedy / max(1, blocks), **extra,
            **({"val_tau_replay": tokens / rounds} if walk and rounds else {}),
            **{f"val_accept_at_k_{i + 1}": a for i, a in enumerate(accept)}}
