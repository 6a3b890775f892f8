"""Feature shards on disk (ARCHITECTURE.md §3): Parquet files plus `manifest.json`.

Layout of a collection directory (local path or any pyarrow filesystem URI, e.g. s3://):
  collect.json            the plan (target fingerprint, settings, input identity); a rerun
                          with another plan is refused instead of mixing shards
  shards/shard-NNNNN.parquet   records [N*R, (N+1)*R) of the input, R = records per shard
  shards/shard-NNNNN.json      its sidecar, written LAST: sha256, size, counts, ids and the
                          shard's quarantine entries -- a shard is done iff this exists
  quarantine.jsonl        every unusable record: index, id, where, reason, detail
  manifest.json           written at the very end; readers require it

Columns (schema version 2; arrays are little-endian bytes, shapes from the manifest):
  id string, part int32 (piece of a split record), index int64 (input record number),
  n_tokens int32, input_ids list<int32>, loss_mask list<int8>, anchors list<int32>,
  features large_binary  float16 [n_tokens | A, feature_dim]    (full | anchors mode;
                         in anchors mode row i is position anchors[i]-1)
  ref_hidden large_binary float16 [n_tokens, H] | [A, gamma, H]  (reference last_hidden)
  topk_ids large_binary  int32   [n_tokens, k] | [A, gamma, k]   (reference topk)
  topk_logprobs large_binary float16, same shape as topk_ids
  position_ids, branch_ids list<int32>, null but in a forked row (a trunk and its
                         branches, `dlite.data.render.forked_sequences`); version 1 lacks them
Reference row (a, j) in anchors mode is position a+j, clipped to n_tokens-1.
"""

import hashlib
import json
import os
import uuid
from typing import Iterator, List, Optional

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

SCHEMA_VERSION = 2
READABLE_VERSIONS = (1, 2)  # version 1: no forked rows; its collections stay readable
FORK_COLUMNS = ("position_ids", "branch_ids")
MANIFEST, PLAN, QUARANTINE = "manifest.json", "collect.json", "quarantine.jsonl"
ARRAY_DTYPES = {"features": "<f2", "ref_hidden": "<f2", "topk_ids": "<i4", "topk_logprobs": "<f2"}


class ShardError(RuntimeError):
    """A collection directory that must not be used as asked (mismatch, unfinished, corrupt)."""


def shard_schema(reference: str, version: int = SCHEMA_VERSION) -> pa.Schema:
    refs = ["ref_hidden"] if reference == "last_hidden" else ["topk_ids", "topk_logprobs"]
    forks = [(k, pa.list_(pa.int32())) for k in FORK_COLUMNS] if version >= 2 else []
    return pa.schema([
        ("id", pa.string()), ("part", pa.int32()), ("index", pa.int64()),
        ("n_tokens", pa.int32()), ("input_ids", pa.list_(pa.int32())),
        ("loss_mask", pa.list_(pa.int8())), ("anchors", pa.list_(pa.int32())), *forks,
        ("features", pa.large_binary()), *[(r, pa.large_binary()) for r in refs]])


def shard_name(shard: int) -> str:
    return f"shards/shard-{shard:05d}"


# ---------------------------------------------------------------- storage

class Store:
    """A directory on local disk or on any pyarrow filesystem (s3://, gs://, hdfs://).
    Renames are atomic on local disk and NFS; on object stores the sidecar-last protocol
    still keeps a half-written shard from ever counting as done."""

    def __init__(self, uri: str):
        if "://" in str(uri):
            self.fs, self.root = pafs.FileSystem.from_uri(str(uri))
        else:
            self.fs, self.root = pafs.LocalFileSystem(), os.path.abspath(uri)

    def path(self, rel: str) -> str:
        return f"{self.root}/{rel}"

    def exists(self, rel: str) -> bool:
        return self.fs.get_file_info(self.path(rel)).type != pafs.FileType.NotFound

    def size(self, rel: str) -> int:
        return self.fs.get_file_info(self.path(rel)).size

    def read_bytes(self, rel: str) -> bytes:
        with self.fs.open_input_stream(self.path(rel)) as f:
            return f.read()

    def write_atomic(self, rel: str, data: bytes) -> None:
        self.fs.create_dir(os.path.dirname(self.path(rel)), recursive=True)
        tmp = f"{rel}.tmp-{uuid.uuid4().hex[:8]}"
        with self.fs.open_output_stream(self.path(tmp)) as f:
            f.write(data)
        self.fs.move(self.path(tmp), self.path(rel))

    def sha256(self, rel: str) -> str:
        h = hashlib.sha256()
        with self.fs.open_input_stream(self.path(rel)) as f:
            while chunk := f.read(1 << 22):
                h.update(chunk)
        return h.hexdigest()

    def remove_tmp(self, rel_dir: str) -> int:
        """Delete leftovers of interrupted writes (`*.tmp-*`) under rel_dir."""
        sel = pafs.FileSelector(self.path(rel_dir), allow_not_found=True)
        stale = [i.path for i in self.fs.get_file_info(sel) if ".tmp-" in i.base_name]
        for p in stale:
            self.fs.delete_file(p)
        return len(stale)


