"""The target forward that feature collection runs, and what is kept from it.

Features are the outputs of the configured decoder layers, caught by forward hooks on
`model.model.layers[i]` (= HF `hidden_states[i + 1]`). We run only the base model
(`model.model`): never `output_hidden_states=True` (it keeps every layer alive) and never
full-vocabulary logits for every position. The reference signal is either the post-norm
final hidden state (`last_hidden`: the base model's output, i.e. `model.model.norm`'s,
re-projected through the frozen lm_head at training time) or `topk` (ids + log-probs),
computed from that hidden state through lm_head in chunks and only for the rows stored.

Storage modes: `full` keeps every position (the history-aware teacher needs it);
`anchors` keeps, per sampled anchor a, the context feature row a-1 and the reference
rows a..a+gamma-1 (all the DLite student needs).

A forked row (a trunk plus branches: `dlite.data.render.forked_sequences`) runs alone in
two forwards (`TargetFeatures.forked`): each branch element gets the target's states
reading the trunk up to the branch's fork and the branch so far. Given a KV cache and
the states of the trunk's first positions (a regenerated conversation's,
`dlite.data.regen_features`), it runs only the rest; `cached_forward` is the capturing
prefill that keeps them.

Stored dtypes: features / ref_hidden / top-k log-probs as float16, top-k ids as int32.
fp16 (not bf16) because numpy and Parquet have it natively; its range (+-65504) holds
Qwen3 activations, and a row that overflows is reported (`nonfinite_features`) rather
than stored. `bare_forward` runs the same batch with nothing captured, so capture
overhead can be measured as collection throughput over bare throughput."""

import time
from collections import Counter
from typing import Dict, Iterator, List, Sequence, Tuple

import numpy as np
import torch

from dlite.data.anchors import reference_positions
from dlite.target.cache import cache_kwarg, new_cache
from dlite.target.layers import decoder_layers


class TargetFeatures:
    """Hooks on `layer_ids` of a HF causal LM; call with a padded batch."""

    def __init__(self, model, layer_ids: Sequence[int]):
        layers = decoder_layers(model)
        bad = [i for i in layer_ids if not 0 <= i < len(layers)]
        if bad or not layer_ids:
            raise ValueError(f"drafter.target_layer_ids {list(layer_ids)}: the target has "
                             f"{len(layers)} layers")
        self.model, self.layers, self.layer_ids = model, layers, list(layer_ids)
        self.lm_head = model.get_output_embeddings()
        self.device = next(model.parameters()).device

    @torch.no_grad()
    def __call__(self, input_ids, attention_mask):
        """(features [B, L, K*H], final post-norm hidden [B, L, H])."""
        return self._hooked(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)

    def _hooked(self, **forward):
        """`model.model(**forward)` with the layer outputs caught: (features, final)."""
        caught: Dict[int, torch.Tensor] = {}

        def keep(slot):
            def hook(module, args, output):
                caught[slot] = output[0] if isinstance(output, (tuple, list)) else output
            return hook
        handles = [self.layers[i].register_forward_hook(keep(s))
                   for s, i in enumerate(self.layer_ids)]
        try:
            out = self.model.model(**forward)
        finally:
            for h in handles:
                h.remove()
        feats = torch.cat([caught[s] for s in range(len(self.layer_ids))], dim=-1)
        return feats, out.last_hidden_state

    @torch.no_grad()
    def cached_forward(self, ids: torch.Tensor, start: int, cache):
        """(features [n, K*H], final [n, H]) of `ids` [n] at positions start.. on `cache`
        (holding positions < start), which the forward extends: the regeneration's
        prefills capture the states collection needs as they go."""
        kw = cache_kwarg(type(self.model.model))
        pos = torch.arange(start, start + len(ids), device=self.device)[None]
        f, h = self._hooked(input_ids=ids[None].to(self.device), use_cache=True, position_ids=pos, **{kw: cache})
        return f[0], h[0]

    @torch.no_grad()
    def forked(self, input_ids, position_ids, branch_ids, cache=None, known=None):
        """(features [L, K*H], final [L, H]) of one forked row (`dlite.data.render.
        forked_sequences`: a trunk, then branches whose first element repeats the trunk
        token they fork at). Two forwards: the trunk, causal, keeping its KV cache; then
        every branch's other elements at once on that cache under `fork_mask`, so each
        one's states are the target's reading trunk[:fork + 1] + its branch so far.
        (A forward per branch on a cropped cache took ~5x the trunk's time on CPU.)
        `cache` + `known` (features, final of the trunk's first c positions, which `cache`
        holds): only the rest of the trunk is run (a regenerated conversation's cache)."""
        ids = torch.as_tensor(np.asarray(input_ids), dtype=torch.long, device=self.device)
        pos, br = np.asarray(position_ids), np.asarray(branch_ids)
        trunk, kw = int((br == 0).sum()), cache_kwarg(type(self.model.model))
        cache, dev = (new_cache(self.model) if cache is None else cache), self.device
        c = 0 if known is None else len(known[0])
        if cache.get_seq_length() != c:
            raise ValueError(f"the cache holds {cache.get_seq_length()} positions, the known states {c}")
        parts = [] if known is None else [known]
        if c < trunk:
            f, h = self._hooked(input_ids=ids[None, c:trunk], use_cache=True, **{kw: cache},
                                position_ids=torch.arange(c, trunk, device=dev)[None])
            parts.append((f[0], h[0]))
        f = torch.cat([x.to(dev, parts[-1][0].dtype) for x, _ in parts])  # kept states may be on the host
        h = torch.cat([x.to(dev, parts[-1][1].dtype) for _, x in parts])
        feats = f.new_zeros(len(br), f.shape[-1])
        final = h.new_zeros(len(br), h.shape[-1])
        feats[:trunk], final[:trunk] = f[:trunk], h[:trunk]
        firsts = np.array([lo for lo, _ in _branches(br)], dtype=np.int64)
        forks = pos[firsts]
        if len(firsts) and not (0 <= forks.min() and forks.max() < trunk):
            raise ValueError(f"forks {forks.tolist()} are not all trunk positions (< {trunk})")
        # a branch's first element is the fork's own token: the trunk's states
        feats[firsts], final[firsts] = feats[forks], final[forks]
        rest = np.setdiff1d(np.arange(trunk, len(br)), firsts)
        if len(rest):
            mask = fork_mask(pos, br, trunk, rest, f.dtype).to(dev)
            f, h = self._hooked(input_ids=ids[None, rest], use_cache=True, **{kw: cache},
                                attention_mask=mask, position_ids=torch.as_tensor(pos[rest], device=dev)[None])
            feats[rest], final[rest] = f[0], h[0]
        return feats, final

    @torch.no_grad()
    def bare_forward(self, input_ids, attention_mask):
        """A plain prefill of the same batch (logits of the last position only)."""
        return self.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False,
                          logits_to_keep=1).logits

    @torch.no_grad()
    def topk(self, rows: torch.Tensor, k: int, chunk: int = 1024):
        """(ids int32 [N, k], log-probs float32 [N, k]) of lm_head(rows), chunk rows at a time
        so the [chunk, V] logits are the only full-vocabulary tensor alive."""
        ids, vals = [], []
        for part in rows.split(chunk):
            logp = torch.log_softmax(self.lm_head(part).float(), dim=-1)
            v, i = logp.topk(k, dim=-1)
            ids.append(i.to(torch.int32))
            vals.append(v)
        return torch.cat(ids), torch.cat(vals)


