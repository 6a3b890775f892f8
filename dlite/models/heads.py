"""The sequential heads (GRU, causal attention, none in hidden space through the
target's lm_head; the published rank-r recurrent head with its own vocabulary
matrices) and the student parts the DLite drafter and the history-aware teacher share:
same module names, so the teacher's state_dict keys line up with the student's
(`init_student_from_teacher`). Also how the context feature becomes the backbone's
context key(s): one fused key, or one slot per target layer (the published design's
context, at our width)."""

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


class RecurrentHead(nn.Module):
    """s_k = z * s_{k-1} + (1 - z) * tanh(c), [z; c] = W_s [s_{k-1}; E(x_{k-1})];
    logits_k = W_out (W_f [s_k; h_k]). E: V x r, W_out: r x V -- its own vocabulary
    matrices, so one step costs r*V rather than the target's H*V. Module names are
    theirs (`sequential_head.*` in their checkpoints)."""

    def __init__(self, vocab: int, rank: int, hidden: int):
        super().__init__()
        self.prev_token_embedding = nn.Embedding(vocab, rank)
        self.state_proj = nn.Linear(2 * rank, 2 * rank)
        self.state_hidden_mlp = nn.Linear(rank + hidden, rank)
        self.output_proj = nn.Linear(rank, vocab, bias=False)
        nn.init.normal_(self.prev_token_embedding.weight, std=0.02)  # N(0, 1) would saturate tanh

    def advance(self, state, prev_ids):
        """The state after reading token ids prev_ids [N]; None = the zero state."""
        e = self.prev_token_embedding(prev_ids)
        state = torch.zeros_like(e) if state is None else state
        gate, cand = self.state_proj(torch.cat([state, e], -1)).chunk(2, -1)
        gate = torch.sigmoid(gate)
        return gate * state + (1 - gate) * torch.tanh(cand)

    def step(self, h, prev_ids, state):
        """One slot: h [N, H], prev_ids [N] -> (logits [N, V], new state)."""
        state = self.advance(state, prev_ids)
        return self.output_proj(self.state_hidden_mlp(torch.cat([state, h], -1))), state

    def forward(self, h, prev_ids, prime_ids=None):
        """Teacher-forced: h [N, g, H], prev_ids [N, g] (slot k's preceding data token),
        prime_ids [N] or None (the token at anchor-1) -> logits [N, g, V]."""
        state = None if prime_ids is None else self.advance(None, prime_ids)
        out = []
        for k in range(h.shape[1]):
            logits, state = self.step(h[:, k], prev_ids[:, k], state)
            out.append(logits)
        return torch.stack(out, 1)


HEADS = {"gru": GRUHead, "attn": AttnHead, "none": NoHead}
# `drafter.head: rank`: the published head (`RecurrentHead`, rank `drafter.sequential_rank`)
# on our backbone: it reads the backbone's output at the target's width and projects to
# the full vocabulary itself, so the target's lm_head and a draft vocabulary are unused.
OWN_VOCAB_HEADS = ("rank",)


def build_student_parts(model: nn.Module, cfg: DrafterConfig, embed_weight, lm_head_weight,
                        mask_token_id: int, draft_vocab=None):
    """Attach the parts DLite and the teacher share (same names => same state_dict keys)."""
    if cfg.context_injection not in ("kv", "add", "slots"):
        raise ValueError(f"drafter.context_injection must be 'kv', 'add' or 'slots', "
                         f"got {cfg.context_injection!r}")
    if cfg.head not in HEADS and cfg.head not in OWN_VOCAB_HEADS:
        raise ValueError(f"drafter.head must be one of {sorted(HEADS) + list(OWN_VOCAB_HEADS)}, got {cfg.head!r}")
    if cfg.head in OWN_VOCAB_HEADS and draft_vocab is not None:
        raise ValueError("drafter.draft_vocab_size: head 'rank' drafts over the full vocabulary "
                         "(its own r -> V projection): set null")
    attach_target(model, cfg, embed_weight, lm_head_weight, mask_token_id, draft_vocab)
    if cfg.context_injection == "slots":  # one key per layer: a shared projection + depth embedding
        model.ctx_proj = nn.Linear(model.target_hidden, cfg.hidden_size, bias=False)
        # starts at zero: the slots already differ by their layers' states
        model.ctx_depth = nn.Parameter(torch.zeros(len(cfg.target_layer_ids), cfg.hidden_size))
    else:
        model.ctx_proj = nn.Linear(model.feature_dim, cfg.hidden_size, bias=False)
    model.ctx_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
    model.backbone = Backbone(cfg, model.target_hidden)
    if cfg.head in OWN_VOCAB_HEADS:
        model.head = RecurrentHead(embed_weight.shape[0], cfg.sequential_rank, model.target_hidden)
    else:
        model.head = HEADS[cfg.head](cfg.hidden_size, cfg.head_hidden, cfg.gamma, cfg.rms_norm_eps)


