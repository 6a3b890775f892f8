"""The drafter artifact (ARCHITECTURE.md §3): a directory with `config.json`,
`model.safetensors` and a `README.md` model card, loadable without any training code.
Weights are safetensors only (never pickle). The target's frozen embedding and lm_head
are NOT stored: the target supplies them at load time. What the drafter owns beyond
them is: a learned MASK embedding (`vocab.mask_embed`) when the target has no spare
embedding row, and the draft vocabulary's id map (`vocab.draft_ids`) when it drafts
over a subset of the target's tokens; config.json says which (`mask_embedding`,
`draft_vocab_size`).

Format 2 adds `files` to config.json: the sha256 and size of `model.safetensors`, so a
truncated or altered copy is refused by `check_artifact` before any cluster work
(README.md is left out: publishing rewrites the card). Format 1 directories, without
it, still load; their check says "no checksums recorded"."""

import dataclasses
import hashlib
import json
from pathlib import Path
from typing import Dict, Optional

import torch

from dlite.models import LEARNED_MASK, build_drafter, param_count
from dlite.models.config import DrafterConfig

FORMAT = "dlite-drafter"
FORMAT_VERSION = 2  # 2: config.json `files` holds the weights' sha256 + size
WEIGHTS = "model.safetensors"


class ArtifactError(ValueError):
    """A drafter directory that cannot be used; the one-line message names the file."""


# Every drafter directory `load_drafter` / `check_artifact` read, as the error names them.
KNOWN_LAYOUTS = (f"{FORMAT} (ours: config.json format={FORMAT!r}); "
                 "DLiteDraftModel (the authors' published dlite_v1: config.json architectures); "
                 "DFlashDraftModel (SpecForge's DFlash, `specforge export --to hf`: config.json architectures)")


def drafter_config_dict(model, extra_config: dict) -> dict:
    """Everything needed to rebuild the model, plus the caller's lineage fields."""
    cfg = model.cfg
    ids = extra_config.get("target_layer_ids")
    if ids is not None and list(ids) != list(cfg.target_layer_ids):
        raise ValueError(f"extra_config target_layer_ids {ids} != model's {cfg.target_layer_ids}")
    out = dict(extra_config)
    out.update(format=FORMAT, format_version=FORMAT_VERSION, architecture=cfg.arch,
               gamma=cfg.gamma, target_layer_ids=list(cfg.target_layer_ids),
               drafter_config=dataclasses.asdict(cfg),
               target_hidden_size=model.target_hidden, vocab_size=model.vocab.embed_weight.shape[0],
               feature_dim=model.feature_dim, mask_token_id=model.vocab.mask_token_id,
               # "learned": MASK slots use `vocab.mask_embed` from model.safetensors (the
               # target had no spare row, mask_token_id = -1); "target_row": that frozen row.
               mask_embedding="learned" if model.vocab.mask_token_id == LEARNED_MASK else "target_row",
               # N ids in model.safetensors as `vocab.draft_ids` (None: the full vocabulary).
               draft_vocab_size=cfg.draft_vocab_size,
               num_parameters=param_count(model),
               dtype=str(next(model.parameters()).dtype).replace("torch.", ""))
    return out


def model_card(config: dict, card_sections: Optional[Dict[str, str]] = None) -> str:
    """A minimal card; `card_sections` (title -> markdown) adds e.g. the evaluation table."""
    sections = dict(card_sections or {})  # in the caller's order
    sections.setdefault("Evaluation", "Not evaluated yet.")
    target = config.get("target_name", config.get("target_fingerprint", "unknown target"))
    lines = [
        f"# {config['architecture']} drafter for {target}", "",
        f"- architecture: `{config['architecture']}`; gamma: {config['gamma']}",
        f"- target fingerprint: `{config.get('target_fingerprint', 'unknown')}`",
        f"- captured target layers: {config['target_layer_ids']}",
        f"- trainable parameters: {config['num_parameters']:,} ({config['dtype']})",
        f"- MASK: {_mask_line(config)}",
        f"- draft vocabulary: {_vocab_line(config)}",
        f"- weights sha256: `{(config.get('files') or {}).get(WEIGHTS, {}).get('sha256', 'not recorded')}`", "",
        "## Not in this directory",
        "The target's token embedding and `lm_head` are shared with the drafter and frozen;",
        "they are **not** stored in `model.safetensors`. Supply them from the target with",
        "the fingerprint above:", "",
        "```python",
        "from dlite.export import load_drafter",
        "drafter = load_drafter(path, target.get_input_embeddings().weight, target.lm_head.weight)",
        "```", "",
    ]
    for title, body in sections.items():
        lines += [f"## {title}", body.rstrip(), ""]
    return "\n".join(lines)


