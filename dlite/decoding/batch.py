"""Batched speculative decoding, closed loop: B requests with different histories in
one ragged KV cache (`dlite.decoding.ragged`), every row's block verified in ONE target
forward per round, a finished row refilled with the next request (as a serving engine
keeps its batch full). Plain decoding is the same loop with nothing drafted, so the
baseline at concurrency B is batched the same way (never batch-1 plain against batched
speculation).

One round:
1. draft: a drafter with `draft_rows` (DLite: history-free, so the B rows are just B
   anchors and features) drafts every row sharing it in one pass, as does one with
   `draft_history_rows` (DSpark-style: each row's own history cache, extended by its
   newly verified positions); any other drafter (prompt lookup, SuffixDecoding, the
   choose hybrids) drafts row by row with its own per-request state;
2. verify: the blocks [anchor, drafts] padded to the longest (n tokens), at each row's
   own positions, under a mask that hides other rows' padding; the verification rule
   (`verify_block`) per row on its own logits, so ragged acceptance is per row;
3. keep: row b's first a_b + 1 new cache slots stay (moved behind its history), the
   rest is dropped; its next features are the captured layer outputs at those slots.

Per-row early stop (`eval.draft_stop_prob`) is the drafters' own: a row may propose
fewer tokens, even none (then only its anchor is verified).

Tree hybrids (`draft_tree`) draft row by row; each row's branches become its token
tree (`dlite.decoding.tree`), the rows' trees are padded to the largest into one
forward (each node at its row's start + its depth, seeing its row's history and its
own ancestors), each row walks its own tree by the same rule as batch-1
(`verify_tree`), and keeps the slots of its accepted path.

Lossless: each request's greedy output equals its own batch-1 plain greedy output; the
batch changes only the shapes the arithmetic runs in, so a low-precision target can part
them at a tie of its logits (as the batch-1 loop, `dlite.decoding.ties`).

Timing: `wall_ms` of the whole loop (decode only: prefills are given, made once per
request and shared by every method, as `replay` does); each request's `decode_ms` runs
from its placement in a row to its last token (it includes waiting for the other
rows: the per-request latency a client sees); `prefill_ms` is its measured prefill,
for figures with prefill included."""

import collections
import dataclasses
import time
from typing import Dict, List, Optional, Sequence

import torch

from dlite.decoding.capture import LayerCapture
from dlite.decoding.decode import Prefill, _device, _extend, _new_state, _sync, target_forward
from dlite.decoding.ragged import RaggedCache
from dlite.decoding.replay import drafter_for
from dlite.decoding.tree import TokenTree, ancestors, build_tree, verify_tree
from dlite.decoding.verify import sample_token, verify_block

RESERVE_BLOCK = 64  # cache slots per row beyond prompt + new tokens: one round's block


@dataclasses.dataclass
class Request:
    """One request: its prompt and its prefill (read, never changed: rows copy it)."""
    id: object
    prompt_ids: List[int]
    prefill: Prefill


@dataclasses.dataclass
class _Row:
    index: int                # the request's index in the stream
    request: Request
    drafter: object           # None: plain decoding
    state: object
    feats: torch.Tensor
    anchor: int
    generator: Optional[torch.Generator]
    start: float
    out: List[int] = dataclasses.field(default_factory=list)
    rounds: List[dict] = dataclasses.field(default_factory=list)


def _layers_needed(drafter, requests: Sequence[Request]) -> tuple:
    """(layer ids, reads history) of the drafter every request will get."""
    if drafter is None:
        return [], False
    d = drafter_for(drafter, requests[0].prompt_ids)
    return list(d.target_layer_ids), bool(d.needs_history)


@dataclasses.dataclass
class _TreeDraft:
    """A row's round from a tree drafter: its token tree and the branches it merged."""
    tree: TokenTree
    branches: list


def _chain(anchor: int, tok: torch.Tensor) -> tuple:
    """(tokens, parents, depths) of a linear block: anchor, then the drafts in a chain."""
    n = 1 + tok.numel()
    return [anchor, *tok.tolist()], list(range(-1, n - 1)), list(range(n))


