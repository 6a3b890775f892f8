"""The authors' checkpoint layout (`DAI-System/DLite`, `DLiteDraftModel.from_pretrained`)
for our `dlite_v1` drafters, both ways: `export_published` writes it from one of our
artifacts (`dlite.export`), `load_published` reads a directory in it (theirs or ours)
into a `DLiteV1Drafter`. `dlite.export.load_drafter` / `check_artifact` detect it.

Their layout: `config.json` = a Qwen3 config (`architectures: [DLiteDraftModel]`,
`model_type: qwen3`, the backbone's sizes, `vocab_size`) plus `block_size` (anchor +
gamma), `num_target_layers` and `dlite_config` {architecture_version dlite_v1,
model_role pivot_q_student, anchor_group_size, chs_num_layers, target_layer_ids,
sequential_head rnn, sequential_rank, mask_token_id}; `model.safetensors` with
`layers.*`, `norm.weight`, `layer_depth_embedding.weight`, `context_norm.weight`,
`sequential_head.{prev_token_embedding,state_proj,state_hidden_mlp,output_proj}.*`.
Nothing else: not the target's embedding, nor its final-norm weight (their runtime
takes HF's post-norm `hidden_states[-1]`), which our model holds -- so reading their
layout needs `final_norm_weight` from the target.

Only `dlite_v1` artifacts with a target-row MASK and the full vocabulary can be written:
our `dlite` (one fused context vector, a GRU in hidden space through the target's
lm_head), `teacher` and `dspark` (history K/V) have no counterpart in it, and a learned
MASK row or a draft vocabulary has no key there."""

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from dlite.export import WEIGHTS, ArtifactError, _check_header, _check_target, read_config
from dlite.models import LEARNED_MASK, build_drafter
from dlite.models.config import DrafterConfig
from dlite.models.dlite_v1 import published_layer_ids

ARCHITECTURE = "DLiteDraftModel"
VERSION, ROLE, HEAD = "dlite_v1", "pivot_q_student", "rnn"
REQUIRED = ("model_role", "anchor_group_size", "chs_num_layers", "target_layer_ids",
            "sequential_head", "sequential_rank")
# our state_dict prefix -> theirs; `target_norm_weight` is ours only (the target's weight)
RENAME = (("backbone.layers.", "layers."), ("backbone.norm.", "norm."))


def is_published(path) -> bool:
    """A directory whose config.json names their `DLiteDraftModel`."""
    f = Path(path) / "config.json"
    try:
        config = json.loads(f.read_text())
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and ARCHITECTURE in (config.get("architectures") or [])


def _published_config(ours: dict) -> dict:
    """Their config.json from our artifact's; ArtifactError when it has no counterpart."""
    d, arch = ours.get("drafter_config", {}), ours.get("architecture")
    if arch != "dlite_v1":
        raise ArtifactError(f"architecture {arch!r}: only dlite_v1 drafters can be written in the "
                            f"published layout (dlite: one fused context vector through the target's "
                            f"lm_head; teacher / dspark: history K/V)")
    if d.get("v1_teacher"):  # their swa_teacher role keys its history path differently
        raise ArtifactError("a dlite_v1 teacher (drafter_config.v1_teacher): only the student "
                            "(pivot_q_student) is written in the published layout")
    if ours.get("mask_embedding") == "learned" or ours.get("mask_token_id", LEARNED_MASK) < 0:
        raise ArtifactError("mask_embedding 'learned': the published layout has no key for a learned "
                            "MASK row (their runtime needs mask_token_id = a vocabulary row)")
    if ours.get("draft_vocab_size") is not None:
        raise ArtifactError("draft_vocab_size: the published layout drafts over the full vocabulary")
    ids, n = list(d["target_layer_ids"]), d["num_layers"]
    return {
        "architectures": [ARCHITECTURE], "model_type": "qwen3", "hidden_size": ours["target_hidden_size"],
        "intermediate_size": d["intermediate_size"], "num_hidden_layers": n,
        "num_attention_heads": d["num_heads"], "num_key_value_heads": d["num_kv_heads"],
        "head_dim": d["head_dim"], "rms_norm_eps": d["rms_norm_eps"], "hidden_act": "silu",
        "rope_theta": d["rope_theta"],
        "rope_parameters": {"rope_type": "default", "rope_theta": d["rope_theta"]},
        "attention_bias": False, "attention_dropout": 0.0, "layer_types": ["full_attention"] * n,
        "sliding_window": None, "use_sliding_window": False, "tie_word_embeddings": False,
        "max_position_embeddings": 32768, "vocab_size": ours["vocab_size"], "dtype": ours["dtype"],
        "block_size": d["gamma"] + 1, "num_target_layers": max(ids) + 1,
        "dlite_config": {"architecture_version": VERSION, "model_role": ROLE,
                         "anchor_group_size": d["anchor_group_size"], "chs_num_layers": len(ids),
                         "target_layer_ids": ids, "sequential_head": HEAD,
                         "sequential_rank": d["sequential_rank"], "mask_token_id": ours["mask_token_id"]},
        # lineage, ignored by their loader (HF keeps unknown config fields)
        **{k: ours[k] for k in ("target_fingerprint", "target_name") if k in ours},
    }


