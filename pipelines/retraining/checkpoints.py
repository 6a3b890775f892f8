"""Where a new target checkpoint comes from, for `pipelines.retraining.watch`: the sources a
watcher reads, what makes a checkpoint complete, and its fingerprint.

Sources (`--source`):
  /dir/of/ckpts      a local/NFS directory whose subdirectories are HF checkpoints: the
                     newest *complete* one is the candidate (rule below)
  /dir/ckpt          a single checkpoint directory (it holds config.json itself): a new
                     fingerprint appears when it is overwritten in place
  s3://bucket/prefix the same two layouts on any pyarrow filesystem URI (s3://, gs://,
                     file://); fingerprint = hash of (name, size, mtime) of the files the
                     target is made of, since pyarrow's listing exposes no ETags
  models:/name@alias a registered MLflow model version (or models:/name/<version>),
                     read from `tracking.uri`; fingerprint = hash of (name, version,
                     creation time, source); the job gets the pinned models:/name/<version>

A checkpoint is complete when it holds config.json and at least one *.safetensors
file, every shard named by a `*.safetensors.index.json` exists, no file or the
directory itself is named `*.tmp` / `*.incomplete` / `*.partial` / `INCOMPLETE`, and
its newest file is at least `min_age` seconds old (a writer that does not use
temporary names is still writing). The newest complete one is the one with the newest
such file (ties: the larger name). Only the newest is submitted: two checkpoints
landing between checks train once, on the later.
"""

import fnmatch
import functools
import hashlib
import json
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, Optional, Tuple

from omegaconf import OmegaConf

from pipelines.common import tracking
_PARTIAL = ("*.tmp", "*.incomplete", "*.partial", "INCOMPLETE", ".incomplete")
_TARGET_FILES = ("config.json", "*.safetensors", "*.safetensors.index.json",
                 "tokenizer*.json", "chat_template.jinja")


class WatchError(RuntimeError):
    """The source cannot be watched (missing directory, bad URI)."""


@dataclass
class Checkpoint:
    uri: str          # what target.path becomes in the submitted job
    fingerprint: str  # [0-9a-f-]: part of the submission id and of an MLflow tag key


Files = Dict[str, Tuple[int, float]]  # path relative to the checkpoint -> (size, mtime)


def _matches(name: str, patterns) -> bool:
    return any(fnmatch.fnmatch(name, p) for p in patterns)


def is_complete(name: str, files: Files, read: Callable[[str], bytes], min_age: float) -> bool:
    """The completeness rule of the module docstring; `read(rel)` reads one of `files`."""
    top = {f for f in files if "/" not in f}
    if _matches(name, _PARTIAL) or any(_matches(Path(f).name, _PARTIAL) for f in files):
        return False
    if "config.json" not in top or not any(f.endswith(".safetensors") for f in top):
        return False
    for index in (f for f in top if f.endswith(".safetensors.index.json")):
        try:
            shards = set(json.loads(read(index))["weight_map"].values())
        except (OSError, ValueError, KeyError):
            return False  # a half-written index
        if not shards <= top:
            return False
    return time.time() - max(m for _, m in files.values()) >= min_age


def _newest(groups: Dict[str, Files], read: Callable, min_age: float) -> Optional[str]:
    """The newest complete checkpoint's name; `read(name, rel)` reads one of its files."""
    done = [(max(m for _, m in fs.values()), name) for name, fs in groups.items()
            if is_complete(name, fs, functools.partial(read, name), min_age)]
    return max(done)[1] if done else None


def _group(files: Files) -> Dict[str, Files]:
    """{checkpoint name: its files}: the listing itself ("") when it holds config.json,
    else one group per first path component."""
    if "config.json" in files:
        return {"": files}
    groups: Dict[str, Files] = {}
    for rel, st in files.items():
        if "/" in rel:
            head, rest = rel.split("/", 1)
            groups.setdefault(head, {})[rest] = st
    return groups