def _mask_line(config: dict) -> str:
    if config.get("mask_embedding") == "learned":
        return "a learned embedding (`vocab.mask_embed`, the target has no spare row)"
    return f"the target's unused row {config.get('mask_token_id')}"


def _vocab_line(config: dict) -> str:
    n = config.get("draft_vocab_size")
    if n is None:
        return f"the target's full {config.get('vocab_size')} tokens"
    return (f"{n} of the target's {config.get('vocab_size')} tokens (id map `vocab.draft_ids` in "
            f"model.safetensors); verification is unchanged, so decoding stays lossless")


def save_drafter(model, out_dir, extra_config: dict,
                 card_sections: Optional[Dict[str, str]] = None) -> Path:
    """Write weights, card, then config.json last: a directory without config.json is
    an interrupted save, never a loadable half-artifact."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = drafter_config_dict(model, extra_config)
    tensors = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    from safetensors.torch import save_file  # here: the module loads without it (dlite.bench.device)
    save_file(tensors, str(out / WEIGHTS), metadata={"format": FORMAT})
    config["files"] = {WEIGHTS: {"sha256": _sha256(out / WEIGHTS), "bytes": (out / WEIGHTS).stat().st_size}}
    (out / "README.md").write_text(model_card(config, card_sections))
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    return out


# ---------------------------------------------------------------- checks

def _sha256(f: Path) -> str:
    h = hashlib.sha256()
    with open(f, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def read_config(path) -> dict:
    """The config.json of a drafter directory this code can read, else ArtifactError."""
    path = Path(path)
    f = path / "config.json"
    if not path.is_dir():
        raise ArtifactError(f"{path}: no such directory (expected a {FORMAT} directory)")
    if not f.is_file():
        raise ArtifactError(f"{f}: missing: {path} is not a {FORMAT} directory (or its save was interrupted); "
                            f"known layouts: {KNOWN_LAYOUTS}")
    try:
        config = json.loads(f.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ArtifactError(f"{f}: not valid JSON ({e})") from None
    got = config.get("format") if isinstance(config, dict) else type(config).__name__
    if got != FORMAT:
        arch = config.get("architectures") if isinstance(config, dict) else None
        raise ArtifactError(f"{f}: format={got!r}, architectures={arch!r}: {path} is in no layout this "
                            f"code reads; known layouts: {KNOWN_LAYOUTS}")
    version = config.get("format_version", 1)
    if not isinstance(version, int) or version > FORMAT_VERSION:
        raise ArtifactError(f"{f}: format_version {version!r}, but this code reads {FORMAT} "
                            f"format_version <= {FORMAT_VERSION} (written by a newer dlite?)")
    return config


def check_artifact(path, target_fingerprint=None) -> str:
    """Refuse, with an ArtifactError of one line naming the file, a drafter directory
    that would only fail later (inside a Ray task): not a drafter, weights missing,
    truncated or altered (against config.json's `files`; format 1 records none, so only
    the size the safetensors header promises), or trained for a target other than
    `target_fingerprint` (an id or a fingerprint dict; None: not compared).
    Returns what was verified, for the caller's log line."""
    path = Path(path)
    from dlite.models import dlite_v1_io  # imports this module: loaded on first use
    if dlite_v1_io.is_published(path):  # the authors' layout (`DLiteDraftModel`)
        return dlite_v1_io.check_published(path, target_fingerprint)
    from dlite.models import dflash_peer
    if dflash_peer.is_dflash_export(path):  # a peer's drafter (SpecForge's `DFlashDraftModel`)
        return dflash_peer.check_dflash(path, target_fingerprint)
    config = read_config(path)
    if not (path / WEIGHTS).is_file():
        raise ArtifactError(f"{path / WEIGHTS}: missing (config.json is there: an incomplete copy?)")
    files = config.get("files")
    if isinstance(files, dict) and files:
        for name, record in files.items():
            _check_file(path / name, record)
        done = f"sha256 of {', '.join(files)} ok"
    else:
        _check_header(path / WEIGHTS)
        done = f"no checksums recorded (format_version {config.get('format_version', 1)}); {WEIGHTS} size ok"
    return f"{done}; {_check_target(path, config, target_fingerprint)}"


def _check_file(f: Path, record) -> None:
    record = record if isinstance(record, dict) else {}
    if not f.is_file():
        raise ArtifactError(f"{f}: missing (config.json records its checksum)")
    size = f.stat().st_size
    if size != record.get("bytes"):
        raise ArtifactError(f"{f}: {size} bytes, but config.json records {record.get('bytes')} "
                            f"(truncated or replaced)")
    sha = _sha256(f)
    if sha != record.get("sha256"):
        raise ArtifactError(f"{f}: sha256 {sha[:16]}... does not match config.json's "
                            f"{str(record.get('sha256'))[:16]}... (corrupted or altered)")


