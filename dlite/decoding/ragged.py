"""A KV cache of B rows holding different requests of different lengths: what lets one
target forward verify every row's block (`dlite.decoding.batch`).

Layout: left-aligned. Row b's valid entries are slots 0..len_b-1, holding positions
0..len_b-1 (slot index == position, always); slots len_b..L-1 (L = the longest row)
are padding, masked out of attention. A round appends n slots to every row at
L..L+n-1 (row b's block: anchor + drafts, padded to n); after verification row b keeps
its first `kept_b` new slots, which are moved down to len_b..len_b+kept_b-1, and the
cache is cut back to the new longest row. Per round that moves only the kept tail (a
few slots per row), never a row's history; the cost of raggedness is the padding each
shorter row carries (attention over masked slots), reported by `padding_share`.

The alternative, rejected slots left in place and masked ("holes"), would need no move
but grows the cache by n slots per round for every row and needs compaction later.

A round may verify a token tree per row instead of a chain (`positions(depths=)`,
`mask(within=)`): row b keeps the slots of its accepted path, gathered behind its
history (`commit` with a list of slots).

A finished row is refilled with the next request's prefill (`place`): its entries are
copied into the row's slots (the cache grows to the new row's length if it is longer).
Rows with no request left are removed (`drop_rows`), so a draining batch shrinks as a
serving engine's does.

Works on transformers' DynamicCache (`layers[i].keys/values` [B, H, L, D]), whose
full-attention layers are swapped for `SlackLayer`s (`dlite.decoding.slack`):
DynamicLayer appends by concatenation, which copies the whole cache on every forward
(8 rows x 8K tokens of SmolLM2 in fp32: 3 GB per decoding step, most of a batched plain
step on 2 cores), a cost no paged serving engine has and one that would flatter
speculation (fewer forwards). A target that makes its own cache (`dlite.bench.qwen3`)
or has sliding-window layers is refused with a clear error."""

from typing import List, Sequence

import torch

from dlite.decoding.slack import slack_cache


def _layers(cache) -> list:
    layers = getattr(cache, "layers", None)
    if layers is None or not all(hasattr(la, "keys") for la in layers):
        raise TypeError(f"batched decoding needs a transformers DynamicCache, got {type(cache).__name__}")
    return layers


