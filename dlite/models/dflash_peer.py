"""A peer's drafter in our harness: SpecForge's DFlash (`DFlashDraftModel`, exported by
`specforge export --to hf`) read with our own torch code into our drafter interface, so
`dlite.decoding.decode.speculative_generate` replays it losslessly beside ours (issue 31).
No SpecForge import: the directory is config.json + model.safetensors.

Their layout (read in specforge 0.2.0 `modeling/draft/dflash.py`): config.json is a
Qwen3 config (`architectures: [DFlashDraftModel]`, the layer sizes, `vocab_size`) plus
`block_size` (anchor + gamma), `num_target_layers`, `layer_types` and `dflash_config`
{target_layer_ids, mask_token_id}; model.safetensors holds `fc.weight` [H, K*H_t],
`hidden_norm.weight`, `layers.N.*` (transformers' Qwen3DecoderLayer names) and
`norm.weight`. The target's embedding and lm_head are not in it (theirs are frozen and
shared). A round: the features of the newly verified positions go through
`hidden_norm(fc(.))` and become keys/values of every layer (a cache growing with the
context); the block [anchor, MASK x gamma] at positions anchor_pos.. attends to that
cache and to itself (no mask); rows 1..gamma of `norm(.)` go through the target's
lm_head, all in one product, and slot j's token is the argmax / a sample of row j.

That is our DSpark-style baseline's backbone without its Markov head, so the parts are
ours: `hist_proj`/`hist_norm`/`backbone` as in `dlite.models.dspark`, and the same
`HistoryCache` / `extend_history`. Differences kept: the block is gamma + 1 long with
same-position prediction (ours is gamma long, shifted), MASK is a target row, and every
block is verified whole, as in its own loop (`eval.draft_stop_prob` is not applied)."""

import json
from pathlib import Path
from typing import Optional

import torch
from torch import nn

from dlite.export import WEIGHTS, ArtifactError, _check_header, _check_target
from dlite.models.config import DrafterConfig
from dlite.models.history import HistoryCache, extend_history
from dlite.models.layers import Backbone, RMSNorm

ARCHITECTURE = "DFlashDraftModel"
RENAME = (("fc.", "hist_proj."), ("hidden_norm.", "hist_norm."), ("layers.", "backbone.layers."),
          ("norm.", "backbone.norm."))


def is_dflash_export(path) -> bool:
    """A directory whose config.json names SpecForge's `DFlashDraftModel`."""
    try:
        config = json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and ARCHITECTURE in (config.get("architectures") or [])


def read_dflash_config(path) -> dict:
    """config.json of a DFlash export, refused (ArtifactError, one line) where our
    replay would not compute what theirs does."""
    f = Path(path) / "config.json"
    c = json.loads(f.read_text())
    d = c.get("dflash_config") or {}
    rope = c.get("rope_parameters") or {"rope_type": "default"}
    checks = [
        (d.get("mask_token_id") is None, "dflash_config.mask_token_id is missing"),
        (not d.get("target_layer_ids"), "dflash_config.target_layer_ids is missing"),
        (set(c.get("layer_types") or ["full_attention"]) != {"full_attention"},
         f"layer_types {c.get('layer_types')}: only full_attention layers are replayed"),
        (c.get("attention_bias", False), "attention_bias=true is not supported"),
        (c.get("hidden_act", "silu") != "silu", f"hidden_act {c.get('hidden_act')!r} (only silu)"),
        (rope.get("rope_type", "default") != "default", f"rope_type {rope.get('rope_type')!r} (only default)"),
        (not isinstance(c.get("block_size"), int) or c["block_size"] < 2, "block_size must be an int >= 2"),
        # Our capture hooks a layer's raw output; HF's hidden_states[-1] (theirs) is post-norm.
        ((c.get("num_target_layers") or 0) - 1 in (d.get("target_layer_ids") or []),
         "target_layer_ids include the target's last layer, whose HF hidden state is post-norm"),
    ]
    bad = [msg for cond, msg in checks if cond]
    if bad:
        raise ArtifactError(f"{f}: a {ARCHITECTURE} export this replay cannot run: {'; '.join(bad)}")
    return c


def drafter_config(c: dict) -> DrafterConfig:
    """Our backbone config for their sizes (gamma = block_size - 1)."""
    heads = c["num_attention_heads"]
    return DrafterConfig(arch="specforge_dflash", gamma=c["block_size"] - 1,
                         target_layer_ids=list(c["dflash_config"]["target_layer_ids"]),
                         hidden_size=c["hidden_size"], num_layers=c["num_hidden_layers"],
                         num_heads=heads, num_kv_heads=c.get("num_key_value_heads", heads),
                         head_dim=c.get("head_dim") or c["hidden_size"] // heads,
                         intermediate_size=c["intermediate_size"], rms_norm_eps=c["rms_norm_eps"],
                         rope_theta=float((c.get("rope_parameters") or {}).get("rope_theta", c.get("rope_theta"))),
                         head="none", draft_vocab_size=None)


