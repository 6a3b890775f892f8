"""Training batches for the drafter: `training_row` decodes a shard row (`full` storage:
per-position features and reference rows; `anchors` storage: the anchors' feature rows
and per-block references, for the DLite student only), `collate` turns such rows into
the padded batch dict `dlite.train.step.compute_loss` reads, and `BatchStream` turns
any per-epoch source of rows (a list in memory, `dlite.data.shards.iter_records`, a Ray
dataset shard) into an endless stream of batches: seeded shuffle buffer, anchors
re-sampled every epoch (`full` rows; `anchors` rows keep theirs), ragged tail dropped,
and a position (`epoch`, `taken`) a checkpoint can store and a resumed run can skip
to. `inprocess_rows` runs the target here (no Ray), for the single-process debug path,
tests and benchmarks; the collect stage makes the same rows at scale."""

import random
from typing import Callable, Iterable, Iterator, List, Optional

import numpy as np
import torch

from dlite.data import shards
from dlite.data.anchors import anchor_seed, sample_anchors

DENSE = ("features", "ref_hidden", "topk_ids", "topk_logprobs")
# anchors storage: reference rows per block [A, gamma, ...], not per position
BLOCKS = {"ref_hidden": "ref_hidden_blocks", "topk_ids": "topk_ids_blocks",
          "topk_logprobs": "topk_logprobs_blocks"}


def training_row(row: dict, manifest: dict, supervise: str = "assistant") -> dict:
    """A shard row decoded for training. An `anchors`-storage row keeps features only at
    anchors-1 and references per block: its features become a per-position array that
    is zero elsewhere (the DLite student reads nothing else; the trainer holds a full
    row's features the same way, so only disk and shard reads shrink), its references
    move to `*_blocks`, and `fixed_anchors` keeps its stored anchors every epoch.
    `supervise="all"` (`train.supervise`, full storage): every position is a target and
    an anchor candidate, not only the assistant's tokens."""
    if supervise != "assistant" and manifest["storage_mode"] == "anchors":
        raise ValueError("train.supervise='all' needs full storage: this collection kept assistant anchors only")
    r = shards.decode_row(row, manifest)
    if manifest["storage_mode"] != "anchors":
        return r if supervise == "assistant" else {**r, "loss_mask": np.ones(len(r["input_ids"]), np.int8)}
    feats = np.zeros((len(r["input_ids"]), r["features"].shape[1]), r["features"].dtype)
    feats[r["anchors"].astype(np.int64) - 1] = r["features"]
    out = {k: v for k, v in r.items() if k not in BLOCKS}
    return {**out, "features": feats, "fixed_anchors": True,
            **{b: r[k] for k, b in BLOCKS.items() if k in r}}


# A forked row's optional per-position arrays (a trunk, then its branches; see
# `dlite.models.history.forked_history`): RoPE position and branch id (0 = trunk).
FORKED = ("position_ids", "branch_ids")


def collate(rows: List[dict]) -> dict:
    """Pad a list of rows to one batch; features / references become float32.
    `seq_lens` [B] counts real (unpadded) tokens, for throughput figures. When any row is
    forked, `position_ids` / `branch_ids` [B, L] too (`forked_ids`)."""
    L = max(len(r["input_ids"]) for r in rows)
    A = max(1, max(len(r["anchors"]) for r in rows))
    B = len(rows)
    out = {"input_ids": torch.zeros(B, L, dtype=torch.long), "loss_mask": torch.zeros(B, L, dtype=torch.bool),
           "anchors": torch.ones(B, A, dtype=torch.long), "anchor_mask": torch.zeros(B, A, dtype=torch.bool),
           "seq_lens": torch.tensor([len(r["input_ids"]) for r in rows], dtype=torch.long)}
    dense = [k for k in DENSE if k in rows[0]]
    blocks = [k for k in BLOCKS.values() if k in rows[0]]
    for k in dense + blocks:
        first = np.asarray(rows[0][k])
        dtype = torch.long if k.startswith("topk_ids") else torch.float32
        out[k] = torch.zeros(B, A if k in blocks else L, *first.shape[1:], dtype=dtype)
    for b, r in enumerate(rows):
        n, a = len(r["input_ids"]), len(r["anchors"])
        out["input_ids"][b, :n] = torch.as_tensor(np.asarray(r["input_ids"]))
        out["loss_mask"][b, :n] = torch.as_tensor(np.asarray(r["loss_mask"], dtype=bool))
        out["anchors"][b, :a] = torch.as_tensor(np.asarray(r["anchors"], dtype=np.int64))
        out["anchor_mask"][b, :a] = True
        for k in dense:
            out[k][b, :n] = torch.as_tensor(np.asarray(r[k])).to(out[k].dtype)
        for k in blocks:
            out[k][b, :a] = torch.as_tensor(np.asarray(r[k])).to(out[k].dtype)
    return {**out, **forked_ids(rows, L)}