# ---------------------------------------------------------------- rows

def encode_row(rec: dict) -> dict:
    """A record with numpy arrays -> a row of `shard_schema`."""
    row = {k: rec[k] for k in ("id", "part", "index")}
    row["n_tokens"] = len(rec["input_ids"])
    for k in ("input_ids", "loss_mask", "anchors"):
        row[k] = np.asarray(rec[k]).tolist()
    for k in FORK_COLUMNS:
        row[k] = None if rec.get(k) is None else np.asarray(rec[k]).tolist()
    for k, dt in ARRAY_DTYPES.items():
        if k in rec:
            row[k] = np.ascontiguousarray(rec[k], dtype=dt).tobytes()
    return row


def decode_row(row: dict, manifest: dict) -> dict:
    """A shard row -> numpy arrays shaped as the module docstring says (writable copies)."""
    out = dict(row)
    for k, dt in (("input_ids", np.int32), ("loss_mask", np.int8), ("anchors", np.int32)):
        out[k] = np.asarray(row[k], dtype=dt)
    for k in FORK_COLUMNS:  # absent (version 1) or null: a plain row, which has no such key
        if out.pop(k, None) is not None:
            out[k] = np.asarray(row[k], dtype=np.int32)
    blocks = (manifest["gamma"],) if manifest["storage_mode"] == "anchors" else ()
    widths = {"features": (manifest["feature_dim"],), "ref_hidden": blocks + (manifest["hidden_size"],),
              "topk_ids": blocks + (manifest.get("topk"),), "topk_logprobs": blocks + (manifest.get("topk"),)}
    for k, dt in ARRAY_DTYPES.items():
        if row.get(k) is not None:
            out[k] = np.frombuffer(row[k], dtype=dt).reshape(-1, *widths[k]).copy()
    return out


# ---------------------------------------------------------------- writing

class ShardWriter:
    """Rows appended as Parquet row groups to a temp file; `finish` renames it and writes
    the sidecar (checksum + `info`) last. Memory stays at one batch of rows however
    large the shard (full-mode rows of a real target are ~200 MB each)."""

    def __init__(self, store: Store, shard: int, reference: str):
        self.store, self.shard, self.name = store, shard, shard_name(shard)
        self.schema, self.rows = shard_schema(reference), 0
        store.fs.create_dir(store.path("shards"), recursive=True)
        self.tmp = f"{self.name}.parquet.tmp-{uuid.uuid4().hex[:8]}"
        self.writer = pq.ParquetWriter(store.path(self.tmp), self.schema,
                                       filesystem=store.fs, compression="zstd")

    def write(self, recs: List[dict]) -> None:
        if recs:
            self.writer.write_table(pa.Table.from_pylist([encode_row(r) for r in recs],
                                                         schema=self.schema))
            self.rows += len(recs)

    def finish(self, info: dict) -> dict:
        self.writer.close()
        final = f"{self.name}.parquet"
        self.store.fs.move(self.store.path(self.tmp), self.store.path(final))
        side = {**info, "shard": self.shard, "schema_version": SCHEMA_VERSION, "rows": self.rows,
                "file": final, "bytes": self.store.size(final), "sha256": self.store.sha256(final)}
        self.store.write_atomic(f"{self.name}.json", json.dumps(side).encode())
        return side

    def abort(self) -> None:
        self.writer.close()
        self.store.fs.delete_file(self.store.path(self.tmp))