class _Loop:
    """The state of one closed-loop run (see the module docstring)."""

    def __init__(self, target, drafter, requests, concurrency: int, max_new: int, sampling: dict,
                 eos: set, seed: int):
        self.target, self.drafter, self.max_new, self.eos = target, drafter, max_new, eos
        self.sampling, self.seed, self.dev = sampling, seed, _device(target)
        self.layers, self.history = _layers_needed(drafter, requests)
        self.queue = collections.deque(enumerate(requests))
        longest = max(len(r.prompt_ids) for r in requests)
        self.cache = RaggedCache(target, min(concurrency, len(requests)), reserve=longest + max_new + RESERVE_BLOCK)
        self.rows: List[Optional[_Row]] = [None] * self.cache.rows
        self.done: Dict[int, dict] = {}
        self.steps: List[dict] = []

    def _start(self, b: int) -> None:
        """Fill row b with the next request (one whose first token ends it is finished
        at once and the next one taken), or leave it empty."""
        while self.queue:
            i, req = self.queue.popleft()
            gen = None
            if self.sampling["temperature"] > 0:
                gen = torch.Generator(self.dev).manual_seed(self.seed + i)
            d = None if self.drafter is None else drafter_for(self.drafter, req.prompt_ids)
            pre = req.prefill
            feats = pre.features(self.layers, self.history) if self.layers else torch.zeros(0, 0)
            row = _Row(i, req, d, None if d is None else _new_state(d, req.prompt_ids), feats,
                       sample_token(pre.logits, **{**self.sampling, "generator": gen}), gen, time.perf_counter())
            self.cache.place(b, pre.cache)
            if not _extend(row.out, [row.anchor], self.eos, self.max_new):
                self.rows[b] = row
                return
            self._finish(b, row)
        self.rows[b] = None
        self.cache.release(b)

    def _finish(self, b: int, row: _Row) -> None:
        # a row's cache and its drafter's state only grow: their peaks are their sizes now
        kv_peak, drafter_peak = self.cache.row_bytes(b), 0
        if row.drafter is not None:
            drafter_peak = int(row.drafter.cache_bytes(row.state))
            if hasattr(row.drafter, "finish"):
                row.drafter.finish(row.state, row.out)
        self.done[row.index] = dict(
            id=row.request.id, index=row.index, tokens=row.out, rounds=row.rounds,
            context_len=len(row.request.prompt_ids), prefill_ms=row.request.prefill.ms,
            decode_ms=(time.perf_counter() - row.start) * 1e3, kv_bytes_peak=kv_peak,
            drafter_bytes_peak=drafter_peak)

    def _draft(self) -> List[tuple]:
        """(tokens [n_b], probs) per row (empty rows: nothing)."""
        T, out = self.sampling["temperature"], [None] * len(self.rows)
        groups: Dict[tuple, List[int]] = {}
        for b, row in enumerate(self.rows):
            if row is None or row.drafter is None:
                out[b] = (torch.empty(0, dtype=torch.long), None)
            elif hasattr(row.drafter, "draft_tree"):
                branches, row.state = row.drafter.draft_tree(row.state, row.feats, row.anchor,
                                                             self.cache.lengths[b], T, row.generator)
                out[b] = _TreeDraft(build_tree(row.anchor, branches), branches)
            elif hasattr(row.drafter, "draft_rows") or hasattr(row.drafter, "draft_history_rows"):
                free = hasattr(row.drafter, "draft_rows")  # history-free, else per-row histories
                groups.setdefault((id(row.drafter), free), []).append(b)
            else:
                tok, q, row.state = row.drafter.draft(row.state, row.feats, row.anchor,
                                                      self.cache.lengths[b], T, row.generator)
                out[b] = (tok.reshape(-1), q)
        for (_, free), bs in groups.items():
            rows, first = [self.rows[b] for b in bs], self.rows[bs[0]]
            anchors, positions = [r.anchor for r in rows], [self.cache.lengths[b] for b in bs]
            if free:  # history-free: B anchors and last features, no state
                drafts = first.drafter.draft_rows(torch.cat([r.feats[-1:] for r in rows]), anchors, positions,
                                                  T, first.generator)
            else:     # per-request history caches, each extended by its own new positions
                drafts, states = first.drafter.draft_history_rows([r.state for r in rows], [r.feats for r in rows],
                                                                  anchors, positions, T, first.generator)
                for r, st in zip(rows, states):
                    r.state = st
            for b, (tok, q) in zip(bs, drafts):
                out[b] = (tok.reshape(-1), q)
        return out

    def _block(self, drafts: List[tuple]) -> tuple:
        """Input ids [B, n] (anchor + drafts, padded with the anchor) and n; with token
        trees also each slot's depth [B, n] and which slots it sees [B, n, n] (else
        None, None: chains, the cache's default positions and causal mask)."""
        if not any(isinstance(d, _TreeDraft) for d in drafts):
            n = 1 + max(int(t.numel()) for t, _ in drafts)
            ids = torch.zeros(len(drafts), n, dtype=torch.long)
            for b, (row, (tok, _)) in enumerate(zip(self.rows, drafts)):
                ids[b] = row.anchor if row is not None else 0
                ids[b, 1:1 + tok.numel()] = tok.cpu()
            return ids.to(self.dev), n, None, None
        nodes = []
        for row, d in zip(self.rows, drafts):
            anchor = row.anchor if row is not None else 0
            nodes.append((d.tree.tokens, d.tree.parent, d.tree.depth) if isinstance(d, _TreeDraft)
                         else _chain(anchor, d[0].cpu()))
        n = max(len(t) for t, _, _ in nodes)
        ids = torch.zeros(len(drafts), n, dtype=torch.long)
        depths = torch.zeros(len(drafts), n, dtype=torch.long)
        within = torch.zeros(len(drafts), n, n, dtype=torch.bool)
        for b, (tokens, parents, depth) in enumerate(nodes):
            ids[b] = tokens[0]
            ids[b, :len(tokens)] = torch.tensor(tokens)
            depths[b, :len(depth)] = torch.tensor(depth)
            within[b] = ancestors(parents, n)
        return ids.to(self.dev), n, depths, within

    def round(self, cap) -> None:
        t0 = time.perf_counter()
        drafts = self._draft()
        _sync(self.dev)
        t1 = time.perf_counter()
        ids, n, depths, within = self._block(drafts)
        dtype = next(self.target.parameters()).dtype
        logits = target_forward(self.target, ids, 0, self.cache.cache,
                                position_ids=self.cache.positions(n, self.dev, depths),
                                attention_mask=self.cache.mask(n, dtype, self.dev, within))
        _sync(self.dev)
        t2 = time.perf_counter()
        feats = cap.row_features() if self.layers else None
        kept = self._verify(drafts, logits, feats)
        self.cache.commit(n, kept)
        step = dict(rows=sum(r is not None for r in self.rows), n=n, draft_ms=(t1 - t0) * 1e3,
                    verify_ms=(t2 - t1) * 1e3, other_ms=(time.perf_counter() - t2) * 1e3,
                    padding_share=self.cache.padding_share())
        self.steps.append({**step, **self._refill()})

    def _verify(self, drafts, logits, feats) -> list:
        """Per row: the rule on its own logits; returns the cache slots each row keeps
        (a count: the first ones; a list: a tree's accepted path)."""
        kept = []
        for b, (row, d) in enumerate(zip(self.rows, drafts)):
            if row is None:
                kept.append(0)
                continue
            if isinstance(d, _TreeDraft):
                kept.append(self._verify_tree(b, row, d, logits, feats))
                continue
            tok, q = d
            tok = tok.to(self.dev)
            q = q.to(self.dev) if q is not None else None
            if q is None and self.sampling["temperature"] > 0:  # nothing drafted: a plain step
                q = logits.new_zeros(0, logits.shape[-1], dtype=torch.float32)
            a, nxt = verify_block(tok, q, logits[b, : tok.numel() + 1],
                                  **{**self.sampling, "generator": row.generator})
            t = self.cache.lengths[b]
            if feats is not None:
                row.feats = feats[b, : a + 1] if self.history else feats[b, a: a + 1]
            before = len(row.out)
            finished = _extend(row.out, tok[:a].tolist() + [nxt], self.eos, self.max_new)
            row.rounds.append(dict(context_len=t, accepted=a, drafted=int(tok.numel()),
                                   emitted=len(row.out) - before, finished=finished))
            row.anchor = nxt
            kept.append(a + 1)
        return kept

    def _verify_tree(self, b: int, row: _Row, d: _TreeDraft, logits, feats) -> List[int]:
        """Row b's tree walked by the batch-1 rule (`verify_tree`); the slots of its
        accepted path, the anchor's first."""
        path, nxt = verify_tree(d.tree, d.branches, logits[b, :len(d.tree.tokens)],
                                **{**self.sampling, "generator": row.generator})
        t, last = self.cache.lengths[b], (path[-1] if path else 0)
        if feats is not None:  # tree drafters are history-free: the last kept slot's
            row.feats = feats[b, last: last + 1]
        emit = [d.tree.tokens[i] for i in path] + [nxt]
        row.state, extra = row.drafter.tree_verified(row.state, d.branches, emit)
        before = len(row.out)
        finished = _extend(row.out, emit, self.eos, self.max_new)
        row.rounds.append(dict(context_len=t, accepted=len(path), drafted=max([len(x.tokens) for x in d.branches] or [0]),
                               verified=d.tree.size, source=extra.get("source"), emitted=len(row.out) - before,
                               finished=finished))
        row.anchor = nxt
        return [0, *path]

    def _refill(self) -> dict:
        """Finished rows take the next requests; once the queue is empty, empty rows are
        dropped. Returns the time each took (ms): placing prefills, and the drain."""
        t0 = time.perf_counter()
        for b, row in enumerate(self.rows):
            if row is not None and row.rounds and row.rounds[-1]["finished"]:
                self._finish(b, row)
                self.rows[b] = None
                self._start(b)
        t1 = time.perf_counter()
        if not self.queue and any(r is None for r in self.rows):
            live = [b for b, r in enumerate(self.rows) if r is not None]
            movers = iter(b for b in live if b >= len(live))  # the last rows fill the holes
            keep = [b if self.rows[b] is not None else next(movers) for b in range(len(live))]
            self.cache.drop_rows(keep)
            self.rows = [self.rows[b] for b in keep]
        return dict(place_ms=(t1 - t0) * 1e3, drop_ms=(time.perf_counter() - t1) * 1e3)


