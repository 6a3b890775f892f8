"""The authors' published DLite drafter (`DAI-System/DLite`, `dlite/modeling/dlite.py`;
architecture_version `dlite_v1`, role `pivot_q_student`) as one of our drafter
variants, `drafter.arch: dlite_v1`: same `Drafter` interface as `DLiteDrafter`, so
training, the loss, the decoding loop and export use it unchanged. Written from a
reading of their code; `dlite.models.dlite_v1_io` reads and writes their checkpoints.

What differs from our `dlite` design:
- context: one slot PER target layer (K = len(target_layer_ids)), each the layer's
  state at the pivot plus a learned layer-depth embedding, then an RMSNorm
  (`context_norm`); every backbone layer attends to the K slots as extra keys/values;
- query: the last `anchor_group_size` (G) real tokens ending at the anchor, then gamma
  MASKs, all bidirectional; logits come from the MASK slots only;
- backbone at the target's width (no projections), final norm;
- sequential head: a gated recurrent state of rank r over its own V x r token
  embedding, fused with the slot's hidden state, projected by its own r -> V matrix
  (the target's lm_head is not used); primed with the token at anchor-1 when G = 2.

Mapping onto our positions (DLITE.md / `dlite.decoding.decode`): our anchor at
position t is the last accepted / bonus token, not yet run by the target; the
drafter's features are the target's states at t-1. Their `start` is the same token
and their pivot = start-1 = our t-1: `block_layout`'s `ctx_idx = anchors - 1`. Their
block_size = 1 + gamma (anchor + gamma proposals); their MASK slot k (k = 1..gamma,
at position t+k) predicts the token at t+k: our slot k-1. Layer ids: theirs index HF
`hidden_states[id + 1]`, i.e. decoder layer `id`'s output, which is what our capture
hooks (`dlite.decoding.capture`) -- except for the LAST layer, where HF returns the
output of the target's final norm. Our hooks see the pre-norm output, so this model
holds a frozen copy of the target's final-norm weight (`target_norm_weight`, saved
in our artifact, not in theirs) and applies it to the last slot itself. Their layer
selection is fixed (first, last, evenly spaced: `published_layer_ids`), so the last
slot is always the target's last layer. RoPE positions are local: the G tokens at
0..G-1, the MASKs at G..G+gamma-1, every context slot at max(0, G-2) (0 for G <= 2),
whatever the absolute position. MASK = a target vocabulary row (their runtime
refuses anything else) or, with our LEARNED_MASK, our learned row (not exportable).

Teacher (`drafter.v1_teacher`, built by the teacher stage for a dlite_v1 design, the
authors' `swa_teacher`): the same model plus history keys -- the projected features
(`hist_proj`, `hist_norm`) of the positions before the anchor, the last
`drafter.history_window` of them when set (512 published) -- all blocks of a sequence
in one packed forward at absolute positions. It exists to hand its sequential head
and its block distributions to a student (`train.recipe`); it does not draft here.

One gap the decoding interface leaves: `draft` gets the anchor, not the token before
it. The state rebuilds it from the previous round (the pivot is the previous anchor
or one of the drafts it accepted); in a generation's first round it is the prompt's
last token, which the decoding loop passes to `new_state(prompt_ids)` because this
drafter says `reads_prompt`. Without it that round's query is [anchor, MASK...] with
an unprimed head -- their own path for a group cut short at the start of a sequence. Inside a hybrid (`dlite.decoding.lookup`), rounds the
lookup drafts are unseen here, so the rebuilt pivot can be stale. Decoding stays
lossless either way; only that round's draft quality is at stake."""

from typing import List, Optional, Sequence

import torch
from torch import nn

from dlite.models.common import as_batched, attach_target, embed_in, gather_positions, sample_block
from dlite.models.config import DrafterConfig
from dlite.models.heads import RecurrentHead
from dlite.models.history import packed_block_mask, packed_history_kv
from dlite.models.layers import Backbone, RMSNorm, StaticMemory


def published_layer_ids(num_layers: int, k: int) -> List[int]:
    """Their fixed selection of k of num_layers target layers: first, last and k-2
    evenly spaced between (Python's round, as theirs). 36 layers, k=7 -> [0, 1, 9, 17,
    26, 34, 35]."""
    if num_layers < 2 or not 2 <= k <= num_layers:
        raise ValueError(f"need 2 <= k <= num_layers (>= 2) layers, got k={k} of {num_layers}")
    picked, middle, span = {0, num_layers - 1}, k - 2, num_layers - 3
    for i in range(middle):
        picked.add(1 + round((0.5 if middle == 1 else i / (middle - 1)) * span))
    return sorted(picked)


