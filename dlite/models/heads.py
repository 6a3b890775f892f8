"""The sequential heads (GRU, causal attention, none) and the student parts the DLite
drafter and the history-aware teacher share: same module names, so the teacher's
state_dict keys line up with the student's (`init_student_from_teacher`)."""

import torch
import torch.nn.functional as F
from torch import nn

from dlite.models.common import attach_target, embed_in, sample_block, sample_rows
from dlite.models.config import DrafterConfig
from dlite.models.layers import Backbone, RMSNorm



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


def build_student_parts(model: nn.Module, cfg: DrafterConfig, embed_weight, lm_head_weight,
                        mask_token_id: int, draft_vocab=None):
    """Attach the parts DLite and the teacher share (same names => same state_dict keys)."""
    if cfg.context_injection not in ("kv", "add"):
        raise ValueError(f"drafter.context_injection must be 'kv' or 'add', "
                         f"got {cfg.context_injection!r}")
    if cfg.head not in HEADS:
        raise ValueError(f"drafter.head must be one of {sorted(HEADS)}, got {cfg.head!r}")
    attach_target(model, cfg, embed_weight, lm_head_weight, mask_token_id, draft_vocab)
    model.ctx_proj = nn.Linear(model.feature_dim, cfg.hidden_size, bias=False)
    model.ctx_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
    model.backbone = Backbone(cfg, model.target_hidden)
    model.head = HEADS[cfg.head](cfg.hidden_size, cfg.head_hidden, cfg.gamma, cfg.rms_norm_eps)


def context_states(model, feats):
    """The context feature(s) [..., K*H_t] -> linear -> RMSNorm."""
    return model.ctx_norm(model.ctx_proj(feats.to(model.ctx_proj.weight.dtype)))


def head_logits(model, h, prev_ids):
    """Teacher-forced sequential head over a block: h [n, g, hid], prev_ids [n, g] ->
    logits [n, g, N] over the drafter's vocabulary."""
    return model.backbone.logits(model.head(h, embed_in(model, prev_ids)), model.vocab.out_weight)


def draft_tokens(model, h, anchor_id: int, temperature: float, generator=None, vocab=None):
    """Run the sequential head over the block's h [1, g, hid], choosing as it goes, over
    `vocab` (default `model.vocab`; e.g. a per-request `FrozenVocab.with_draft_ids` view:
    the head works in hidden space, so only the output rows and id map change)."""
    vocab = model.vocab if vocab is None else vocab

    def step(k, prev, state):
        hk, state = model.head.step(h[:, k], embed_in(model, prev), state)
        return model.backbone.logits(hk, vocab.out_weight)[0], state
    return sample_block(step, model.gamma, anchor_id, temperature, h.device, vocab, generator,
                        model.draft_stop_prob)


def draft_token_rows(model, h, anchors: torch.Tensor, temperature: float, generator=None) -> list:
    """`draft_tokens` for B blocks at once: h [B, g, hid], anchors [B] (target ids) ->
    B (tokens, probs) pairs, the head stepping every row together."""
    vocab = model.vocab

    def step(k, prev, state):
        hk, state = model.head.step(h[:, k], embed_in(model, prev), state)
        return model.backbone.logits(hk, vocab.out_weight), state
    return sample_rows(step, model.gamma, anchors, temperature, vocab, generator, model.draft_stop_prob)
