"""What a training stage reads, decided before any Ray work starts (no Ray here, so
the single-process benchmark path reads exactly the same rows):

- `check_inputs`  the shards are a finished collection of this target with the
                  drafter's layers, stored `full` unless the stage reads anchors only
                  (`require_full`), and the align stage has its teacher
- `split_inputs`  which records are held out for validation, how many rows train, and
                  for a small collection the training rows as one Arrow table (read once,
                  cached in the object store by the Ray path; streamed when large)

`data.shuffle_buffer` sizes the per-rank shuffle buffer; collections up to
`data.cache_bytes` are read into memory."""

from dataclasses import dataclass
from typing import List, Optional

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from dlite import target
from dlite.data import shards
from dlite.train import plan as st
class TrainError(RuntimeError):
    """The stage cannot run as asked (bad shards, missing teacher, too little data)."""


def shuffle_buffer(cfg) -> int:
    return int(cfg.data.shuffle_buffer)


def cache_bytes(cfg) -> int:
    return int(cfg.data.cache_bytes)


def require_full(plan: st.StagePlan) -> Optional[str]:
    """Why the stage needs `full` shards, or None when `anchors` ones do: the DLite
    student against the target reads features at its anchors only, while the teacher
    and DSpark attend to the whole history, and distillation runs the teacher."""
    if plan.arch != "dlite":
        return f"the {plan.stage} stage ({plan.arch}) attends to every position's features"
    if plan.needs_teacher:
        return ("the align stage distils the teacher, which reads every position's features "
                "(train.skip_teacher=true trains the student on anchors alone)")
    return None


def check_inputs(cfg, plan: st.StagePlan, input_uri: str, teacher: Optional[str],
                 heldout: Optional[str] = None) -> dict:
    """Everything that would fail late; returns the input's manifest."""
    fp = target.fingerprint(cfg.target)
    m = shards.read_manifest(input_uri, fp)
    held = shards.read_manifest(heldout, fp) if heldout else {"storage_mode": "full"}
    for flag, uri, mode in (("--input", input_uri, m["storage_mode"]),
                            ("--heldout", heldout, held["storage_mode"])):
        why = require_full(plan) if mode == "anchors" else None
        # Held-out rows are validated on the replies whatever train.supervise says.
        if mode == "anchors" and not why and flag == "--input" and cfg.train.supervise != "assistant":
            why = f"train.supervise={cfg.train.supervise!r} trains on every position"
        if why:
            raise TrainError(f"{flag} {uri}: storage_mode 'anchors' keeps features at the sampled "
                             f"anchors only, but {why}; collect with data.storage_mode=full")
    # Manifests written before target.dtype existed were all collected in float32.
    if m.get("target_dtype", "float32") != cfg.target.dtype:
        raise TrainError(f"target.dtype {cfg.target.dtype!r} but the shards were collected with the "
                         f"target in {m.get('target_dtype', 'float32')!r}: features differ; recollect")
    if list(m["layer_ids"]) != list(cfg.drafter.target_layer_ids):
        raise TrainError(f"drafter.target_layer_ids {list(cfg.drafter.target_layer_ids)} but the "
                         f"shards captured {m['layer_ids']}")
    if plan.needs_teacher and not (teacher and (st.teacher_dir(teacher) / "config.json").is_file()):
        raise TrainError(f"--teacher: the align stage needs the teacher stage's output, got {teacher!r}")
    return m


@dataclass
class StageInputs:
    held: Optional[List[str]]  # record ids kept out of training (None: --heldout given)
    val: dict                  # kwargs of `dlite.train.plan.heldout_rows`
    n_train: int               # training rows (sequences)
    table: Optional[pa.Table]  # the training rows when small enough to hold, else None


def keep_rows(table: pa.Table, ids: Optional[List[str]], keep: bool) -> pa.Table:
    """Rows whose id is (keep=True) or is not (keep=False) in ids; all rows if ids is None."""
    if ids is None:
        return table
    mask = pc.is_in(table["id"], value_set=pa.array(ids, pa.string()))
    return table.filter(mask if keep else pc.invert(mask))


def _read(uri: str, path: str, columns=None) -> pa.Table:
    store = shards.Store(uri)
    return pq.read_table(store.path(path), columns=columns, filesystem=store.fs)


def split_inputs(cfg, input_uri: str, heldout_uri: Optional[str], manifest: dict) -> StageInputs:
    """Held-out records: the `heldout_uri` collection when given, else about a tenth of
    the input's records (1..64) in whole groups (`data.val_group`), chosen by hash and
    kept out of training."""
    ids = [i for f in manifest["files"] for i in _read(input_uri, f["path"], ["id"])["id"].to_pylist()]
    held = None
    if heldout_uri:
        shards.read_manifest(heldout_uri, manifest["target_fingerprint"])
    else:
        held = st.heldout_ids(ids, max(1, min(64, len(set(ids)) // 10)), cfg.data.val_group)
    table = None
    if sum(f["bytes"] for f in manifest["files"]) <= cache_bytes(cfg):
        table = keep_rows(pa.concat_tables([_read(input_uri, f["path"]) for f in manifest["files"]]),
                          held, keep=False)
    n_train = sum(i not in set(held or ()) for i in ids)
    if n_train // cfg.cluster.num_workers < cfg.train.batch_size:
        raise TrainError(f"train.batch_size: {n_train} training rows cannot give each of "
                         f"{cfg.cluster.num_workers} workers one batch of {cfg.train.batch_size}")
    return StageInputs(held, {"uri": heldout_uri or input_uri, "ids": held}, n_train, table)