def _check_header(f: Path) -> None:
    """Without a recorded checksum, the file must at least be as long as its own header
    says (8 + header + the last tensor's end): that catches truncation cheaply."""
    size = f.stat().st_size
    with open(f, "rb") as fh:
        n = int.from_bytes(fh.read(8), "little")
        if size < 8 or 8 + n > size:
            raise ArtifactError(f"{f}: {size} bytes, too short for its safetensors header "
                                f"(truncated, or not a safetensors file)")
        raw = fh.read(n)
    try:
        header = json.loads(raw)
        end = max((t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"), default=0)
    except (ValueError, KeyError, TypeError, IndexError, AttributeError) as e:
        raise ArtifactError(f"{f}: unreadable safetensors header ({type(e).__name__}: {e})") from None
    if 8 + n + end != size:
        raise ArtifactError(f"{f}: {size} bytes, but its safetensors header describes {8 + n + end} "
                            f"(truncated or altered)")


def _check_target(path: Path, config: dict, want) -> str:
    from dlite.target import same_target
    have = config.get("target_fingerprint")
    if want is None:
        return "target fingerprint not compared"
    if have is None:
        return "no target fingerprint recorded"
    if not same_target(have, want):
        want = want.get("id") if isinstance(want, dict) else want
        raise ArtifactError(f"{path / 'config.json'}: drafter trained for target_fingerprint {have!r}, "
                            f"but the configured target's fingerprint is {want!r}")
    return "target fingerprint ok"


def _drafter_cfg(raw: dict) -> DrafterConfig:
    known = {f.name for f in dataclasses.fields(DrafterConfig)}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise ValueError(f"drafter_config has fields this version does not know: {unknown}")
    return DrafterConfig(**raw)


def load_drafter(path, embed_weight: torch.Tensor, lm_head_weight: torch.Tensor,
                 final_norm_weight: Optional[torch.Tensor] = None):
    """Rebuild the drafter from `path` around the target's embedding / lm_head (checked
    against the stored vocabulary and width); weights keep their stored dtype. A
    directory in the authors' published layout loads too (`dlite.models.dlite_v1_io`);
    it needs the target's `final_norm_weight`, which our dlite_v1 artifacts store. So
    does a SpecForge DFlash export (`dlite.models.dflash_peer`); any other layout is one
    ArtifactError listing the known ones (`KNOWN_LAYOUTS`)."""
    path = Path(path)
    from dlite.models import dlite_v1_io
    if dlite_v1_io.is_published(path):
        return dlite_v1_io.load_published(path, embed_weight, lm_head_weight, final_norm_weight)
    from dlite.models import dflash_peer
    if dflash_peer.is_dflash_export(path):
        return dflash_peer.load_dflash(path, embed_weight, lm_head_weight)
    config = read_config(path)
    want = (config["vocab_size"], config["target_hidden_size"])
    if tuple(embed_weight.shape) != want or tuple(lm_head_weight.shape) != want:
        raise ValueError(f"target embedding/lm_head {tuple(embed_weight.shape)}/"
                         f"{tuple(lm_head_weight.shape)} do not match the drafter's {want}")
    cfg = _drafter_cfg(config["drafter_config"])
    from safetensors.torch import load_file
    state = load_file(str(path / WEIGHTS), device=str(embed_weight.device))
    draft_ids = state.get("vocab.draft_ids")  # built into the model: it slices the lm_head
    n = None if draft_ids is None else draft_ids.numel()
    if n != config.get("draft_vocab_size") or n != cfg.draft_vocab_size:
        raise ValueError(f"{path}: config.json says draft_vocab_size={config.get('draft_vocab_size')} "
                         f"but model.safetensors holds {n or 'no'} draft vocabulary ids")
    if (config.get("mask_embedding") == "learned") != ("vocab.mask_embed" in state):
        raise ValueError(f"{path}: mask_embedding={config.get('mask_embedding')!r} disagrees with "
                         f"model.safetensors")
    # dlite_v1 keeps the target's final-norm weight among its own tensors
    parts = {"final_norm_weight": state["target_norm_weight"]} if "target_norm_weight" in state else {}
    with torch.device("meta"):  # no throw-away random init: every weight is assigned below
        model = build_drafter(cfg, embed_weight, lm_head_weight, config["mask_token_id"], draft_ids, **parts)
    model.load_state_dict(state, strict=True, assign=True)
    return model.eval()
