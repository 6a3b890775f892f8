"""The history-aware intermediate teacher (training stage 1): exactly the DLite drafter
(same backbone, context feature and sequential head, same parameter names) plus a
history path -- the projected target features of every position before the anchor,
injected as extra keys/values in every layer (DFlash style). Its shared weights then
initialise the history-free student (`init_student_from_teacher`).

The history path itself (packed training mask, drafter-side HistoryCache) is defined
here and reused by the DSpark-style baseline, which has the same history injection."""

from typing import List, Optional, Tuple

import torch
from torch import nn

from dlite.models.common import (Backbone, RMSNorm, StaticMemory, as_batched, block_layout,
                                 gather_positions, init_weights)
from dlite.models.config import DrafterConfig
from dlite.models.drafter import (block_inputs, build_student_parts, context_states, draft_tokens,
                                  embed_in, head_logits)

def packed_block_mask(batch: dict, gamma: int, n_ctx: int) -> torch.Tensor:
    """Bool mask [B, 1, A*g, L + A*n_ctx + A*g] for packing all blocks of a sequence in
    one forward: a block sees history positions < its anchor (same segment only),
    its own context key(s), and its own block bidirectionally -- never other blocks."""
    anchors, L = batch["anchors"], batch["input_ids"].shape[1]
    B, A = anchors.shape
    dev = anchors.device
    qb = torch.arange(A, device=dev).repeat_interleave(gamma)      # block of each query
    q_anchor = anchors[:, qb]                                      # [B, A*g]
    hist = torch.arange(L, device=dev)[None, None, :] < q_anchor[..., None]
    seg = batch.get("seq_ids")
    if seg is not None:
        hist = hist & (seg[:, None, :] == gather_positions(seg, q_anchor)[..., None])

    def own(n):  # keys owned by the query's block, n per block
        owner = torch.arange(A, device=dev).repeat_interleave(n)
        return (qb[:, None] == owner[None, :]).expand(B, -1, -1)
    parts = [hist] + ([own(n_ctx)] if n_ctx else []) + [own(gamma)]
    return torch.cat(parts, dim=-1)[:, None]


class HistoryCache:
    """A drafter-side per-layer KV cache of the projected target history (DFlash /
    DSpark style). Grows with the context (capacity doubles); the block's own entries
    are written after `length` and never committed, which crops them for free."""

    def __init__(self, backbone: Backbone, dtype, device, reserve: int):
        self.n_layers, self.dtype, self.device = len(backbone.layers), dtype, device
        self.kv_shape = (backbone.cfg.num_kv_heads, backbone.cfg.head_dim)
        self.reserve, self.length, self.capacity = reserve, 0, 0
        self.k: List[torch.Tensor] = []
        self.v: List[torch.Tensor] = []

    def _grow(self, need: int):
        if need <= self.capacity:
            return
        cap = max(need, 2 * self.capacity, 256)
        cap = (cap + 255) // 256 * 256
        shape = (1, self.kv_shape[0], cap, self.kv_shape[1])
        k = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(self.n_layers)]
        v = [torch.zeros_like(t) for t in k]
        for i in range(len(self.k)):
            k[i][:, :, :self.length] = self.k[i][:, :, :self.length]
            v[i][:, :, :self.length] = self.v[i][:, :, :self.length]
        self.k, self.v, self.capacity = k, v, cap

    def extend(self, kv: List[Tuple[torch.Tensor, torch.Tensor]]):
        n = kv[0][0].shape[2]
        self._grow(self.length + n + self.reserve)
        for i, (k, v) in enumerate(kv):
            self.k[i][:, :, self.length:self.length + n] = k
            self.v[i][:, :, self.length:self.length + n] = v
        self.length += n

    def join(self, layer: int, k, v):
        end = self.length + k.shape[2]
        self._grow(end)
        self.k[layer][:, :, self.length:end] = k
        self.v[layer][:, :, self.length:end] = v
        return self.k[layer][:, :, :end], self.v[layer][:, :, :end]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)


def history_states(model, feats):
    """Project target features [..., K*H_t] into history states (teacher / DSpark)."""
    return model.hist_norm(model.hist_proj(feats.to(model.hist_proj.weight.dtype)))


