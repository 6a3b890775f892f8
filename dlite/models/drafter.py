"""The DLite drafter: history-free. Each round it sees one context feature (the target's
K chosen layer outputs at the last verified position: fused into one key by default,
or one key per layer with `context_injection: slots`), the anchor token and its
position; a parallel backbone drafts the whole block in one pass and a small
sequential head walks it left to right (in hidden space through the target's lm_head,
or the published rank-r head with its own vocabulary matrices). No cache, constant cost."""

from typing import Optional, Sequence

import torch
from torch import nn

from dlite.models.common import (as_batched, block_inputs, block_layout, block_rows, embed_in, gather_positions,
                                 init_weights)
from dlite.models.config import DrafterConfig
from dlite.models.heads import (build_student_parts, context_kv, context_states, draft_token_rows, draft_tokens,
                                head_logits)
from dlite.models.layers import StaticMemory


class DLiteDrafter(nn.Module):
    """History-free drafter: backbone conditioned on one context feature + sequential
    head. Constructed with the target's frozen embedding / lm_head and the MASK id."""

    needs_history = False

    def __init__(self, cfg: DrafterConfig, embed_weight: torch.Tensor,
                 lm_head_weight: torch.Tensor, mask_token_id: int, draft_vocab=None):
        super().__init__()
        build_student_parts(self, cfg, embed_weight, lm_head_weight, mask_token_id, draft_vocab)
        init_weights(self)

    def _context(self, c, ctx_pos, x):
        """Inject context states c [N, hid] (or [N, K, hid] slots) at ctx_pos [N, 1] into
        block inputs x."""
        if self.cfg.context_injection == "add":
            return x + c[:, None], None
        return x, StaticMemory(context_kv(self, c[:, None], ctx_pos))

    def forward_train(self, batch: dict) -> torch.Tensor:
        """Teacher-forced logits [B, A, g, N] (or [A, g, N] for one sequence)."""
        batch, single = as_batched(batch)
        lay = block_layout(batch, self.gamma, self.vocab.mask_token_id)
        B, A, g = lay["block_ids"].shape
        c = context_states(self, gather_positions(batch["features"], lay["ctx_idx"]))
        x, mem = self._context(c.flatten(0, 1), lay["ctx_pos"].reshape(B * A, 1),
                               embed_in(self, lay["block_ids"].reshape(B * A, g)))
        h = self.backbone(x, lay["block_pos"].reshape(B * A, g), mem)
        logits = head_logits(self, h, lay["prev_ids"].reshape(B * A, g)).view(B, A, g, -1)
        return logits[0] if single else logits

    def new_state(self):
        return None

    @torch.no_grad()
    def draft(self, state, new_features: torch.Tensor, anchor_id: int, anchor_pos: int,
              temperature: float, generator: Optional[torch.Generator] = None, vocab=None):
        """Uses only the last feature row (position anchor_pos-1); keeps nothing. `vocab`:
        draft over another set of ids than `self.vocab`'s (`FrozenVocab.with_draft_ids`)."""
        feat = new_features.reshape(-1, self.feature_dim)[-1:]
        x, pos = block_inputs(self, anchor_id, anchor_pos, feat.device)
        x, mem = self._context(context_states(self, feat), pos[:, :1] - 1, x)
        h = self.backbone(x, pos, mem)
        tokens, probs = draft_tokens(self, h, anchor_id, temperature, generator, vocab)
        return tokens, probs, None

    @torch.no_grad()
    def draft_rows(self, feats: torch.Tensor, anchors: Sequence[int], positions: Sequence[int],
                   temperature: float, generator: Optional[torch.Generator] = None) -> list:
        """`draft` for B requests in one pass -- what being history-free buys a batch: no
        state per request, so B rows are B anchors. feats [B, F] (each row's last
        verified position), anchors / positions [B] -> B (tokens, probs) pairs."""
        dev = feats.device
        a = torch.as_tensor(list(anchors), dtype=torch.long, device=dev)
        x, pos = block_rows(self, anchors, positions, dev)
        x, mem = self._context(context_states(self, feats.reshape(a.shape[0], self.feature_dim)), pos[:, :1] - 1, x)
        return draft_token_rows(self, self.backbone(x, pos, mem), a, temperature, generator)

    def cache_bytes(self, state) -> int:
        return 0