@torch.inference_mode()
def batched_generate(target, drafter, requests: Sequence[Request], concurrency: int, max_new_tokens: int,
                     temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0,
                     eos_ids: Sequence[int] = (), seed: int = 0) -> dict:
    """Decode every request, at most `concurrency` at once, closed loop (a finished row
    takes the next request). `drafter`: a drafter, a factory prompt_ids -> drafter, or
    None for plain decoding. Returns {"requests": [per request, in stream order: id,
    tokens, rounds (accepted, drafted, emitted, context_len per round), decode_ms,
    prefill_ms, context_len, kv_bytes_peak, drafter_bytes_peak], "steps": [per target
    forward: rows, n, draft_ms, verify_ms, other_ms, padding_share], "wall_ms"}."""
    if concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    if not requests or max_new_tokens <= 0:
        return {"requests": [], "steps": [], "wall_ms": 0.0}
    sampling = dict(temperature=temperature, top_p=top_p, top_k=top_k)
    loop = _Loop(target, drafter, list(requests), concurrency, max_new_tokens, sampling,
                 {int(e) for e in eos_ids}, seed)
    t0 = time.perf_counter()
    with LayerCapture(target, loop.layers) as cap:
        for b in range(len(loop.rows)):
            loop._start(b)
        loop._refill()
        while loop.rows:
            loop.round(cap)
    wall = (time.perf_counter() - t0) * 1e3
    return {"requests": [loop.done[i] for i in sorted(loop.done)], "steps": loop.steps, "wall_ms": wall}