def _rename(state: dict, to_theirs: bool) -> dict:
    out = {}
    for key, t in state.items():
        for ours, theirs in RENAME:
            a, b = (ours, theirs) if to_theirs else (theirs, ours)
            if key.startswith(a):
                key = b + key[len(a):]
                break
        out[key] = t
    return out


def export_published(src, out_dir) -> Path:
    """Write our dlite_v1 artifact `src` in the authors' layout at `out_dir` (config.json
    last, as `dlite.export.save_drafter`). Reads files only: no target needed."""
    out = Path(out_dir)
    if out.resolve() == Path(src).resolve() or (out / "config.json").exists():
        # would overwrite our artifact (read through mmap) or mix two drafters' files
        raise ArtifactError(f"--out {out}: already holds a drafter's config.json; write to a new directory")
    config = read_config(src)
    theirs = _published_config(config)
    state = load_file(str(Path(src) / WEIGHTS))
    state.pop("target_norm_weight", None)
    out.mkdir(parents=True, exist_ok=True)
    save_file(_rename(state, True), str(out / WEIGHTS), metadata={"format": "pt"})  # HF wants "pt"
    (out / "config.json").write_text(json.dumps(theirs, indent=2))
    return out


def _field(f: Path, name: str, got, want) -> None:
    raise ArtifactError(f"{f}: {name}={got!r}, but the published DLite layout needs {want}")