def context_states(model, feats):
    """The context feature(s) [..., K*H_t] -> linear -> RMSNorm: [..., hid] (one fused
    state), or with `context_injection: slots` [..., K, hid] (each layer's state through
    the shared projection, plus its layer's depth embedding; the published design's
    slots, but projected to our backbone's width)."""
    x = feats.to(model.ctx_proj.weight.dtype)
    if model.cfg.context_injection != "slots":
        return model.ctx_norm(model.ctx_proj(x))
    x = x.reshape(*x.shape[:-1], len(model.target_layer_ids), model.target_hidden)
    return model.ctx_norm(model.ctx_proj(x) + model.ctx_depth)


def context_keys(cfg) -> int:
    """How many context keys each block attends to: 0 (added to the inputs), 1 (fused),
    K (one slot per target layer)."""
    return {"add": 0, "kv": 1, "slots": len(cfg.target_layer_ids)}[cfg.context_injection]


def context_kv(model, c, ctx_pos):
    """Per-layer K/V of the context keys: c [B, M, hid] (fused) or [B, M, K, hid] (slots)
    for M blocks whose context sits at ctx_pos [B, M]; every slot of a block shares its
    position (the published slots share theirs too)."""
    if c.dim() == 4:
        ctx_pos = ctx_pos.repeat_interleave(c.shape[2], dim=1)
        c = c.flatten(1, 2)
    return model.backbone.memory_kv(c, ctx_pos)


def head_logits(model, h, prev_ids):
    """Teacher-forced sequential head over a block: h [n, g, hid], prev_ids [n, g] ->
    logits [n, g, N] over the drafter's vocabulary."""
    if model.cfg.head in OWN_VOCAB_HEADS:
        return model.head(_head_input(model, h), prev_ids)
    return model.backbone.logits(model.head(h, embed_in(model, prev_ids)), model.vocab.out_weight)


def _head_input(model, h):
    """What an own-vocabulary head reads: the backbone's normed output at the target's
    width (`Backbone.logits` without the lm_head)."""
    return model.backbone.out_proj(model.backbone.norm(h))


def head_step(model, hk, prev, state, vocab):
    """One slot of the sequential head while drafting: hk [B, hid], prev [B] target ids
    -> (logits [B, N] over `vocab`, state)."""
    if model.cfg.head in OWN_VOCAB_HEADS:
        return model.head.step(_head_input(model, hk), prev, state)
    hk, state = model.head.step(hk, embed_in(model, prev), state)
    return model.backbone.logits(hk, vocab.out_weight), state


def draft_tokens(model, h, anchor_id: int, temperature: float, generator=None, vocab=None):
    """Run the sequential head over the block's h [1, g, hid], choosing as it goes, over
    `vocab` (default `model.vocab`; e.g. a per-request `FrozenVocab.with_draft_ids` view:
    the head works in hidden space, so only the output rows and id map change; an
    own-vocabulary head has no such view)."""
    vocab = model.vocab if vocab is None else vocab
    if vocab is not model.vocab and model.cfg.head in OWN_VOCAB_HEADS:
        raise ValueError("a per-request draft vocabulary (eval.context_vocab) needs a head through the "
                         "target's lm_head; drafter.head 'rank' has its own full-vocabulary projection")

    def step(k, prev, state):
        logits, state = head_step(model, h[:, k], prev, state, vocab)
        return logits[0], state
    return sample_block(step, model.gamma, anchor_id, temperature, h.device, vocab, generator,
                        model.draft_stop_prob)


def draft_token_rows(model, h, anchors: torch.Tensor, temperature: float, generator=None) -> list:
    """`draft_tokens` for B blocks at once: h [B, g, hid], anchors [B] (target ids) ->
    B (tokens, probs) pairs, the head stepping every row together."""
    vocab = model.vocab

    def step(k, prev, state):
        return head_step(model, h[:, k], prev, state, vocab)
    return sample_rows(step, model.gamma, anchors, temperature, vocab, generator, model.draft_stop_prob)