def _branches(branch_ids: np.ndarray) -> List[Tuple[int, int]]:
    """(start, end) index runs of a forked row's branches (branch id > 0), in order."""
    edges = np.flatnonzero(np.diff(branch_ids, prepend=0, append=0))
    return [(int(a), int(b)) for a, b in zip(edges[:-1], edges[1:]) if branch_ids[a] > 0]


def fork_mask(pos: np.ndarray, br: np.ndarray, trunk: int, rows: np.ndarray, dtype) -> torch.Tensor:
    """Additive mask [1, 1, N, trunk + N] for branch elements `rows` (indices, in order)
    run together after the trunk's cache: each sees the trunk up to its branch's fork
    (the position of the branch's first element) and its own branch up to itself."""
    firsts = {int(br[lo]): int(pos[lo]) for lo, _ in _branches(br)}
    fork = torch.tensor([firsts[int(b)] for b in br[rows]])
    same = torch.as_tensor(br[rows])
    own = (same[:, None] == same[None]) & torch.ones(len(rows), len(rows), dtype=torch.bool).tril()
    allowed = torch.cat([torch.arange(trunk)[None] <= fork[:, None], own], 1)
    return torch.zeros(allowed.shape, dtype=dtype).masked_fill_(~allowed, torch.finfo(dtype).min)[None, None]


def length_buckets(lengths: Sequence[int], token_budget: int) -> List[List[int]]:
    """Groups of indices, sorted by length, each with (size x longest) <= token_budget (or
    a single sequence): little padding, bounded activation memory."""
    groups, cur = [], []
    for i in sorted(range(len(lengths)), key=lambda i: lengths[i]):
        if cur and (len(cur) + 1) * lengths[i] > token_budget:
            groups.append(cur)
            cur = []
        cur.append(i)
    return groups + ([cur] if cur else [])


def forward_budget(token_budget: int, device) -> int:
    """The token budget `iter_extract` batches under on `device`: 0 (every sequence alone)
    on CPU. There a padded batch is slower than its rows one by one: the padding mask moves
    SDPA off its fused causal kernel onto the masked one, which materialises the scores
    (SmolLM2, 1 thread: 4 rows of 2.5-4K tokens 100 tokens/s padded, 230 alone; 2 rows of
    2000 tokens, no padding, 270). On a GPU, batching keeps the device busy."""
    return 0 if torch.device(device).type == "cpu" else token_budget