def write_shard(store: Store, shard: int, recs: List[dict], reference: str, info: dict) -> dict:
    """A whole shard at once (see ShardWriter); returns its sidecar."""
    w = ShardWriter(store, shard, reference)
    w.write(recs)
    return w.finish(info)


def finished_shard(store: Store, shard: int, plan_id: str) -> Optional[dict]:
    """The sidecar of a completed shard of this plan, else None. Checks presence and size
    (cheap); `verify_files` re-hashes everything."""
    side = f"{shard_name(shard)}.json"
    if not store.exists(side):
        return None
    info = json.loads(store.read_bytes(side))
    ok = (info.get("plan") == plan_id and store.exists(info["file"])
          and store.size(info["file"]) == info["bytes"])
    return info if ok else None


def claim(store: Store, plan: dict) -> None:
    """Record the plan, or refuse a directory that holds a collection with another one."""
    if store.exists(PLAN):
        old = json.loads(store.read_bytes(PLAN))
        if old != plan:
            keys = sorted(k for k in set(old) | set(plan) if old.get(k) != plan.get(k))
            raise ShardError(f"{store.root} holds a collection with a different plan "
                             f"(differs in {keys}); use another output dir or delete it")
        return
    store.write_atomic(PLAN, json.dumps(plan, indent=2, sort_keys=True).encode())


def write_quarantine(store: Store, entries: List[dict]) -> None:
    lines = [json.dumps(e, ensure_ascii=False) for e in sorted(entries, key=lambda e: e["index"])]
    store.write_atomic(QUARANTINE, ("\n".join(lines) + "\n" if lines else "").encode())


def write_manifest(store: Store, manifest: dict) -> None:
    store.write_atomic(MANIFEST, json.dumps(manifest, indent=2).encode())


# ---------------------------------------------------------------- reading

def _fingerprint_id(fp) -> str:
    return fp["id"] if isinstance(fp, dict) else str(fp)


def read_manifest(uri: str, expect_fingerprint=None) -> dict:
    """The manifest of a finished collection; refuses another schema version or target."""
    store = Store(uri)
    if not store.exists(MANIFEST):
        raise ShardError(f"{uri}: no {MANIFEST}: the collection is unfinished (rerun collect "
                         f"to resume) or this is not a collection directory")
    m = json.loads(store.read_bytes(MANIFEST))
    if m.get("schema_version") not in READABLE_VERSIONS:
        raise ShardError(f"{uri}: shard schema version {m.get('schema_version')}, this code "
                         f"reads versions {READABLE_VERSIONS}: recollect the features")
    if expect_fingerprint is not None:
        from dlite.target import same_target
        have, want = m["target_fingerprint"]["id"], _fingerprint_id(expect_fingerprint)
        if not same_target(have, expect_fingerprint):
            raise ShardError(f"{uri}: features come from target {have}, but the target "
                             f"is {want}: recollect them with this target")
    return m


def verify_files(uri: str, manifest: dict) -> None:
    """Re-hash every shard file against the manifest's checksums."""
    store = Store(uri)
    for f in manifest["files"]:
        if not store.exists(f["path"]) or store.sha256(f["path"]) != f["sha256"]:
            raise ShardError(f"{uri}/{f['path']}: missing or checksum mismatch")


def check_schema(uri: str, manifest: dict) -> None:
    version = manifest["schema_version"]
    store, want = Store(uri), shard_schema(manifest["reference"], version)
    for f in manifest["files"]:
        got = pq.read_schema(store.path(f["path"]), filesystem=store.fs)
        if not got.remove_metadata().equals(want):
            raise ShardError(f"{uri}/{f['path']}: columns {got.names} do not match "
                             f"schema version {version} ({want.names})")


def iter_records(uri: str, expect_fingerprint=None, verify: bool = False,
                 batch_rows: int = 4) -> Iterator[dict]:
    """Decoded records of a finished collection, shard by shard (no Ray needed)."""
    m = read_manifest(uri, expect_fingerprint)
    check_schema(uri, m)
    if verify:
        verify_files(uri, m)
    store = Store(uri)
    for f in m["files"]:
        pf = pq.ParquetFile(store.path(f["path"]), filesystem=store.fs)
        for batch in pf.iter_batches(batch_size=batch_rows):
            for row in batch.to_pylist():
                yield decode_row(row, m)
