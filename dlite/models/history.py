"""The history path of the teacher and the DSpark-style baseline (DFlash style): the
projected target features of every position before the anchor become extra
keys/values of every layer -- a packed mask for training, a growing drafter-side
cache (`HistoryCache`) at inference, and the backbone run for B blocks over B such
caches at once (`extend_histories`, `rows_forward`: batched drafting)."""

from typing import List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F

from dlite.models.common import gather_positions
from dlite.models.layers import Attention, Backbone



def packed_block_mask(batch: dict, gamma: int, n_ctx: int, window: Optional[int] = None) -> torch.Tensor:
    """Bool mask [B, 1, A*g, L + A*n_ctx + A*g] for packing all blocks of a sequence in
    one forward: a block sees history positions < its anchor (same segment only; with
    `window`, only the last `window` of them: anchor-window..anchor-1, the authors'
    sliding-window teacher), its own context key(s), and its own block bidirectionally
    -- never other blocks. A forked row (`branch_ids`, `position_ids`) restricts the
    history further to the anchor's fork (`forked_history`)."""
    anchors, L = batch["anchors"], batch["input_ids"].shape[1]
    B, A = anchors.shape
    dev = anchors.device
    qb = torch.arange(A, device=dev).repeat_interleave(gamma)      # block of each query
    q_anchor = anchors[:, qb]                                      # [B, A*g]
    pos = torch.arange(L, device=dev)[None, None, :]
    hist = pos < q_anchor[..., None]
    if batch.get("branch_ids") is not None:
        hist = hist & forked_history(batch, q_anchor, window)
    elif window is not None:
        hist = hist & (pos >= q_anchor[..., None] - window)
    seg = batch.get("seq_ids")
    if seg is not None:
        hist = hist & (seg[:, None, :] == gather_positions(seg, q_anchor)[..., None])

    def own(n):  # keys owned by the query's block, n per block
        owner = torch.arange(A, device=dev).repeat_interleave(n)
        return (qb[:, None] == owner[None, :]).expand(B, -1, -1)
    parts = [hist] + ([own(n_ctx)] if n_ctx else []) + [own(gamma)]
    return torch.cat(parts, dim=-1)[:, None]


def forked_history(batch: dict, q_anchor: torch.Tensor, window: Optional[int] = None) -> torch.Tensor:
    """Bool [B, Q, L]: the keys a query anchored at index q_anchor [B, Q] may see in a
    forked row -- its own branch, or the trunk (branch 0) before its branch's fork, the
    position of the branch's first element; never another branch. With `window`, only
    keys whose position is >= the anchor's position - window: measured in positions, a
    branch's window reaches back into the trunk exactly as the unforked row's would.
    The caller adds the index cut (key < anchor) that keeps a branch's later elements out."""
    br, pos = batch["branch_ids"], batch.get("position_ids")
    if pos is None:
        raise ValueError("a forked row (branch_ids) needs its position_ids")
    B, L = br.shape
    # fork[b, k] = the smallest position of branch k in row b (branch ids < L always)
    fork = torch.full((B, L), torch.iinfo(pos.dtype).max, dtype=pos.dtype, device=pos.device)
    fork = fork.scatter_reduce(1, br, pos, "amin")
    q_br = gather_positions(br, q_anchor)
    k_br, k_pos = br[:, None, :], pos[:, None, :]
    seen = (k_br == q_br[..., None]) | ((k_br == 0) & (k_pos < fork.gather(1, q_br)[..., None]))
    if window is not None:
        seen = seen & (k_pos >= gather_positions(pos, q_anchor)[..., None] - window)
    return seen


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
    extend_histories(model, [cache], [feats], [anchor_pos])


def extend_histories(model, caches: Sequence[HistoryCache], feats: Sequence[torch.Tensor],
                     anchor_pos: Sequence[int]):
    """`extend_history` for B caches at once: feats[b] [n_b, K*H_t] are row b's newly
    verified positions anchor_pos[b]-n_b..anchor_pos[b]-1. The rows are concatenated
    so the projection reads its weights once, then split back into each row's cache.
    Every row is checked before any is extended: a refused call changes nothing."""
    ns = [f.shape[0] for f in feats]
    for cache, n, p in zip(caches, ns, anchor_pos):
        if cache.length != p - n:
            raise ValueError(f"history cache holds {cache.length} positions but new features "
                             f"start at {p - n} (anchor_pos={p}, n={n})")
    dev = feats[0].device
    pos = torch.cat([torch.arange(p - n, p, device=dev) for n, p in zip(ns, anchor_pos)])[None]
    kv = model.backbone.memory_kv(history_states(model, torch.cat(list(feats)))[None], pos)
    parts = [(k.split(ns, 2), v.split(ns, 2)) for k, v in kv]
    for b, cache in enumerate(caches):
        cache.extend([(ks[b], vs[b]) for ks, vs in parts])


def rows_forward(backbone: Backbone, x, positions, caches: Sequence[HistoryCache]):
    """`backbone(x, positions, cache)` for B blocks x [B, g, hid] at positions [B, g],
    row b over its own caches[b]. Norms, projections and MLPs run on all B*g slots at
    once; attention runs row by row where each cache lies (`HistoryCache.join` writes
    the block's g keys/values after the history and returns a view), so histories of
    any lengths are read in place: nothing padded, no history copied."""
    cos, sin = backbone.rope(positions, x.dtype)
    # DecoderLayer.forward's two residual steps, written out: its attention is one call
    # for the whole batch, which rows with histories of different lengths cannot share.
    for layer in backbone.layers:
        x = x + _rows_attention(layer.self_attn, layer.input_layernorm(x), cos, sin, caches)
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    return x


def _rows_attention(attn: Attention, x, cos, sin, caches: Sequence[HistoryCache]):
    """Attention.forward (no mask) with row b's keys joined to caches[b] alone. Each
    row's attention is the very call `draft` makes for that row on its own."""
    q, (k, v) = attn.query(x, cos, sin), attn.project_kv(x, cos, sin)
    gqa = attn.n_kv != attn.n_heads
    rows = [(q[b:b + 1], *c.join(attn.layer_idx, k[b:b + 1], v[b:b + 1])) for b, c in enumerate(caches)]
    return attn.out(torch.cat([F.scaled_dot_product_attention(*row, enable_gqa=gqa) for row in rows]), x.shape)


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
