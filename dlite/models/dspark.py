"""DSpark-style baseline (DLITE.md §5): the same backbone with DFlash-style history KV
injection -- the projected target features of every verified position become
keys/values of every layer, kept in a drafter-side cache that grows with the context
-- and a logit-space Markov head of rank r:
    logits_k = lm_head(norm(h_k)) + W2 · silu(W1 · e(x_{k-1}))   (W1: H_t->r, W2: r->N),
N = the draft vocabulary when one is configured (else the target's V), as for DLite.
There is no single context feature: the last position reaches the block as history.
`draft` drafts one request; `draft_history_rows` drafts B of them in one pass, each
over its own history cache (what a batched decoding loop needs)."""

from typing import Optional, Sequence

import torch
from torch import nn

from dlite.models.common import (as_batched, attach_target, block_inputs, block_layout, block_rows, embed_in,
                                 init_weights, sample_block, sample_rows)
from dlite.models.config import DrafterConfig
from dlite.models.history import (HistoryCache, extend_histories, extend_history, packed_block_mask,
                                  packed_history_kv, rows_forward)
from dlite.models.layers import Backbone, RMSNorm, StaticMemory


class MarkovHead(nn.Module):
    """A vocabulary-sized bias from the previous token (W2 zero-init: starts neutral)."""

    def __init__(self, embed_dim: int, rank: int, vocab: int):
        super().__init__()
        self.w1 = nn.Linear(embed_dim, rank, bias=False)
        self.w2 = nn.Linear(rank, vocab, bias=False)
        self.w2.zero_init = True

    def forward(self, e_prev):
        # e_prev is a frozen target embedding, in the target's dtype: cast to the head's
        return self.w2(torch.nn.functional.silu(self.w1(e_prev.to(self.w1.weight.dtype))))


class DSparkDrafter(nn.Module):
    """History-KV backbone + Markov head; needs (and keeps) the whole history."""

    needs_history = True

    def __init__(self, cfg: DrafterConfig, embed_weight: torch.Tensor,
                 lm_head_weight: torch.Tensor, mask_token_id: int, draft_vocab=None):
        super().__init__()
        attach_target(self, cfg, embed_weight, lm_head_weight, mask_token_id, draft_vocab)
        self.hist_proj = nn.Linear(self.feature_dim, cfg.hidden_size, bias=False)
        self.hist_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.backbone = Backbone(cfg, self.target_hidden)
        self.markov = MarkovHead(self.target_hidden, cfg.markov_rank, self.vocab.size)
        init_weights(self)

    def forward_train(self, batch: dict) -> torch.Tensor:
        """All blocks of a sequence packed in one forward (keys = [history | blocks]);
        the Markov head is teacher-forced on [anchor, x*_1..x*_{g-1}]."""
        batch, single = as_batched(batch)
        lay = block_layout(batch, self.gamma, self.vocab.mask_token_id)
        B, A, g = lay["block_ids"].shape
        mem = StaticMemory(packed_history_kv(self, batch))
        x = embed_in(self, lay["block_ids"].reshape(B, A * g))
        h = self.backbone(x, lay["block_pos"].reshape(B, A * g), mem, packed_block_mask(batch, g, 0))
        logits = self.backbone.logits(h, self.vocab.out_weight).view(B, A, g, -1)
        logits = logits + self.markov(self.vocab.embed(lay["prev_ids"]))
        return logits[0] if single else logits

    def new_state(self) -> HistoryCache:
        w = self.hist_proj.weight
        return HistoryCache(self.backbone, w.dtype, w.device, reserve=self.gamma)

    @torch.no_grad()
    def draft(self, state: HistoryCache, new_features: torch.Tensor, anchor_id: int,
              anchor_pos: int, temperature: float, generator: Optional[torch.Generator] = None):
        """Extend the cache with the newly verified positions, run the block over the
        whole cache, then add the Markov bias slot by slot while choosing tokens."""
        feats = new_features.reshape(-1, self.feature_dim)
        extend_history(self, state, feats, anchor_pos)
        x, pos = block_inputs(self, anchor_id, anchor_pos, feats.device)
        base = self.backbone.logits(self.backbone(x, pos, state), self.vocab.out_weight)[0]

        def step(k, prev, _):
            return base[k] + self.markov(self.vocab.embed(prev))[0], None
        tokens, probs = sample_block(step, self.gamma, anchor_id, temperature, feats.device,
                                     self.vocab, generator, self.draft_stop_prob)
        return tokens, probs, state

    @torch.no_grad()
    def draft_history_rows(self, states: Sequence[HistoryCache], feats: Sequence[torch.Tensor],
                           anchors: Sequence[int], positions: Sequence[int], temperature: float,
                           generator: Optional[torch.Generator] = None):
        """`draft` for B requests in one pass: states[b] is row b's cache, feats[b]
        [n_b, F] its newly verified positions, anchors[b] / positions[b] its anchor id
        and position. The caches are extended together, the B blocks go through one
        backbone forward (`rows_forward`) and the Markov head and the choice of tokens
        step every row together (`sample_rows`: `sample_block`'s early stop, per row).
        -> (B (tokens [k_b], probs [k_b, V] or None at T = 0) pairs as `draft` returns
        them, the states, extended in place).

        Copy per round: none of the histories; the B blocks' own g keys/values per layer
        are written after each cache's history, as `draft` writes them. Each row's
        attention reads its cache where it lies: a padded gather of the caches would
        copy 2 * layers * B * L_max * kv_heads * head_dim * 4 bytes a round in fp32
        (SmolLM2 shapes, B = 16, L_max = 8K: 201 MB) and measured 2-3x slower on this
        project's 2-core CPU (B = 8 / 16 over 1K-8K histories, two runs: 76-81 /
        132-137 ms a round against 26-36 / 49-60 ms; B calls of `draft`: 74-92 /
        150-165 ms)."""
        if not states:
            return [], []
        feats = [f.reshape(-1, self.feature_dim) for f in feats]
        extend_histories(self, states, feats, positions)
        x, pos = block_rows(self, anchors, positions, feats[0].device)
        base = self.backbone.logits(rows_forward(self.backbone, x, pos, states), self.vocab.out_weight)

        def step(k, prev, _):
            return base[:, k] + self.markov(self.vocab.embed(prev)), None
        a = torch.as_tensor(list(anchors), dtype=torch.long, device=x.device)
        drafts = sample_rows(step, self.gamma, a, temperature, self.vocab, generator, self.draft_stop_prob)
        return drafts, list(states)

    def cache_bytes(self, state: Optional[HistoryCache]) -> int:
        return 0 if state is None else state.nbytes()
