"""Batch-1 KV caches stacked into one batched cache for a regeneration turn and split
back afterwards (`dlite.decoding.regenerate`): rows right-aligned (left padding) under a
[B, width] validity mask, room reserved so a decode step writes in place, rows dropped
as they finish, and a row's valid columns taken out again as a batch-1 cache of its own.
The mask also hides columns a row wrote but did not keep (draft tokens the target
rejected), so rows that accept different numbers of tokens share one cache."""

from typing import List

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer


class Reserved(DynamicLayer):
    """Keys/values of one layer of a batched decode, with room for more positions: each
    step writes its columns in place, where DynamicLayer concatenates (copies) the whole
    cache (SmolLM2, 4 rows at 1.2K: ~220 MB a step, a quarter of its time). Out of room,
    the room doubles (one copy), so a long turn still costs O(log) copies."""

    @classmethod
    def holding(cls, keys: torch.Tensor, values: torch.Tensor, extra: int) -> "Reserved":
        layer = cls()
        layer._fill(keys, values, extra)
        layer.is_initialized, layer.device = True, keys.device
        return layer

    def _fill(self, keys: torch.Tensor, values: torch.Tensor, extra: int) -> None:
        b, h, n, d = keys.shape
        self.buf = (keys.new_empty(b, h, n + extra, d), values.new_empty(b, h, n + extra, d))
        self.buf[0][:, :, :n], self.buf[1][:, :, :n] = keys, values
        self.keys, self.values = self.buf[0][:, :, :n], self.buf[1][:, :, :n]

    def update(self, key_states, value_states, *args, **kwargs):
        n, m = self.keys.shape[-2], key_states.shape[-2]
        if n + m > self.buf[0].shape[-2]:
            self._fill(self.keys, self.values, max(n, m))
        self.buf[0][:, :, n:n + m], self.buf[1][:, :, n:n + m] = key_states, value_states
        self.keys, self.values = self.buf[0][:, :, :n + m], self.buf[1][:, :, :n + m]
        return self.keys, self.values


def stack(caches: list, lens: List[int], extra: int):
    """One batched cache, each row's keys/values right-aligned (left padding), with room
    for `extra` positions, + its validity mask [B, width] (long, 1 = a real column)."""
    width = max(lens)
    out = DynamicCache()
    for j in range(len(caches[0].layers)):
        ks, vs = [], []
        for c, n in zip(caches, lens):
            pad = (0, 0, width - n, 0)  # the sequence axis is -2
            ks.append(torch.nn.functional.pad(c.layers[j].keys, pad))
            vs.append(torch.nn.functional.pad(c.layers[j].values, pad))
        out.layers.append(Reserved.holding(torch.cat(ks), torch.cat(vs), extra))
    mask = torch.zeros(len(lens), width, dtype=torch.long)
    for i, n in enumerate(lens):
        mask[i, width - n:] = 1
    return out, mask


def select(cache, keep: List[int]) -> None:
    """Keep batch rows `keep` of a stacked cache (a copy of those rows, room included)."""
    idx = torch.tensor(keep, device=cache.layers[0].keys.device)
    for layer in cache.layers:
        n = layer.keys.shape[-2]
        layer.buf = (layer.buf[0][idx], layer.buf[1][idx])
        layer.keys, layer.values = layer.buf[0][:, :, :n], layer.buf[1][:, :, :n]


def unstack(cache, i: int, cols) -> DynamicCache:
    """Row i's columns `cols` (a slice, or the indices of its valid columns in order) of
    a (batched) cache, as a batch-1 cache of its own (a copy: the source may be cropped
    or written later)."""
    out, view = DynamicCache(), isinstance(cols, slice)  # index tensors copy already
    for j, layer in enumerate(cache.layers):
        k, v = layer.keys[i:i + 1, :, cols], layer.values[i:i + 1, :, cols]
        out.update(k.clone() if view else k, v.clone() if view else v, j)
    return out
