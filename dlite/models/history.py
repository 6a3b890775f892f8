"""The history path of the teacher and the DSpark-style baseline (DFlash style): the
projected target features of every position before the anchor become extra
keys/values of every layer -- a packed mask for training, a growing drafter-side
cache (`HistoryCache`) at inference."""

from typing import List, Optional, Tuple

import torch

from dlite.models.common import gather_positions
from dlite.models.layers import Backbone



def packed_block_mask(batch: dict, gamma: int, n_ctx: int, window: Optional[int] = None) -> torch.Tensor:
    """Bool mask [B, 1, A*g, L + A*n_ctx + A*g] for packing all blocks of a sequence in
    one forward: a block sees history positions < its anchor (same segment only; with
    `window`, only the last `window` of them: anchor-window..anchor-1, the authors'
    sliding-window teacher), its own context key(s), and its own block bidirectionally
    -- never other blocks."""
    anchors, L = batch["anchors"], batch["input_ids"].shape[1]
    B, A = anchors.shape
    dev = anchors.device
    qb = torch.arange(A, device=dev).repeat_interleave(gamma)      # block of each query
    q_anchor = anchors[:, qb]                                      # [B, A*g]
    pos = torch.arange(L, device=dev)[None, None, :]
    hist = pos < q_anchor[..., None]
    if window is not None:
        hist = hist & (pos >= q_anchor[..., None] - window)
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
    are written after `length` and never committed, which crops them for free. With
    `window`, `join` hands attention only the last `window` history positions (the
    cache still holds all: the window slides over it)."""

    def __init__(self, backbone: Backbone, dtype, device, reserve: int, window: Optional[int] = None):
        self.n_layers, self.dtype, self.device = len(backbone.layers), dtype, device
        self.window = window
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
        start = 0 if self.window is None else max(0, self.length - self.window)
        return self.k[layer][:, :, start:end], self.v[layer][:, :, start:end]

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
