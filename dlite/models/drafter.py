"""The DLite drafter: history-free. Each round it sees one context feature (the target's
K chosen layer outputs at the last verified position), the anchor token and its
position; a parallel backbone drafts the whole block in one pass and a small
sequential head in hidden space walks it left to right. No cache, constant cost.

The sequential heads live here too; the history-aware teacher reuses them (and the
helpers below) unchanged so its state_dict keys line up with the student's."""

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from dlite.models.common import (Backbone, attach_target, RMSNorm, StaticMemory, as_batched,
                                 block_layout, gather_positions, init_weights, sample_block)
from dlite.models.config import DrafterConfig


class GRUHead(nn.Module):
    """s_k = GRUCell([h_k ; e(x_{k-1})], s_{k-1});  h~_k = h_k + W_o s_k.
    W_o starts at zero so a fresh head is the identity on the backbone's output."""

    def __init__(self, hidden: int, head_hidden: int, gamma: int, eps: float):
        super().__init__()
        self.in_norm = RMSNorm(2 * hidden, eps)
        self.cell = nn.GRUCell(2 * hidden, head_hidden)
        self.w_o = nn.Linear(head_hidden, hidden, bias=False)
        self.w_o.zero_init = True

    def step(self, h, e, state):
        s = self.cell(self.in_norm(torch.cat([h, e], -1)), state)
        return h + self.w_o(s), s

    def forward(self, h, e):
        state, outs = None, []
        for k in range(h.shape[1]):
            out, state = self.step(h[:, k], e[:, k], state)
            outs.append(out)
        return torch.stack(outs, 1)


