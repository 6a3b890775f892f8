"""What every drafter architecture shares: the `Drafter` protocol, the frozen target
vocabulary, the block helpers (embedding the block, its inputs), the teacher-forced
block layout for training and the sequential sampling loop."""

from typing import List, Optional, Protocol, Tuple

import torch
import torch.nn.functional as F
from torch import nn



class Drafter(Protocol):
    """What the speculative decoding loop and the trainer rely on (no base class).

    `draft` gets the features of the positions verified since the previous call (the
    whole prompt on the first call); the last row is position `anchor_pos - 1`. It
    returns gamma tokens, their draft distributions [gamma, V] (after temperature;
    at T=0 the T=1 softmax with argmax tokens) and the new state. `forward_train`
    takes the batch described in `block_layout` and returns teacher-forced logits
    [B, A, gamma, V] ([A, gamma, V] for one unbatched sequence)."""

    gamma: int
    target_layer_ids: List[int]
    needs_history: bool

    def new_state(self): ...
    def draft(self, state, new_features: torch.Tensor, anchor_id: int, anchor_pos: int,
              temperature: float, generator: Optional[torch.Generator] = None): ...
    def cache_bytes(self, state) -> int: ...
    def forward_train(self, batch: dict) -> torch.Tensor: ...


class FrozenVocab(nn.Module):
    """The target's token embedding and lm_head, shared and frozen: non-persistent
    buffers, so they never train and are never written into a drafter checkpoint."""

    def __init__(self, embed_weight: torch.Tensor, lm_head_weight: torch.Tensor, mask_token_id: int):
        super().__init__()
        if embed_weight.shape != lm_head_weight.shape:
            raise ValueError(f"embed {tuple(embed_weight.shape)} != "
                             f"lm_head {tuple(lm_head_weight.shape)}")
        if not 0 <= mask_token_id < embed_weight.shape[0]:
            raise ValueError(f"mask_token_id {mask_token_id} outside vocab {embed_weight.shape[0]}")
        self.register_buffer("embed_weight", embed_weight.detach(), persistent=False)
        self.register_buffer("lm_head_weight", lm_head_weight.detach(), persistent=False)
        self.mask_token_id = mask_token_id

    def embed(self, ids):
        return F.embedding(ids, self.embed_weight)


def attach_target(model: nn.Module, cfg, embed_weight: torch.Tensor,
                  lm_head_weight: torch.Tensor, mask_token_id: int) -> None:
    """What every drafter architecture records about its target: gamma, the captured
    layers, the frozen shared vocabulary and the context-feature width."""
    if cfg.gamma < 2:
        raise ValueError(f"drafter.gamma must be >= 2, got {cfg.gamma}")
    model.cfg, model.gamma = cfg, cfg.gamma
    model.target_layer_ids = list(cfg.target_layer_ids)
    model.vocab = FrozenVocab(embed_weight, lm_head_weight, mask_token_id)
    model.target_hidden = embed_weight.shape[1]
    model.feature_dim = len(cfg.target_layer_ids) * model.target_hidden


def init_weights(module: nn.Module, std: float = 0.02):
    """Normal(0, std) linears, unit norms; zero_init-tagged linears start at zero so
    optional heads begin as the identity / a zero bias. Skipped on `meta` (size-only
    builds), where the first init call alone costs seconds."""
    for m in module.modules():
        if isinstance(m, nn.Linear) and m.weight.device.type != "meta":
            if getattr(m, "zero_init", False):
                nn.init.zeros_(m.weight)
            else:
                nn.init.normal_(m.weight, std=std)
            if m.bias is not None:
                nn.init.zeros_(m.bias)


def param_count(module: nn.Module) -> int:
    """Trainable parameters (the frozen vocabulary is buffers, so never counted)."""
    return sum(p.numel() for p in module.parameters() if p.requires_grad)



def embed_in(model, ids):
    """Frozen target embedding, projected to the drafter width when they differ."""
    return model.backbone.in_proj(model.vocab.embed(ids))



def block_inputs(model, anchor_id: int, anchor_pos: int, device):
    """Backbone input [1, g, hid] for [anchor, MASK...] and its positions [1, g]."""
    ids = torch.full((1, model.gamma), model.vocab.mask_token_id, device=device)
    ids[0, 0] = anchor_id
    return embed_in(model, ids), anchor_pos + torch.arange(model.gamma, device=device)[None]


# ---------------------------------------------------------------- training layout


def gather_positions(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """x [B, L, ...], idx [B, ...] (clamped into 0..L-1) -> [B, ..., ...]."""
    B, L = x.shape[:2]
    flat = idx.clamp(0, L - 1).reshape(B, -1)
    out = x[torch.arange(B, device=x.device)[:, None], flat]
    return out.reshape(*idx.shape, *x.shape[2:])


def as_batched(batch: dict) -> Tuple[dict, bool]:
    """Accept one sequence (input_ids [L]) or a batch ([B, L]); return the batch form."""
    if batch["input_ids"].dim() == 2:
        return batch, False
    return {k: (v.unsqueeze(0) if torch.is_tensor(v) else v) for k, v in batch.items()}, True


def block_layout(batch: dict, gamma: int, mask_token_id: int) -> dict:
    """Teacher-forced blocks for all anchors: backbone input ids [anchor, MASK...],
    head input ids [anchor, x*_1..x*_{g-1}], block/context positions, anchor index.

    The training batch (`forward_train` of every drafter), B packed sequences of L:
      features     [B, L, K*H_t]  target layer outputs per position (row p = position p)
      input_ids    [B, L]         tokens
      anchors      [B, A]         anchor positions, 1 <= a <= L-1 (pad with any such value
                                  and drop the block through the loss's `valid`)
      position_ids [B, L]         optional RoPE positions (default 0..L-1; restart them
                                  per packed document)
      seq_ids      [B, L]         optional document id per position: history never
                                  crosses documents (teacher / DSpark)
    Unbatched tensors ([L, ...], anchors [A]) are accepted too. Extra keys are ignored."""
    ids, anchors = batch["input_ids"], batch["anchors"]
    B, L = ids.shape
    pos_ids = batch.get("position_ids")
    if pos_ids is None:
        pos_ids = torch.arange(L, device=ids.device).expand(B, L)
    offs = torch.arange(gamma, device=ids.device)
    slots = anchors[..., None] + offs                              # [B, A, g]
    prev = gather_positions(ids, slots)
    blk = prev.clone()
    blk[..., 1:] = mask_token_id
    a_pos = gather_positions(pos_ids, anchors)
    return dict(block_ids=blk, prev_ids=prev, block_pos=a_pos[..., None] + offs,
                ctx_idx=anchors - 1, ctx_pos=gather_positions(pos_ids, anchors - 1))


# ---------------------------------------------------------------- inference


def sample_block(step, gamma: int, anchor_id: int, temperature: float, device,
                 generator: Optional[torch.Generator] = None):
    """Walk the block left to right: step(k, prev_token [1], state) -> (logits [V], state).
    Tokens stay on device (no host sync per slot). T=0: argmax, probs at T=1."""
    prev = torch.tensor([anchor_id], device=device)
    tokens, probs, state = [], [], None
    for k in range(gamma):
        logits, state = step(k, prev, state)
        logits = logits.float()
        if temperature > 0:
            p = torch.softmax(logits / temperature, dim=-1)
            prev = torch.multinomial(p, 1, generator=generator)
        else:
            p = torch.softmax(logits, dim=-1)
            prev = logits.argmax(-1, keepdim=True)
        tokens.append(prev)
        probs.append(p)
    return torch.cat(tokens), torch.stack(probs)