class DLiteV1Drafter(nn.Module):
    """The published drafter around the target's frozen embedding (queries only: the
    lm_head is kept for the shared vocabulary but never multiplied) and its final-norm
    weight `final_norm_weight` [H] (see the module docstring)."""

    needs_history = False
    reads_prompt = True  # the decoding loop passes the prompt to new_state (the first pivot)

    def __init__(self, cfg: DrafterConfig, embed_weight: torch.Tensor, lm_head_weight: torch.Tensor,
                 mask_token_id: int, draft_vocab=None, final_norm_weight: Optional[torch.Tensor] = None):
        super().__init__()
        _check(cfg, embed_weight.shape[1], final_norm_weight)
        attach_target(self, cfg, embed_weight, lm_head_weight, mask_token_id, draft_vocab)
        H, V = self.target_hidden, embed_weight.shape[0]
        self.num_target_layers = max(cfg.target_layer_ids) + 1  # their selection ends at the last
        self.backbone = Backbone(cfg, H)  # same width: its in/out projections are identities
        self.layer_depth_embedding = nn.Embedding(self.num_target_layers, H)
        self.context_norm = RMSNorm(H, cfg.rms_norm_eps)
        self.sequential_head = RecurrentHead(V, cfg.sequential_rank, H)
        self.register_buffer("target_norm_weight", final_norm_weight.detach().clone())
        if cfg.v1_teacher:  # the published teacher: + the history path (training only here)
            self.needs_history = True
            self.hist_proj = nn.Linear(self.feature_dim, H, bias=False)
            self.hist_norm = RMSNorm(H, cfg.rms_norm_eps)
        self._init_weights()

    def _init_weights(self, std: float = 0.02):
        """Normal(0, std) matrices and embeddings, zero biases, unit norms (as their HF
        init). Skipped on `meta` (a load assigns every weight)."""
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)) and m.weight.device.type != "meta":
                nn.init.normal_(m.weight, std=std)
                if getattr(m, "bias", None) is not None:
                    nn.init.zeros_(m.bias)

    def context(self, feats):
        """Feature rows [N, K*H] -> context slots [N, K, H]: the last slot (the target's
        last layer) through the target's final norm, + depth embedding, RMSNorm."""
        x = feats.reshape(feats.shape[0], -1, self.target_hidden).to(self.context_norm.weight.dtype)
        # the target's final RMSNorm, with the drafter's eps: the authors' drafter config
        # is the target's own Qwen3 config, so the two agree
        last = x[:, -1].float()
        last = last * torch.rsqrt(last.pow(2).mean(-1, keepdim=True) + self.cfg.rms_norm_eps)
        last = (self.target_norm_weight * last.to(x.dtype)).to(x.dtype)
        x = torch.cat([x[:, :-1], last[:, None]], 1)
        depth = self.layer_depth_embedding(torch.tensor(self.target_layer_ids, device=x.device))
        return self.context_norm(x + depth)

    def _hidden(self, group_ids, ctx):
        """Backbone over [group tokens, MASK x gamma] (group_ids [N, n]) attending to ctx
        [N, K, H] at local positions -> the MASK slots' normed states [N, gamma, H]."""
        N, n = group_ids.shape
        masks = torch.full((N, self.gamma), self.vocab.mask_token_id, device=group_ids.device)
        x = embed_in(self, torch.cat([group_ids, masks], 1))
        pos = torch.arange(n + self.gamma, device=x.device).expand(N, -1)
        ctx_pos = torch.full(ctx.shape[:2], max(0, n - 2), device=x.device)
        h = self.backbone(x, pos, StaticMemory(self.backbone.memory_kv(ctx, ctx_pos)))
        return self.backbone.norm(h)[:, n:]

    def _teacher_hidden(self, batch, group_ids, ctx):
        """The teacher's `_hidden`: all A blocks of a sequence in one forward, keys =
        [history L | context slots A*K | blocks A*q], masked by `packed_block_mask` (the
        history before each anchor, the last `history_window` of it when set). Positions
        are absolute, as the authors' teacher (one history shared by every block cannot
        take block-local positions): the group ends at the anchor, slots at anchor-1."""
        anchors = batch["anchors"]
        (B, A), (N, n), K = anchors.shape, group_ids.shape, ctx.shape[1]
        q = n + self.gamma
        masks = torch.full((N, self.gamma), self.vocab.mask_token_id, device=group_ids.device)
        x = embed_in(self, torch.cat([group_ids, masks], 1)).reshape(B, A * q, -1)
        pos = (anchors[..., None] - (n - 1) + torch.arange(q, device=x.device)).reshape(B, A * q)
        ctx_pos = (anchors - 1)[..., None].expand(B, A, K).reshape(B, A * K)
        ckv = self.backbone.memory_kv(ctx.reshape(B, A * K, -1), ctx_pos)
        kv = [(torch.cat([hk, ck], 2), torch.cat([hv, cv], 2))
              for (hk, hv), (ck, cv) in zip(packed_history_kv(self, batch), ckv)]
        mask = packed_block_mask(batch, q, K, self.cfg.history_window)
        h = self.backbone(x, pos, StaticMemory(kv), mask)
        return self.backbone.norm(h).reshape(N, q, -1)[:, n:]

    def forward_train(self, batch: dict) -> torch.Tensor:
        """Teacher-forced logits [B, A, gamma, V] (or [A, gamma, V] for one sequence)
        for the batch of `dlite.models.common.block_layout`."""
        batch, single = as_batched(batch)
        ids, anchors = batch["input_ids"], batch["anchors"]
        (B, A), g = anchors.shape, self.gamma
        slots = anchors[..., None] + torch.arange(g, device=ids.device)
        prev = gather_positions(ids, slots).reshape(B * A, g)  # slot k's preceding data token
        pivot = gather_positions(ids, anchors - 1).reshape(B * A)
        ctx = self.context(gather_positions(batch["features"], anchors - 1).reshape(B * A, -1))
        two = self.cfg.anchor_group_size == 2
        group = torch.stack([pivot, prev[:, 0]], 1) if two else prev[:, :1]
        h = self._teacher_hidden(batch, group, ctx) if self.cfg.v1_teacher else self._hidden(group, ctx)
        logits = self.sequential_head(h, prev, pivot if two else None)
        logits = logits.view(B, A, g, -1)
        return logits[0] if single else logits

    def new_state(self, prompt_ids: Optional[Sequence[int]] = None) -> dict:
        """What `draft` needs to know the token before the anchor (a few ints)."""
        last = None if prompt_ids is None or len(prompt_ids) == 0 else int(prompt_ids[-1])
        return dict(pos=None if last is None else len(prompt_ids) - 1, anchor=last, draft=[])

    def _pivot(self, state, anchor_pos: int) -> Optional[int]:
        """The token at anchor_pos - 1: the previous anchor, or the last draft it accepted;
        None when unknown (first round, or rounds this model did not draft moved the
        anchor further than its last draft reaches: then the [anchor] query is used)."""
        if state is None or state["pos"] is None:
            return None
        a = anchor_pos - state["pos"] - 1
        if not 0 <= a <= len(state["draft"]):
            return None
        return state["anchor"] if a == 0 else int(state["draft"][a - 1])

    @torch.no_grad()
    def draft(self, state, new_features: torch.Tensor, anchor_id: int, anchor_pos: int,
              temperature: float, generator: Optional[torch.Generator] = None):
        """Uses only the last feature row (position anchor_pos-1) and the pivot token."""
        if self.cfg.v1_teacher:
            raise ValueError("a dlite_v1 teacher (drafter.v1_teacher) is a training stage's model: "
                             "it distils a student and does not draft in this project")
        feat = new_features.reshape(-1, self.feature_dim)[-1:]
        pivot = self._pivot(state, anchor_pos) if self.cfg.anchor_group_size == 2 else None
        group = torch.tensor([[anchor_id] if pivot is None else [pivot, anchor_id]], device=feat.device)
        h = self._hidden(group, self.context(feat))
        head = self.sequential_head
        primed = None if pivot is None else head.advance(None, group[:, 0])

        def step(k, prev, s):
            logits, s = head.step(h[:, k], prev, primed if k == 0 else s)
            return logits[0], s
        tokens, probs = sample_block(step, self.gamma, anchor_id, temperature, feat.device, self.vocab,
                                     generator, self.draft_stop_prob)
        state = self.new_state() if state is None else state
        state.update(pos=anchor_pos, anchor=int(anchor_id), draft=tokens)
        return tokens, probs, state

    def cache_bytes(self, state) -> int:
        return 0  # the pivot bookkeeping is a position and a few token ids, no history