def latest_local(path: Path, target_name: str, min_age: float) -> Optional[Checkpoint]:
    """The newest complete checkpoint under (or at) `path`, fingerprinted as the pipeline
    fingerprints its target (dlite.target), so the two records agree."""
    from dlite import target
    if not path.is_dir():
        raise WatchError(f"--source: no such directory {path}")
    files = {str(p.relative_to(path)): (st.st_size, st.st_mtime)
             for p in path.rglob("*") if p.is_file() and (st := p.stat())}
    name = _newest(_group(files), lambda n, rel: (path / n / rel).read_bytes(), min_age)
    if name is None:
        return None
    pick = str((path / name).resolve())
    fp = target.fingerprint(OmegaConf.create({"path": pick, "name": target_name, "revision": None}))
    return Checkpoint(pick, fp["id"])


def list_files(uri: str) -> tuple:
    """(filesystem, root, {path relative to root: pyarrow FileInfo}) of every file under
    a pyarrow filesystem URI (s3://, gs://, file://); OSError / ValueError when it
    cannot be listed. Shared with pipelines.common.target_fetch, which copies what it lists."""
    from pyarrow import fs as pafs
    filesystem, root = pafs.FileSystem.from_uri(uri)
    infos = filesystem.get_file_info(pafs.FileSelector(root, recursive=True))
    root = root.rstrip("/")
    return filesystem, root, {i.path[len(root) + 1:]: i for i in infos if i.type == pafs.FileType.File}


def latest_fs(uri: str, min_age: float) -> Optional[Checkpoint]:
    """The same rule over a pyarrow filesystem listing (S3 in production; file:// here)."""
    try:
        filesystem, root, files = list_files(uri)
    except (OSError, ValueError) as e:
        raise WatchError(f"--source: cannot list {uri}: {e}") from None
    groups = _group({rel: (i.size, i.mtime.timestamp()) for rel, i in files.items()})
    def read(name, rel):
        return filesystem.open_input_stream("/".join(filter(None, [root, name, rel]))).read()
    name = _newest(groups, read, min_age)
    if name is None:
        return None
    h = hashlib.sha256()
    for rel, (size, mtime) in sorted(groups[name].items()):
        if "/" not in rel and _matches(rel, _TARGET_FILES):
            h.update(f"{rel}|{size}|{mtime}\n".encode())
    return Checkpoint("/".join(filter(None, [uri.rstrip("/"), name])), h.hexdigest()[:16])


_MODEL_URI = re.compile(r"^models:/([^/@]+)(?:@([^/]+)|/(\d+))$")


def model_version(uri: str, tracking_uri: str):
    """The registered version `models:/name@alias` or `models:/name/<version>` names
    (an MLflow ModelVersion); ValueError naming `uri` when there is none. Shared with
    pipelines.common.target_fetch."""
    m = _MODEL_URI.match(uri)
    if not m:
        raise ValueError(f"{uri!r} is neither models:/<name>@<alias> nor models:/<name>/<version>")
    name, alias, version = m.groups()
    from mlflow.exceptions import MlflowException
    c = tracking.client(tracking_uri)
    try:
        return c.get_model_version_by_alias(name, alias) if alias else c.get_model_version(name, version)
    except MlflowException as e:
        raise ValueError(f"{uri}: {e.message}") from None


def latest_mlflow(uri: str, tracking_uri: str) -> Optional[Checkpoint]:
    try:
        mv = model_version(uri, tracking_uri)
    except ValueError as e:
        raise WatchError(f"--source: {e}") from None
    key = f"{mv.name}|{mv.version}|{mv.creation_timestamp}|{mv.source}"
    fingerprint = hashlib.sha256(key.encode()).hexdigest()[:16]
    return Checkpoint(f"models:/{mv.name}/{mv.version}", fingerprint)


def latest(cfg, opts) -> Optional[Checkpoint]:
    """The newest complete checkpoint of `opts.source` (watch.Options), or None."""
    src = opts.source
    if src.startswith("models:/"):
        return latest_mlflow(src, cfg.tracking.uri)
    if "://" in src:
        return latest_fs(src, opts.min_age)
    return latest_local(Path(src), cfg.target.name, opts.min_age)
