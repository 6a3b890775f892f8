"""The history-aware intermediate teacher (training stage 1): exactly the DLite drafter
(same backbone, context feature and sequential head, same parameter names) plus the
history path of `dlite.models.history` (all of the history, or the last
`drafter.history_window` positions: the authors' sliding-window teacher). Its shared
weights then initialise the history-free student (`init_student_from_teacher`), or its
sequential head alone is copied into a student trained from scratch (`copy_head`, the
published recipe)."""

from typing import List, Optional

import torch
from torch import nn

from dlite.models.common import as_batched, block_inputs, block_layout, embed_in, gather_positions, init_weights
from dlite.models.config import DrafterConfig
from dlite.models.heads import (build_student_parts, context_keys, context_kv, context_states, draft_tokens,
                                head_logits)
from dlite.models.history import (HistoryCache, PrefixedMemory, extend_history,
                                  packed_block_mask, packed_history_kv)
from dlite.models.layers import RMSNorm, StaticMemory


class HistoryTeacher(nn.Module):
    """DLite + history KV injection. At inference it keeps a real HistoryCache."""

    needs_history = True

    def __init__(self, cfg: DrafterConfig, embed_weight: torch.Tensor,
                 lm_head_weight: torch.Tensor, mask_token_id: int, draft_vocab=None):
        super().__init__()
        build_student_parts(self, cfg, embed_weight, lm_head_weight, mask_token_id, draft_vocab)
        self.hist_proj = nn.Linear(self.feature_dim, cfg.hidden_size, bias=False)
        self.hist_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        init_weights(self)

    def forward_train(self, batch: dict) -> torch.Tensor:
        """All A blocks of a sequence in one forward: keys = [history L | context A (kv
        injection) or A*K (slots) | blocks A*g], masked by `packed_block_mask`."""
        batch, single = as_batched(batch)
        lay = block_layout(batch, self.gamma, self.vocab.mask_token_id)
        B, A, g = lay["block_ids"].shape
        kv = packed_history_kv(self, batch)
        c = context_states(self, gather_positions(batch["features"], lay["ctx_idx"]))
        x = embed_in(self, lay["block_ids"].reshape(B, A * g))
        if self.cfg.context_injection == "add":
            x = x + c.repeat_interleave(g, dim=1)
        else:
            ckv = context_kv(self, c, lay["ctx_pos"])
            kv = [(torch.cat([hk, ck], 2), torch.cat([hv, cv], 2))
                  for (hk, hv), (ck, cv) in zip(kv, ckv)]
        mask = packed_block_mask(batch, g, context_keys(self.cfg), self.cfg.history_window)
        h = self.backbone(x, lay["block_pos"].reshape(B, A * g), StaticMemory(kv), mask)
        logits = head_logits(self, h.reshape(B * A, g, -1), lay["prev_ids"].reshape(B * A, g))
        logits = logits.view(B, A, g, -1)
        return logits[0] if single else logits

    def new_state(self) -> HistoryCache:
        w = self.hist_proj.weight
        return HistoryCache(self.backbone, w.dtype, w.device, reserve=self.gamma + 1,
                            window=self.cfg.history_window)

    @torch.no_grad()
    def draft(self, state: HistoryCache, new_features: torch.Tensor, anchor_id: int,
              anchor_pos: int, temperature: float, generator: Optional[torch.Generator] = None):
        """Extend the history cache with the new rows, then draft like DLite with the
        cache (and the context key) in front of the block's own keys."""
        feats = new_features.reshape(-1, self.feature_dim)
        extend_history(self, state, feats, anchor_pos)
        x, pos = block_inputs(self, anchor_id, anchor_pos, feats.device)
        c = context_states(self, feats[-1:])
        if self.cfg.context_injection == "add":
            x, mem = x + c[:, None], state
        else:
            mem = PrefixedMemory(state, context_kv(self, c[:, None], pos[:, :1] - 1))
        h = self.backbone(x, pos, mem)
        tokens, probs = draft_tokens(self, h, anchor_id, temperature, generator)
        return tokens, probs, state

    def cache_bytes(self, state: Optional[HistoryCache]) -> int:
        return 0 if state is None else state.nbytes()


def init_student_from_teacher(student: nn.Module, teacher: nn.Module, strict: bool = True) -> dict:
    """Copy every teacher weight the student also has (same name and shape). Returns
    copied / skipped (teacher-only: the history path, or a shape mismatch) / missing
    (student weights left at their init); strict refuses a partial init, before copying.
    The MASK mode and draft vocabulary must agree: the learned `vocab.mask_embed` is a
    shared weight and is copied, but the student's sliced lm_head was built from its own
    draft ids, so copying different ids over them would leave it stale."""
    _check_same_vocab(student.vocab, teacher.vocab)
    s_state, t_state = student.state_dict(), teacher.state_dict()
    copied = [n for n, v in t_state.items() if n in s_state and s_state[n].shape == v.shape]
    skipped = [n for n in t_state if n not in set(copied)]
    missing = sorted(set(s_state) - set(copied))
    if strict and missing:
        raise ValueError(f"student weights with no teacher counterpart (different head or "
                         f"sizes?): {missing[:5]}")
    with torch.no_grad():
        for name in copied:
            s_state[name].copy_(t_state[name])
    return {"copied": copied, "skipped": skipped, "missing": missing}


def _check_same_vocab(s, t) -> None:
    if s.mask_token_id != t.mask_token_id:
        raise ValueError(f"student mask_token_id {s.mask_token_id} != teacher's {t.mask_token_id}")
    same = (s.draft_ids is None and t.draft_ids is None) or (
        s.draft_ids is not None and t.draft_ids is not None
        and s.draft_ids.shape == t.draft_ids.shape and bool((s.draft_ids == t.draft_ids.to(s.draft_ids.device)).all()))
    if not same:
        raise ValueError("student and teacher have different draft vocabularies: build the "
                         "student with the teacher's (`teacher.vocab.draft_ids`)")


# The sequential head of each design (by `cfg.arch`): what recipe "published" copies
# from the teacher and freezes for stage 1 (the authors freeze their whole
# `sequential_head`, its own r -> V output projection included; ours projects through
# the frozen target lm_head). `dlite.train.optim.adamw` gives it a parameter group of its own.
HEAD_MODULES = {"dlite": "head.", "teacher": "head.", "dlite_v1": "sequential_head."}


def head_prefix(model) -> Optional[str]:
    return HEAD_MODULES.get(getattr(getattr(model, "cfg", None), "arch", None))


def head_parameters(model) -> list:
    """The parameters of the model's sequential head (`HEAD_MODULES`; none for DSpark)."""
    prefix = head_prefix(model)
    return [p for n, p in model.named_parameters() if prefix and n.startswith(prefix)]


def copy_head(student, teacher) -> List[str]:
    """Copy the teacher's sequential head into the student (recipe "published"): same
    names and shapes required, every head weight of the student covered. Returns the names."""
    _check_same_vocab(student.vocab, teacher.vocab)
    prefix = head_prefix(student)
    s_state, t_state = student.state_dict(), teacher.state_dict()
    names = [n for n in s_state if prefix and n.startswith(prefix)]
    bad = [n for n in names if n not in t_state or t_state[n].shape != s_state[n].shape]
    if not names or bad:
        raise ValueError(f"train.recipe=published copies the teacher's sequential head ({prefix}*), but "
                         f"the teacher lacks or differs in {bad[:4] or 'all of it'}: same drafter.head / "
                         f"head_hidden / sizes needed")
    with torch.no_grad():
        for n in names:
            s_state[n].copy_(t_state[n])
    return names
