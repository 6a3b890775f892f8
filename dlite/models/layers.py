"""The transformer pieces every drafter backbone is built from: RMSNorm, RoPE,
Qwen3-style attention (optionally joined with extra per-layer keys from a memory),
the MLP, the decoder layer and the backbone with its input/output projections."""

from typing import List, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from dlite.few_rows import few_rows_linear
from dlite.models.config import DrafterConfig


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

    def query(self, x, cos, sin):
        """Queries [B, heads, S, D] of states x [B, S, hidden]."""
        shape = (*x.shape[:-1], -1, self.head_dim)
        return apply_rope(self.q_norm(self.q_proj(x).view(shape)).transpose(1, 2), cos, sin)

    def out(self, o, x_shape):
        """The output projection of attention output o [B, heads, S, D]."""
        return self.o_proj(o.transpose(1, 2).reshape(*x_shape[:-1], -1))

    def forward(self, x, cos, sin, mem=None, mask=None):
        q = self.query(x, cos, sin)
        k, v = self.project_kv(x, cos, sin)
        if mem is not None:
            k, v = mem.join(self.layer_idx, k, v)
        gqa = self.n_kv != self.n_heads
        if gqa and mask is not None:
            # Masked (packed training) attention: expand K/V so the memory-efficient
            # kernel applies; GQA + arbitrary mask can otherwise fall back to math.
            k, v = (t.repeat_interleave(self.n_heads // self.n_kv, dim=1) for t in (k, v))
            gqa = False
        return self.out(F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa), x.shape)


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
        # One slot at a time while drafting: the few-row product is ~3x faster on CPU.
        # In the frozen lm_head's dtype (the target's, which a loaded drafter's may not be).
        return few_rows_linear(self.out_proj(self.norm(h)).to(lm_head_weight.dtype), lm_head_weight)