class AttnHead(nn.Module):
    """One causal attention layer over u_k = W_in [h_k ; e(x_{k-1})] + slot_k; at
    inference the keys/values of earlier slots are kept for the current block only."""

    def __init__(self, hidden: int, head_hidden: int, gamma: int, eps: float):
        super().__init__()
        self.n_heads = max(1, head_hidden // 64)
        self.in_norm = RMSNorm(2 * hidden, eps)
        self.in_proj = nn.Linear(2 * hidden, head_hidden, bias=False)
        self.slot_emb = nn.Parameter(torch.zeros(gamma, head_hidden))
        self.qkv = nn.Linear(head_hidden, 3 * head_hidden, bias=False)
        self.w_o = nn.Linear(head_hidden, hidden, bias=False)
        self.w_o.zero_init = True

    def _qkv(self, h, e, first_slot: int):
        N, S, _ = h.shape
        u = self.in_proj(self.in_norm(torch.cat([h, e], -1))) + self.slot_emb[first_slot:first_slot + S]
        return self.qkv(u).view(N, S, 3, self.n_heads, -1).permute(2, 0, 3, 1, 4)

    def _out(self, h, s):
        return h + self.w_o(s.transpose(1, 2).reshape(*h.shape[:-1], -1))

    def step(self, h, e, state):
        q, k, v = self._qkv(h[:, None], e[:, None], 0 if state is None else state[0].shape[2])
        if state is not None:
            k, v = torch.cat([state[0], k], 2), torch.cat([state[1], v], 2)
        return self._out(h[:, None], F.scaled_dot_product_attention(q, k, v))[:, 0], (k, v)

    def forward(self, h, e):
        q, k, v = self._qkv(h, e, 0)
        return self._out(h, F.scaled_dot_product_attention(q, k, v, is_causal=True))


class NoHead(nn.Module):
    """Ablation: logits straight from the backbone's h_k."""

    def __init__(self, hidden: int, head_hidden: int, gamma: int, eps: float):
        super().__init__()

    def step(self, h, e, state):
        return h, state

    def forward(self, h, e):
        return h


HEADS = {"gru": GRUHead, "attn": AttnHead, "none": NoHead}


# ------------------------------------------------ helpers shared with the teacher

def build_student_parts(model: nn.Module, cfg: DrafterConfig, embed_weight, lm_head_weight,
                        mask_token_id: int):
    """Attach the parts DLite and the teacher share (same names => same state_dict keys)."""
    if cfg.context_injection not in ("kv", "add"):
        raise ValueError(f"drafter.context_injection must be 'kv' or 'add', "
                         f"got {cfg.context_injection!r}")
    if cfg.head not in HEADS:
        raise ValueError(f"drafter.head must be one of {sorted(HEADS)}, got {cfg.head!r}")
    attach_target(model, cfg, embed_weight, lm_head_weight, mask_token_id)
    model.ctx_proj = nn.Linear(model.feature_dim, cfg.hidden_size, bias=False)
    model.ctx_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
    model.backbone = Backbone(cfg, model.target_hidden)
    model.head = HEADS[cfg.head](cfg.hidden_size, cfg.head_hidden, cfg.gamma, cfg.rms_norm_eps)


def embed_in(model, ids):
    """Frozen target embedding, projected to the drafter width when they differ."""
    return model.backbone.in_proj(model.vocab.embed(ids))


def context_states(model, feats):
    """The context feature(s) [..., K*H_t] -> linear -> RMSNorm."""
    return model.ctx_norm(model.ctx_proj(feats.to(model.ctx_proj.weight.dtype)))


def head_logits(model, h, prev_ids):
    """Teacher-forced sequential head over a block: h [N, g, hid], prev_ids [N, g]."""
    return model.backbone.logits(model.head(h, embed_in(model, prev_ids)), model.vocab.lm_head_weight)


def block_inputs(model, anchor_id: int, anchor_pos: int, device):
    """Backbone input [1, g, hid] for [anchor, MASK...] and its positions [1, g]."""
    ids = torch.full((1, model.gamma), model.vocab.mask_token_id, device=device)
    ids[0, 0] = anchor_id
    return embed_in(model, ids), anchor_pos + torch.arange(model.gamma, device=device)[None]


def draft_tokens(model, h, anchor_id: int, temperature: float, generator=None):
    """Run the sequential head over the block's h [1, g, hid], choosing as it goes."""
    def step(k, prev, state):
        hk, state = model.head.step(h[:, k], embed_in(model, prev), state)
        return model.backbone.logits(hk, model.vocab.lm_head_weight)[0], state
    return sample_block(step, model.gamma, anchor_id, temperature, h.device, generator)


# ------------------------------------------------------------------ the drafter

class DLiteDrafter(nn.Module):
    """History-free drafter: backbone conditioned on one context feature + sequential
    head. Constructed with the target's frozen embedding / lm_head and the MASK id."""

    needs_history = False

    def __init__(self, cfg: DrafterConfig, embed_weight: torch.Tensor,
                 lm_head_weight: torch.Tensor, mask_token_id: int):
        super().__init__()
        build_student_parts(self, cfg, embed_weight, lm_head_weight, mask_token_id)
        init_weights(self)

    def _context(self, c, ctx_pos, x):
        """Inject context states c [N, hid] at ctx_pos [N, 1] into block inputs x."""
        if self.cfg.context_injection == "add":
            return x + c[:, None], None
        return x, StaticMemory(self.backbone.memory_kv(c[:, None], ctx_pos))

    def forward_train(self, batch: dict) -> torch.Tensor:
        """Teacher-forced logits [B, A, g, V] (or [A, g, V] for one sequence)."""
        batch, single = as_batched(batch)
        lay = block_layout(batch, self.gamma, self.vocab.mask_token_id)
        B, A, g = lay["block_ids"].shape
        c = context_states(self, gather_positions(batch["features"], lay["ctx_idx"]))
        x, mem = self._context(c.reshape(B * A, -1), lay["ctx_pos"].reshape(B * A, 1),
                               embed_in(self, lay["block_ids"].reshape(B * A, g)))
        h = self.backbone(x, lay["block_pos"].reshape(B * A, g), mem)
        logits = head_logits(self, h, lay["prev_ids"].reshape(B * A, g)).view(B, A, g, -1)
        return logits[0] if single else logits

    def new_state(self):
        return None

    @torch.no_grad()
    def draft(self, state, new_features: torch.Tensor, anchor_id: int, anchor_pos: int,
              temperature: float, generator: Optional[torch.Generator] = None):
        """Uses only the last feature row (position anchor_pos-1); keeps nothing."""
        feat = new_features.reshape(-1, self.feature_dim)[-1:]
        x, pos = block_inputs(self, anchor_id, anchor_pos, feat.device)
        x, mem = self._context(context_states(self, feat), pos[:, :1] - 1, x)
        h = self.backbone(x, pos, mem)
        tokens, probs = draft_tokens(self, h, anchor_id, temperature, generator)
        return tokens, probs, None

    def cache_bytes(self, state) -> int:
        return 0