def _check(cfg: DrafterConfig, target_hidden: int, final_norm_weight) -> None:
    """What the published design fixes; ValueError naming the drafter key."""
    ids = list(cfg.target_layer_ids)
    if not 2 <= len(ids) <= max(ids) + 1 or ids != published_layer_ids(max(ids) + 1, len(ids)):
        raise ValueError(f"drafter.target_layer_ids {ids}: dlite_v1 reads the published selection "
                         f"(first, last, evenly spaced; e.g. {published_layer_ids(36, 7)} of 36)")
    if cfg.hidden_size != target_hidden:
        raise ValueError(f"drafter.hidden_size={cfg.hidden_size}: dlite_v1 runs at the target's "
                         f"width {target_hidden}")
    if cfg.anchor_group_size not in (1, 2):
        raise ValueError(f"drafter.anchor_group_size must be 1 or 2, got {cfg.anchor_group_size}")
    if cfg.draft_vocab_size is not None:
        raise ValueError("drafter.draft_vocab_size: dlite_v1 drafts over the full vocabulary "
                         "(its own r -> V output projection)")
    if final_norm_weight is None or tuple(final_norm_weight.shape) != (target_hidden,):
        raise ValueError(f"dlite_v1 needs the target's final-norm weight [{target_hidden}] "
                         f"(build_drafter(..., final_norm_weight=target.model.norm.weight)): "
                         f"its last context slot is the target's post-norm state")
