"""Training batches for the drafter: `collate` turns stored sequences (token ids, loss
mask, per-position features and reference rows — `full` storage) into the padded batch
dict `dlite.train.step.compute_loss` reads, and `epoch_batches` streams them with
anchors re-sampled every epoch. `inprocess_rows` runs the target here (no Ray), for the
single-process debug path, tests and benchmarks; the collect stage produces the same
rows at scale."""

import random
from typing import Iterator, List

import numpy as np
import torch

from dlite.data.anchors import anchor_seed, sample_anchors


def collate(rows: List[dict]) -> dict:
    """Pad a list of rows to one batch; features / references become float32."""
    L = max(len(r["input_ids"]) for r in rows)
    A = max(1, max(len(r["anchors"]) for r in rows))
    B = len(rows)
    out = {"input_ids": torch.zeros(B, L, dtype=torch.long), "loss_mask": torch.zeros(B, L, dtype=torch.bool),
           "anchors": torch.ones(B, A, dtype=torch.long), "anchor_mask": torch.zeros(B, A, dtype=torch.bool)}
    dense = [k for k in ("features", "ref_hidden", "topk_ids", "topk_logprobs") if k in rows[0]]
    for k in dense:
        first = np.asarray(rows[0][k])
        dtype = torch.long if k == "topk_ids" else torch.float32
        out[k] = torch.zeros(B, L, *first.shape[1:], dtype=dtype)
    for b, r in enumerate(rows):
        n, a = len(r["input_ids"]), len(r["anchors"])
        out["input_ids"][b, :n] = torch.as_tensor(np.asarray(r["input_ids"]))
        out["loss_mask"][b, :n] = torch.as_tensor(np.asarray(r["loss_mask"], dtype=bool))
        out["anchors"][b, :a] = torch.as_tensor(np.asarray(r["anchors"], dtype=np.int64))
        out["anchor_mask"][b, :a] = True
        for k in dense:
            out[k][b, :n] = torch.as_tensor(np.asarray(r[k])).to(out[k].dtype)
    return out


def resample(row: dict, n_anchors: int, seed: int, epoch: int) -> dict:
    """The row with a fresh anchor draw for this epoch (deterministic per row and epoch)."""
    s = anchor_seed(seed + epoch, str(row.get("id")), int(row.get("part") or 0))
    return {**row, "anchors": sample_anchors(row["loss_mask"], n_anchors, s)}


def epoch_batches(rows: List[dict], batch_size: int, n_anchors: int, seed: int,
                  drop_last: bool = True) -> Iterator[dict]:
    """Endless batches: shuffle per epoch, re-sample anchors, drop the ragged tail."""
    epoch = 0
    while True:
        order = list(range(len(rows)))
        random.Random(seed + epoch).shuffle(order)
        stop = len(order) - len(order) % batch_size if drop_last else len(order)
        if stop == 0:
            raise ValueError(f"{len(rows)} rows cannot fill one batch of {batch_size}")
        for i in range(0, stop, batch_size):
            yield collate([resample(rows[j], n_anchors, seed, epoch) for j in order[i:i + batch_size]])
        epoch += 1


def inprocess_rows(model, tokenizer, records, layer_ids, max_len: int, policy: str,
                   n_anchors: int, seed: int, token_budget: int = 8192) -> List[dict]:
    """Render records, run the target once, keep `full` rows (features + final hidden)."""
    from dlite.data.features import TargetFeatures, extract
    from dlite.data.formats import Quarantine
    from dlite.data.render import sequences
    seqs = []
    for rec in records:
        try:
            seqs += sequences(tokenizer, rec, max_len, policy, n_anchors, seed)
        except Quarantine:
            continue  # counted by the collect stage; here only usable rows matter
    spec = {"storage_mode": "full", "reference": "last_hidden", "topk": 0, "gamma": 1}
    results, _ = extract(TargetFeatures(model, layer_ids), seqs, spec, token_budget,
                         tokenizer.pad_token_id or 0)
    return [{**s, **r} for s, r in zip(seqs, results) if "error" not in r]