def forked_ids(rows: List[dict], L: int) -> dict:
    """`position_ids` / `branch_ids` [B, L] (long) when any row carries them, else {} (old
    shards: their batches stay as they were). A row without them is one plain trunk:
    positions 0..n-1, branch 0. Padding continues the positions on branch 0: harmless,
    as a padded index lies after every real anchor (the history mask's key < anchor cut
    never reaches it) and has loss_mask 0 (no block slot there is valid)."""
    if not any(k in r for r in rows for k in FORKED):
        return {}
    pos = torch.arange(L, dtype=torch.long).repeat(len(rows), 1)
    br = torch.zeros(len(rows), L, dtype=torch.long)
    for b, r in enumerate(rows):
        n = len(r["input_ids"])
        if "position_ids" in r:
            pos[b, :n] = torch.as_tensor(np.asarray(r["position_ids"], dtype=np.int64))
        if "branch_ids" in r:
            br[b, :n] = torch.as_tensor(np.asarray(r["branch_ids"], dtype=np.int64))
    return {"position_ids": pos, "branch_ids": br}


def resample(row: dict, n_anchors: int, seed: int, epoch: int) -> dict:
    """The row with a fresh anchor draw for this epoch (deterministic per row and epoch);
    an `anchors`-storage row keeps its stored anchors (only they have features)."""
    if row.get("fixed_anchors"):
        return row
    s = anchor_seed(seed + epoch, str(row.get("id")), int(row.get("part") or 0))
    return {**row, "anchors": sample_anchors(row["loss_mask"], n_anchors, s)}


def shuffled(rows: Iterable, buffer: int, seed: int) -> Iterator:
    """A seeded shuffle through a buffer of `buffer` rows: a full permutation when the
    buffer holds the whole epoch, bounded memory when it cannot (streamed shards)."""
    rng, buf = random.Random(seed), []
    for row in rows:
        buf.append(row)
        if len(buf) > buffer:
            i = rng.randrange(len(buf))
            buf[i], buf[-1] = buf[-1], buf[i]
            yield buf.pop()
    rng.shuffle(buf)
    yield from buf


class BatchStream:
    """Endless batches over `epoch_rows(epoch)`, an iterable of rows per epoch.

    Each epoch: shuffle (seed + epoch), group `batch_size` rows, drop the ragged tail,
    re-sample anchors, decode and collate. `epoch` / `taken` (batches handed out in this
    epoch) are the resume position: `BatchStream(..., start=state)` skips exactly those
    batches without decoding them (the same rows when the row order is fixed, as in
    one process or on one worker; several Ray workers may be dealt other rows after a
    restart, so there it resumes at the same count, not the same rows). Every epoch is
    read to its end, even the dropped tail: a Ray streaming split starts the next epoch
    only when all ranks have finished this one."""

    def __init__(self, epoch_rows: Callable[[int], Iterable[dict]], batch_size: int,
                 n_anchors: int, seed: int, shuffle_buffer: int = 1024,
                 decode: Callable[[dict], dict] = lambda r: r, start: Optional[dict] = None):
        self.epoch_rows, self.batch_size, self.n_anchors = epoch_rows, batch_size, n_anchors
        self.seed, self.shuffle_buffer, self.decode = seed, shuffle_buffer, decode
        self.epoch, self.taken = (start or {}).get("epoch", 0), (start or {}).get("taken", 0)
        self._it = self._batches()

    def state(self) -> dict:
        return {"epoch": self.epoch, "taken": self.taken}

    def __iter__(self):
        return self

    def __next__(self) -> dict:
        return next(self._it)

    def _batches(self) -> Iterator[dict]:
        skip = self.taken
        while True:
            n, group = 0, []
            for raw in shuffled(self.epoch_rows(self.epoch), self.shuffle_buffer, self.seed + self.epoch):
                group.append(raw)
                if len(group) < self.batch_size:
                    continue
                n += 1
                if n > skip:
                    self.taken = n
                    yield collate([resample(self.decode(r), self.n_anchors, self.seed, self.epoch)
                                   for r in group])
                group = []
            if n == 0:
                raise ValueError(f"epoch {self.epoch} cannot fill one batch of {self.batch_size} rows")
            self.epoch, self.taken, skip = self.epoch + 1, 0, 0


def epoch_batches(rows: List[dict], batch_size: int, n_anchors: int, seed: int) -> BatchStream:
    """Endless batches over rows held in memory (a full shuffle every epoch)."""
    return BatchStream(lambda epoch: rows, batch_size, n_anchors, seed, shuffle_buffer=len(rows))


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
