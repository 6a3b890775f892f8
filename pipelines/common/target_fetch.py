"""Targets that live elsewhere: `target.path` may name an object-store checkpoint
(`s3://bucket/ckpt`, `gs://…`, `file:///…`: any pyarrow filesystem URI) or a registered
MLflow model version (`models:/name/<version>`, `models:/name@alias`), which is what
`jobs.watch_target` submits. Before any stage runs, the pipeline copies it once into
`<run.output_dir>/targets/<name>-<key>/` and uses that directory: `dlite.target` reads
local directories only (it imports neither pyarrow's S3 nor MLflow), and every node of a
cluster sees `run.output_dir` (a shared volume in production, infra/k8s).

`key` names what was copied: the listing (file, size, mtime) for a filesystem URI, the
resolved version for a model URI (an alias is resolved first: it may move). The copy
lands under `.partial` and is renamed when complete, so a crash never leaves a
half-copied target that a rerun would trust; a rerun with the same key reuses it.
"""

import hashlib
import json
import re
import shutil
from pathlib import Path

from omegaconf import OmegaConf

_SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*://")
SOURCE_FILE = "dlite_source.json"


class TargetFetchError(RuntimeError):
    """The remote target cannot be resolved or copied (message names `target.path`)."""


def is_remote(path: str) -> bool:
    return bool(path) and (path.startswith("models:/") or bool(_SCHEME.match(path)))


def localize(cfg):
    """`cfg` with `target.path` replaced by a local copy when it is remote; else `cfg`."""
    src = cfg.target.path
    if not is_remote(src):
        return cfg
    fetch, key = (_model_version(src, cfg.tracking.uri) if src.startswith("models:/")
                  else _filesystem(src))
    safe = re.sub(r"[^A-Za-z0-9._-]+", "-", cfg.target.name).strip("-") or "target"
    dest = Path(cfg.run.output_dir).resolve() / "targets" / f"{safe}-{key}"
    if not (dest / SOURCE_FILE).is_file():
        partial = dest.with_name(dest.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
        root = _checkpoint_root(fetch(partial), src)
        (root / SOURCE_FILE).write_text(json.dumps({"source": src, "key": key}) + "\n")
        shutil.rmtree(dest, ignore_errors=True)
        root.rename(dest)
        shutil.rmtree(partial, ignore_errors=True)
    print(f"[target] {src} -> {dest}", flush=True)
    return OmegaConf.merge(cfg, {"target": {"path": str(dest)}})


def _checkpoint_root(d: Path, src: str) -> Path:
    """The directory holding config.json (registered models may nest the checkpoint)."""
    found = sorted(d.rglob("config.json"), key=lambda p: len(p.parts))
    if not found:
        raise TargetFetchError(f"target.path: {src} holds no config.json (not a HF checkpoint)")
    return found[0].parent


def _filesystem(uri: str):
    from pipelines.retraining.checkpoints import list_files
    try:
        filesystem, root, files = list_files(uri)
    except (OSError, ValueError) as e:
        raise TargetFetchError(f"target.path: cannot list {uri}: {e}") from None
    if not files:
        raise TargetFetchError(f"target.path: {uri} is empty")
    rels = sorted(files)
    key = hashlib.sha256("".join(f"{r}|{files[r].size}|{files[r].mtime_ns}\n" for r in rels).encode()).hexdigest()[:16]

    def fetch(into: Path) -> Path:
        for rel in rels:
            out = into / rel
            out.parent.mkdir(parents=True, exist_ok=True)
            with filesystem.open_input_stream(f"{root}/{rel}") as f, open(out, "wb") as g:
                shutil.copyfileobj(f, g, 1 << 24)
        return into
    return fetch, key


def _model_version(uri: str, tracking_uri: str):
    from mlflow.exceptions import MlflowException
    from pipelines.retraining.checkpoints import model_version
    try:
        mv = model_version(uri, tracking_uri)
    except ValueError as e:
        raise TargetFetchError(f"target.path: {e}") from None

    def fetch(into: Path) -> Path:
        import mlflow
        import mlflow.artifacts
        if mv.source.startswith("models:/"):  # an MLflow 3 logged model: resolved via the registry
            mlflow.set_registry_uri(tracking_uri)
        try:
            return Path(mlflow.artifacts.download_artifacts(artifact_uri=mv.source, dst_path=str(into),
                                                            tracking_uri=tracking_uri))
        except MlflowException as e:
            raise TargetFetchError(f"target.path: {uri} (source {mv.source}): {e.message}") from None
    return fetch, f"{mv.name}-v{mv.version}"