class DFlashPeerDrafter(nn.Module):
    """SpecForge's DFlash as our drafter: history K/V, block of gamma + 1, one lm_head product."""

    needs_history = True

    def __init__(self, cfg: DrafterConfig, embed_weight: torch.Tensor, lm_head_weight: torch.Tensor,
                 mask_token_id: int):
        super().__init__()
        self.cfg, self.gamma, self.target_layer_ids = cfg, cfg.gamma, list(cfg.target_layer_ids)
        self.target_hidden = embed_weight.shape[1]
        self.feature_dim = self.target_hidden * len(self.target_layer_ids)
        self.hist_proj = nn.Linear(self.feature_dim, cfg.hidden_size, bias=False)
        self.hist_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.backbone = Backbone(cfg, self.target_hidden)
        # Frozen target parts, kept out of the state dict (as theirs: not in the export);
        # detached so an nn.Parameter of the target is not registered as one of ours.
        self.embed_weight, self.lm_head_weight = embed_weight.detach(), lm_head_weight.detach()
        self.mask_token_id = mask_token_id

    def new_state(self) -> HistoryCache:
        w = self.hist_proj.weight
        return HistoryCache(self.backbone, w.dtype, w.device, reserve=self.gamma + 1)

    @torch.no_grad()
    def draft(self, state: HistoryCache, new_features: torch.Tensor, anchor_id: int, anchor_pos: int,
              temperature: float, generator: Optional[torch.Generator] = None):
        """Extend the cache with the newly verified positions, run [anchor, MASK x gamma]
        over it, project rows 1..gamma at once; greedy argmax or a sample per row."""
        feats = new_features.reshape(-1, self.feature_dim)
        extend_history(self, state, feats, anchor_pos)
        dev, n = feats.device, self.gamma + 1
        ids = torch.full((n,), self.mask_token_id, device=dev)
        ids[0] = anchor_id
        x = self.embed_weight[ids][None].to(self.hist_proj.weight.dtype)
        h = self.backbone(x, anchor_pos + torch.arange(n, device=dev)[None], state)
        logits = self.backbone.norm(h[0, 1:]).to(self.lm_head_weight.dtype) @ self.lm_head_weight.T
        if temperature <= 0:
            return logits.argmax(-1), None, state
        probs = torch.softmax(logits.float() / temperature, dim=-1)
        return torch.multinomial(probs, 1, generator=generator)[:, 0], probs, state

    def cache_bytes(self, state: Optional[HistoryCache]) -> int:
        return 0 if state is None else state.nbytes()


def check_dflash(path, target_fingerprint=None) -> str:
    """What `dlite.export.check_artifact` verifies for a DFlash export (it records no
    checksum: the safetensors header's own length is the check)."""
    path = Path(path)
    config = read_dflash_config(path)
    if not (path / WEIGHTS).is_file():
        raise ArtifactError(f"{path / WEIGHTS}: missing (a {ARCHITECTURE} export has config.json + {WEIGHTS})")
    _check_header(path / WEIGHTS)
    return f"{ARCHITECTURE} export, {WEIGHTS} size ok; {_check_target(path, config, target_fingerprint)}"


def load_dflash(path, embed_weight: torch.Tensor, lm_head_weight: torch.Tensor) -> DFlashPeerDrafter:
    """A DFlash export as a DFlashPeerDrafter around the target's embedding / lm_head;
    every tensor of model.safetensors is used, none is missing (strict)."""
    path = Path(path)
    c = read_dflash_config(path)
    if tuple(embed_weight.shape) != (c["vocab_size"], c["hidden_size"]):
        raise ValueError(f"{path}: target embedding {tuple(embed_weight.shape)} does not match the "
                         f"drafter's vocab_size x hidden_size ({c['vocab_size']}, {c['hidden_size']})")
    from safetensors.torch import load_file
    theirs = load_file(str(path / WEIGHTS), device=str(embed_weight.device))
    state = {}
    for key, t in theirs.items():
        new = next((new + key[len(old):] for old, new in RENAME if key.startswith(old)), None)
        if new is None:
            raise ArtifactError(f"{path / WEIGHTS}: tensor {key!r} has no place in {ARCHITECTURE}")
        state[new] = t
    with torch.device("meta"):  # every weight is assigned below
        model = DFlashPeerDrafter(drafter_config(c), embed_weight, lm_head_weight,
                                  int(c["dflash_config"]["mask_token_id"]))
    model.load_state_dict(state, strict=True, assign=True)
    return model.eval()