def forward_groups(seqs: List[dict], token_budget: int, device) -> List[List[int]]:
    """The groups of `seqs` (indices) that `iter_extract` runs one target forward each on
    `device`: `length_buckets` under `forward_budget`; a forked row (`branch_ids`) alone."""
    plain = [i for i, s in enumerate(seqs) if s.get("branch_ids") is None]
    groups = length_buckets([len(seqs[i]["input_ids"]) for i in plain], forward_budget(token_budget, device))
    return [[plain[j] for j in g] for g in groups] + \
        [[i] for i, s in enumerate(seqs) if s.get("branch_ids") is not None]


def pad_group(seqs: List[dict], group: List[int], pad_id: int):
    """(input_ids, attention_mask) [len(group), longest] for one length bucket."""
    L = max(len(seqs[i]["input_ids"]) for i in group)
    ids = torch.full((len(group), L), pad_id, dtype=torch.long)
    mask = torch.zeros((len(group), L), dtype=torch.long)
    for r, i in enumerate(group):
        n = len(seqs[i]["input_ids"])
        ids[r, :n] = torch.as_tensor(seqs[i]["input_ids"])
        mask[r, :n] = 1
    return ids, mask


def _fp16(t: torch.Tensor) -> np.ndarray:
    return t.to(torch.float16).cpu().numpy()


def _stored(tf: TargetFeatures, feats, final, n: int, anchors, spec: dict) -> dict:
    """What one sequence keeps, as numpy arrays (see the module docstring)."""
    if spec["storage_mode"] == "full":
        f, ref = feats[:n], final[:n]
    else:
        a = torch.as_tensor(np.asarray(anchors, dtype=np.int64), device=feats.device)
        pos = torch.as_tensor(reference_positions(anchors, spec["gamma"], n), device=feats.device)
        f, ref = feats[a - 1], final[pos]
    out = {"features": _fp16(f)}
    if spec["reference"] == "last_hidden":
        out["ref_hidden"] = _fp16(ref)
    else:
        ids, logp = tf.topk(ref.reshape(-1, ref.shape[-1]), spec["topk"])
        out["topk_ids"] = ids.reshape(*ref.shape[:-1], -1).cpu().numpy()
        out["topk_logprobs"] = _fp16(logp.reshape(*ref.shape[:-1], -1))
    finite = all(np.isfinite(v).all() for k, v in out.items() if v.dtype == np.float16)
    return out if finite else {"error": "nonfinite_features"}


def iter_extract(tf: TargetFeatures, seqs: List[dict], spec: dict, token_budget: int,
                 pad_id: int) -> Iterator[Tuple[List[int], List[dict], float]]:
    """Per length bucket: (indices into `seqs`, stored arrays of those sequences, seconds
    in the target forward). `seqs`: {"input_ids", "anchors"} (+ "position_ids" and
    "branch_ids" for a forked row); `spec`: storage_mode,
    reference, topk, gamma. One bucket's arrays are alive at a time."""
    for group in forward_groups(seqs, token_budget, tf.device):
        t0 = time.perf_counter()
        if seqs[group[0]].get("branch_ids") is not None:
            s = seqs[group[0]]
            feats, final = (t[None] for t in tf.forked(s["input_ids"], s["position_ids"], s["branch_ids"]))
        else:
            ids, mask = pad_group(seqs, group, pad_id)
            feats, final = tf(ids.to(tf.device), mask.to(tf.device))
        seconds = time.perf_counter() - t0
        yield group, [_stored(tf, feats[r], final[r], len(seqs[i]["input_ids"]), seqs[i]["anchors"],
                              spec) for r, i in enumerate(group)], seconds


def extract(tf: TargetFeatures, seqs: List[dict], spec: dict, token_budget: int,
            pad_id: int) -> Tuple[List[dict], float]:
    """All of `iter_extract` in input order, and the total forward seconds."""
    results: List[dict] = [None] * len(seqs)
    total = 0.0
    for group, res, seconds in iter_extract(tf, seqs, spec, token_budget, pad_id):
        total += seconds
        for i, r in zip(group, res):
            results[i] = r
    return results, total


def write_features(tf: TargetFeatures, seqs: List[dict], spec: dict, writer, token_budget: int,
                   pad_id: int) -> Tuple[Counter, set, List[dict]]:
    """Forward `seqs` bucket by bucket and `writer.write` each bucket's rows (sequence dict
    + stored arrays); a sequence whose states overflow fp16 is left out. Returns (stats,
    {(index, id)} written, sequences of records with nothing written)."""
    stats, written, failed = Counter(forward_s=0.0), set(), {}
    for group, results, seconds in iter_extract(tf, seqs, spec, token_budget, pad_id):
        rows = [{**seqs[i], **r} for i, r in zip(group, results) if "error" not in r]
        failed.update({seqs[i]["index"]: seqs[i] for i, r in zip(group, results) if "error" in r})
        writer.write(rows)
        written |= {(r["index"], r["id"]) for r in rows}
        stats.update(forward_s=seconds, sequences=len(rows),
                     tokens=sum(len(r["input_ids"]) for r in rows),
                     supervised_tokens=int(sum(np.sum(r["loss_mask"]) for r in rows)),
                     anchors=sum(len(r["anchors"]) for r in rows))
    done = {i for i, _ in written}
    return stats, written, [s for i, s in failed.items() if i not in done]
