"""Blocks shared by the DLite drafter, the history-aware teacher and the DSpark-style
baseline: Qwen3-style decoder layers, RoPE, the backbone, the frozen target vocabulary,
the teacher-forced block layout for training, and the sequential sampling loop.
Every drafter implements the `Drafter` protocol below."""

from typing import List, Optional, Protocol, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from dlite.models.config import DrafterConfig


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


class RMSNorm(nn.Module):
    """Qwen3's RMSNorm (normalise in float32, scale in the input dtype)."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float, dtype):
    """cos/sin [..., head_dim] for integer positions, as Qwen3's default RoPE. Computed
    on the fly (no buffer) so casting the model to bf16 never degrades the frequencies."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=positions.device,
                                        dtype=torch.float32) / head_dim))
    freqs = positions[..., None].float() * inv
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x, cos, sin):
    """x [B, heads, S, D]; cos/sin [B, S, D]."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


class StaticMemory:
    """Per-layer precomputed keys/values placed before the block's own keys."""

    def __init__(self, kv: List[Tuple[torch.Tensor, torch.Tensor]]):
        self.kv = kv

    def join(self, layer: int, k, v):
        mk, mv = self.kv[layer]
        return torch.cat([mk, k], dim=2), torch.cat([mv, v], dim=2)


class Attention(nn.Module):
    """Qwen3 attention (per-head q/k RMSNorm, RoPE, GQA) that can also attend to extra
    memory keys/values (context feature, history) supplied per call via `mem.join`."""

    def __init__(self, cfg: DrafterConfig, layer_idx: int):
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_dim
        self.layer_idx = layer_idx
        self.n_heads, self.n_kv, self.head_dim = cfg.num_heads, cfg.num_kv_heads, d
        self.q_proj = nn.Linear(h, cfg.num_heads * d, bias=False)
        self.k_proj = nn.Linear(h, cfg.num_kv_heads * d, bias=False)
        self.v_proj = nn.Linear(h, cfg.num_kv_heads * d, bias=False)
        self.o_proj = nn.Linear(cfg.num_heads * d, h, bias=False)
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps)

    def project_kv(self, x, cos, sin):
        """Keys/values [B, kv_heads, S, D] of states x [B, S, hidden]."""
        shape = (*x.shape[:-1], -1, self.head_dim)
        k = self.k_norm(self.k_proj(x).view(shape)).transpose(1, 2)
        v = self.v_proj(x).view(shape).transpose(1, 2)
        return apply_rope(k, cos, sin), v

    def forward(self, x, cos, sin, mem=None, mask=None):
        shape = (*x.shape[:-1], -1, self.head_dim)
        q = apply_rope(self.q_norm(self.q_proj(x).view(shape)).transpose(1, 2), cos, sin)
        k, v = self.project_kv(x, cos, sin)
        if mem is not None:
            k, v = mem.join(self.layer_idx, k, v)
        gqa = self.n_kv != self.n_heads
        if gqa and mask is not None:
            # Masked (packed training) attention: expand K/V so the memory-efficient
            # kernel applies; GQA + arbitrary mask can otherwise fall back to math.
            k, v = (t.repeat_interleave(self.n_heads // self.n_kv, dim=1) for t in (k, v))
            gqa = False
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
        return self.o_proj(out.transpose(1, 2).reshape(*x.shape[:-1], -1))


class MLP(nn.Module):
    """SwiGLU feed-forward, as Qwen3."""

    def __init__(self, hidden: int, inter: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """Pre-norm residual layer; parameter names match transformers' Qwen3DecoderLayer."""

    def __init__(self, cfg: DrafterConfig, idx: int):
        super().__init__()
        self.self_attn = Attention(cfg, idx)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, mem=None, mask=None):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mem, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class Backbone(nn.Module):
    """The parallel block model: in-projection from the target width, N decoder layers,
    final norm and out-projection back to the target width (projections only when the
    drafter width differs). `forward` returns the raw residual stream; `logits` closes it."""

    def __init__(self, cfg: DrafterConfig, target_hidden: int):
        super().__init__()
        self.cfg = cfg
        same = cfg.hidden_size == target_hidden
        self.in_proj = nn.Identity() if same else nn.Linear(target_hidden, cfg.hidden_size, bias=False)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.out_proj = nn.Identity() if same else nn.Linear(cfg.hidden_size, target_hidden, bias=False)

    def rope(self, positions, dtype):
        return rope_cos_sin(positions, self.cfg.head_dim, self.cfg.rope_theta, dtype)

    def memory_kv(self, states, positions):
        """Per-layer K/V of memory states [B, M, hidden] at positions [B, M]."""
        cos, sin = self.rope(positions, states.dtype)
        return [layer.self_attn.project_kv(states, cos, sin) for layer in self.layers]

    def forward(self, x, positions, mem=None, mask=None):
        cos, sin = self.rope(positions, x.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin, mem, mask)
        return x

    def logits(self, h, lm_head_weight):
        return F.linear(self.out_proj(self.norm(h)), lm_head_weight)


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