def extend_history(model, cache: HistoryCache, feats, anchor_pos: int):
    """Append the newly verified positions anchor_pos-n..anchor_pos-1 to the cache;
    refuse a gap or overlap, which would silently shift every key's position."""
    n = feats.shape[0]
    if cache.length != anchor_pos - n:
        raise ValueError(f"history cache holds {cache.length} positions but new features "
                         f"start at {anchor_pos - n} (anchor_pos={anchor_pos}, n={n})")
    pos = torch.arange(anchor_pos - n, anchor_pos, device=feats.device)[None]
    cache.extend(model.backbone.memory_kv(history_states(model, feats)[None], pos))


class PrefixedMemory:
    """Puts extra per-layer keys (e.g. the context key) in front of a block's keys
    before handing them to an inner memory such as a HistoryCache."""

    def __init__(self, inner, kv):
        self.inner, self.kv = inner, kv

    def join(self, layer: int, k, v):
        pk, pv = self.kv[layer]
        return self.inner.join(layer, torch.cat([pk, k], 2), torch.cat([pv, v], 2))


def packed_history_kv(model, batch: dict):
    """Per-layer K/V of the whole sequence's history states (positions 0..L-1); the
    packed mask later restricts each block to the positions before its anchor."""
    ids = batch["input_ids"]
    pos = batch.get("position_ids")
    if pos is None:
        pos = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)
    return model.backbone.memory_kv(history_states(model, batch["features"]), pos)


class HistoryTeacher(nn.Module):
    """DLite + history KV injection. At inference it keeps a real HistoryCache."""

    needs_history = True

    def __init__(self, cfg: DrafterConfig, embed_weight: torch.Tensor,
                 lm_head_weight: torch.Tensor, mask_token_id: int):
        super().__init__()
        build_student_parts(self, cfg, embed_weight, lm_head_weight, mask_token_id)
        self.hist_proj = nn.Linear(self.feature_dim, cfg.hidden_size, bias=False)
        self.hist_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        init_weights(self)

    def forward_train(self, batch: dict) -> torch.Tensor:
        """All A blocks of a sequence in one forward: keys = [history L | context A
        (kv injection only) | blocks A*g], masked by `packed_block_mask`."""
        batch, single = as_batched(batch)
        lay = block_layout(batch, self.gamma, self.vocab.mask_token_id)
        B, A, g = lay["block_ids"].shape
        kv = packed_history_kv(self, batch)
        c = context_states(self, gather_positions(batch["features"], lay["ctx_idx"]))
        x = embed_in(self, lay["block_ids"].reshape(B, A * g))
        n_ctx = 0
        if self.cfg.context_injection == "add":
            x = x + c.repeat_interleave(g, dim=1)
        else:
            ckv = self.backbone.memory_kv(c, lay["ctx_pos"])
            kv = [(torch.cat([hk, ck], 2), torch.cat([hv, cv], 2))
                  for (hk, hv), (ck, cv) in zip(kv, ckv)]
            n_ctx = 1
        mask = packed_block_mask(batch, g, n_ctx)
        h = self.backbone(x, lay["block_pos"].reshape(B, A * g), StaticMemory(kv), mask)
        logits = head_logits(self, h.reshape(B * A, g, -1), lay["prev_ids"].reshape(B * A, g))
        logits = logits.view(B, A, g, -1)
        return logits[0] if single else logits

    def new_state(self) -> HistoryCache:
        w = self.hist_proj.weight
        return HistoryCache(self.backbone, w.dtype, w.device, reserve=self.gamma + 1)

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
            mem = PrefixedMemory(state, self.backbone.memory_kv(c[:, None], pos[:, :1] - 1))
        h = self.backbone(x, pos, mem)
        tokens, probs = draft_tokens(self, h, anchor_id, temperature, generator)
        return tokens, probs, state

    def cache_bytes(self, state: Optional[HistoryCache]) -> int:
        return 0 if state is None else state.nbytes()


def init_student_from_teacher(student: nn.Module, teacher: nn.Module, strict: bool = True) -> dict:
    """Copy every teacher weight the student also has (same name and shape). Returns
    copied / skipped (teacher-only: the history path, or a shape mismatch) / missing
    (student weights left at their init); strict refuses a partial init, before copying."""
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