def published_drafter_config(path) -> tuple:
    """(DrafterConfig, mask_token_id, the raw config) from their config.json, each field
    checked as their `DLiteDraftModel.__init__` checks it; else ArtifactError naming it."""
    f = Path(path) / "config.json"
    c = json.loads(f.read_text())
    dc = c.get("dlite_config")
    if not isinstance(dc, dict):
        _field(f, "dlite_config", dc, "a dict")
    if dc.get("architecture_version") != VERSION:
        _field(f, "dlite_config.architecture_version", dc.get("architecture_version"), repr(VERSION))
    if str(dc.get("model_role", "")).lower() != ROLE:
        _field(f, "dlite_config.model_role", dc.get("model_role"), repr(ROLE))
    missing = [k for k in REQUIRED if k not in dc]
    if missing:
        raise ArtifactError(f"{f}: dlite_config is missing {missing}")
    if str(dc["sequential_head"]).lower() != HEAD:
        _field(f, "dlite_config.sequential_head", dc["sequential_head"], repr(HEAD))
    ids, k, depth = list(dc["target_layer_ids"]), int(dc["chs_num_layers"]), c.get("num_target_layers")
    if len(ids) != k:
        _field(f, "dlite_config.target_layer_ids", ids, f"chs_num_layers={k} ids")
    inside = isinstance(depth, int) and all(isinstance(i, int) and 0 <= i < depth for i in ids)
    if not inside or not 2 <= k <= depth:
        _field(f, "dlite_config.target_layer_ids", ids, f"ids inside the target's num_target_layers={depth}")
    if ids != published_layer_ids(depth, k):
        _field(f, "dlite_config.target_layer_ids", ids,
               f"the fixed selection {published_layer_ids(depth, k)}")
    if dc["anchor_group_size"] not in (1, 2):
        _field(f, "dlite_config.anchor_group_size", dc["anchor_group_size"], "1 or 2 (here)")
    rope = c.get("rope_parameters") or {"rope_type": "default", "rope_theta": c.get("rope_theta", 10000.0)}
    if rope.get("rope_type", "default") != "default":
        _field(f, "rope_parameters.rope_type", rope.get("rope_type"), "'default'")
    cfg = DrafterConfig(
        arch="dlite_v1", gamma=int(c["block_size"]) - 1, target_layer_ids=ids, hidden_size=c["hidden_size"],
        num_layers=c["num_hidden_layers"], num_heads=c["num_attention_heads"],
        num_kv_heads=c["num_key_value_heads"],
        head_dim=c.get("head_dim", c["hidden_size"] // c["num_attention_heads"]),
        intermediate_size=c["intermediate_size"], rms_norm_eps=c.get("rms_norm_eps", 1e-6),
        rope_theta=float(rope.get("rope_theta", 10000.0)), anchor_group_size=int(dc["anchor_group_size"]),
        sequential_rank=int(dc["sequential_rank"]))
    return cfg, dc.get("mask_token_id"), c


def check_published(path, target_fingerprint=None) -> str:
    """`dlite.export.check_artifact` for their layout: config fields, weights present and
    as long as their header says (their layout records no checksum)."""
    path = Path(path)
    published_drafter_config(path)
    if not (path / WEIGHTS).is_file():
        raise ArtifactError(f"{path / WEIGHTS}: missing (config.json is there: an incomplete copy?)")
    _check_header(path / WEIGHTS)
    target = _check_target(path, json.loads((path / "config.json").read_text()), target_fingerprint)
    return f"published {VERSION} layout; no checksums recorded; {WEIGHTS} size ok; {target}"


def load_published(path, embed_weight: torch.Tensor, lm_head_weight: torch.Tensor,
                   final_norm_weight=None):
    """A `DLiteV1Drafter` from a directory in the authors' layout, around the target's
    embedding / lm_head and its final-norm weight (none of them stored there)."""
    path = Path(path)
    cfg, mask, c = published_drafter_config(path)
    f = path / "config.json"
    if (c["vocab_size"], c["hidden_size"]) != tuple(embed_weight.shape):
        _field(f, "vocab_size, hidden_size", (c["vocab_size"], c["hidden_size"]),
               f"the target's embedding {tuple(embed_weight.shape)}")
    if not isinstance(mask, int) or not 0 <= mask < embed_weight.shape[0]:
        _field(f, "dlite_config.mask_token_id", mask, f"a vocabulary row 0..{embed_weight.shape[0] - 1}")
    if final_norm_weight is None:
        raise ArtifactError(f"{path}: the published layout reads the target's post-norm last layer: "
                            f"load it with final_norm_weight=target.model.norm.weight")
    state = _rename(load_file(str(path / WEIGHTS), device=str(embed_weight.device)), False)
    dtype = next(iter(state.values())).dtype
    state["target_norm_weight"] = final_norm_weight.detach().to(embed_weight.device, dtype)
    with torch.device("meta"):  # every weight is assigned below
        model = build_drafter(cfg, embed_weight, lm_head_weight, mask, final_norm_weight=final_norm_weight)
    try:
        model.load_state_dict(state, strict=True, assign=True)
    except RuntimeError as e:
        raise ArtifactError(f"{path / WEIGHTS}: not the tensors config.json describes "
                            f"({str(e).splitlines()[0]} ...)") from None
    return model.eval()