class RaggedCache:
    """B rows of one DynamicCache with per-row lengths (`lengths[b]`; 0: an empty row)."""

    def __init__(self, target, rows: int, reserve: int = 0):
        """`reserve`: slots per row to allocate at once (the longest prompt + new tokens
        + a block), so the cache never reallocates (a reallocation copies every row)."""
        self.cache, self.lengths = slack_cache(target), [0] * rows
        self.reserve, self.per_slot, self._ready = reserve, 0, False

    @property
    def rows(self) -> int:
        return len(self.lengths)

    @property
    def length(self) -> int:
        """L: slots per row (the longest row's length)."""
        return _layers(self.cache)[0].keys.shape[-2] if self._ready else 0

    def _init_like(self, src) -> None:
        for mine, theirs in zip(_layers(self.cache), _layers(src)):
            k, v = theirs.keys, theirs.values
            shape = (self.rows, k.shape[1], 0, k.shape[3])
            mine.lazy_initialization(k, v)
            mine.keys, mine.values = k.new_zeros(shape), v.new_zeros(shape)
            mine.reserve(max(self.reserve, k.shape[-2]))
            self.per_slot += k[0, :, :1].nbytes + v[0, :, :1].nbytes
        self._ready = True

    def _grow(self, length: int) -> None:
        if length > self.length:
            for la in _layers(self.cache):
                la.widen(length)

    def _shrink(self) -> None:
        keep = max(self.lengths, default=0)
        if self._ready and keep < self.length:
            self.cache.crop(keep - self.length)

    def place(self, row: int, src) -> None:
        """Row `row` := the one-row cache `src` (a prefill's; read, never changed)."""
        n = _layers(src)[0].keys.shape[-2]
        if not self._ready:
            self._init_like(src)
        self._grow(n)
        for mine, theirs in zip(_layers(self.cache), _layers(src)):
            mine.keys[row, :, :n] = theirs.keys[0]
            mine.values[row, :, :n] = theirs.values[0]
        self.lengths[row] = n
        self._shrink()

    def release(self, row: int) -> None:
        """Row `row` holds no request any more (its slots become padding)."""
        self.lengths[row] = 0
        self._shrink()

    def drop_rows(self, keep: Sequence[int]) -> None:
        """Keep only rows `keep`, row j := old row keep[j]: a draining batch gets smaller.
        In place: each moved row copies its own valid slots, then the batch is cut to
        len(keep) rows (a view). Callers pass keep[j] == j wherever they can (fill the
        holes with the last rows), so a drop moves one row per hole, not the cache; the
        old way (a gather of every row, then a copy into a new buffer) moved the whole
        cache twice on every drop, most of a draining batch's time at 16 rows."""
        keep = list(keep)
        moves = [(j, src) for j, src in enumerate(keep) if src != j]
        if self._ready and moves:
            for la in _layers(self.cache):
                # a source that is also a destination is read before anything is written
                saved = {src: (la.keys[src, :, :self.lengths[src]].clone(), la.values[src, :, :self.lengths[src]].clone())
                         for _, src in moves if src < len(keep)}
                for j, src in moves:
                    n = self.lengths[src]
                    k, v = saved.get(src) or (la.keys[src, :, :n], la.values[src, :, :n])
                    la.keys[j, :, :n], la.values[j, :, :n] = k, v
        if self._ready:
            for la in _layers(self.cache):
                la.first_rows(len(keep))
        self.lengths = [self.lengths[i] for i in keep]
        self._shrink()

    def positions(self, n: int, device, depths: torch.Tensor = None) -> torch.Tensor:
        """[B, n]: each row's next n positions (row b's block starts at len_b); `depths`
        [B, n]: each slot's offset from its row's start instead (a token tree's depths)."""
        start = torch.tensor(self.lengths, device=device)[:, None]
        return start + (torch.arange(n, device=device)[None] if depths is None else depths.to(device))

    def mask(self, n: int, dtype, device, within: torch.Tensor = None) -> torch.Tensor:
        """Additive [B, 1, n, L + n]: row b's queries see its own len_b slots, then its
        block causally (`within` [B, n, n] bool: which block slots each slot sees
        instead, a token tree's ancestors); padding slots of shorter rows are never seen."""
        L = self.length
        k = torch.arange(L + n, device=device)
        hist = k[None] < torch.tensor(self.lengths, device=device)[:, None]           # [B, L+n]
        if within is None:
            within = (torch.arange(n, device=device)[None] <= torch.arange(n, device=device)[:, None])[None]
        allowed = torch.zeros(len(self.lengths), n, L + n, dtype=torch.bool, device=device)
        allowed[..., :L] = hist[:, None, :L]
        allowed[..., L:] = within.to(device)
        out = torch.zeros(allowed.shape, dtype=dtype, device=device)
        return out.masked_fill_(~allowed, torch.finfo(dtype).min)[:, None]

    def commit(self, n: int, kept: Sequence) -> None:
        """After a forward of n slots per row at L..L+n-1 (L before it): row b keeps its
        first kept[b] of them, or (a list) the slots at those offsets in that order (a
        token tree's accepted path), moved to follow its history; the rest is dropped."""
        L = self.length - n
        picks = [k if isinstance(k, list) else list(range(k)) for k in kept]
        for la in _layers(self.cache):
            for b, (start, idx) in enumerate(zip(self.lengths, picks)):
                if not idx or (start == L and idx == list(range(len(idx)))):
                    continue  # already in place
                if idx == list(range(len(idx))):  # a prefix: one slice
                    la.keys[b, :, start:start + len(idx)] = la.keys[b, :, L:L + len(idx)].clone()
                    la.values[b, :, start:start + len(idx)] = la.values[b, :, L:L + len(idx)].clone()
                else:  # scattered slots: an index gather (a copy) first
                    src = torch.tensor([L + i for i in idx], device=la.keys.device)
                    la.keys[b, :, start:start + len(idx)] = la.keys[b][:, src]
                    la.values[b, :, start:start + len(idx)] = la.values[b][:, src]
        self.lengths = [s + len(idx) for s, idx in zip(self.lengths, picks)]
        self._shrink()

    def row_bytes(self, row: int) -> int:
        """KV bytes of row `row`'s own entries (its valid slots, every layer)."""
        return self.per_slot * self.lengths[row]

    def padding_share(self) -> float:
        """Share of the cache's slots that are padding (attention work on masked slots)."""
        total = self.rows * self.length
        return 1.0 - sum(self.lengths) / total if total else 0.0
