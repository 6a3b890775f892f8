"""The drafter artifact (ARCHITECTURE.md §3): a directory with `config.json`,
`model.safetensors` and a `README.md` model card, loadable without any training code.
Weights are safetensors only (never pickle). The target's frozen embedding and lm_head
are NOT stored: the target supplies them at load time. What the drafter owns beyond
them is: a learned MASK embedding (`vocab.mask_embed`) when the target has no spare
embedding row, and the draft vocabulary's id map (`vocab.draft_ids`) when it drafts
over a subset of the target's tokens; config.json says which (`mask_embedding`,
`draft_vocab_size`)."""

import dataclasses
import json
from pathlib import Path
from typing import Dict, Optional

import torch
from safetensors.torch import load_file, save_file

from dlite.models import LEARNED_MASK, build_drafter, param_count
from dlite.models.config import DrafterConfig

FORMAT = "dlite-drafter"
FORMAT_VERSION = 1


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
        f"- draft vocabulary: {_vocab_line(config)}", "",
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
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": FORMAT})
    (out / "README.md").write_text(model_card(config, card_sections))
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    return out


def _drafter_cfg(raw: dict) -> DrafterConfig:
    known = {f.name for f in dataclasses.fields(DrafterConfig)}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise ValueError(f"drafter_config has fields this version does not know: {unknown}")
    return DrafterConfig(**raw)


def load_drafter(path, embed_weight: torch.Tensor, lm_head_weight: torch.Tensor):
    """Rebuild the drafter from `path` around the target's embedding / lm_head (checked
    against the stored vocabulary and width); weights keep their stored dtype."""
    path = Path(path)
    config = json.loads((path / "config.json").read_text())
    if config.get("format") != FORMAT:
        raise ValueError(f"{path} is not a {FORMAT} directory (format={config.get('format')!r})")
    want = (config["vocab_size"], config["target_hidden_size"])
    if tuple(embed_weight.shape) != want or tuple(lm_head_weight.shape) != want:
        raise ValueError(f"target embedding/lm_head {tuple(embed_weight.shape)}/"
                         f"{tuple(lm_head_weight.shape)} do not match the drafter's {want}")
    cfg = _drafter_cfg(config["drafter_config"])
    state = load_file(str(path / "model.safetensors"), device=str(embed_weight.device))
    draft_ids = state.get("vocab.draft_ids")  # built into the model: it slices the lm_head
    n = None if draft_ids is None else draft_ids.numel()
    if n != config.get("draft_vocab_size") or n != cfg.draft_vocab_size:
        raise ValueError(f"{path}: config.json says draft_vocab_size={config.get('draft_vocab_size')} "
                         f"but model.safetensors holds {n or 'no'} draft vocabulary ids")
    if (config.get("mask_embedding") == "learned") != ("vocab.mask_embed" in state):
        raise ValueError(f"{path}: mask_embedding={config.get('mask_embedding')!r} disagrees with "
                         f"model.safetensors")
    with torch.device("meta"):  # no throw-away random init: every weight is assigned below
        model = build_drafter(cfg, embed_weight, lm_head_weight, config["mask_token_id"], draft_ids)
    model.load_state_dict(state, strict=True, assign=True)
    return model.eval()
