"""What every drafter architecture shares: the `Drafter` protocol, the frozen target
vocabulary (and views of it with other draft ids), the block helpers (embedding the
block, its inputs), the teacher-forced block layout for training and the sequential
sampling loop."""

import contextlib
import contextvars
from typing import List, Optional, Protocol, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import nn



class Drafter(Protocol):
    """What the speculative decoding loop and the trainer rely on (no base class).

    `draft` gets the features of the positions verified since the previous call (the
    whole prompt on the first call); the last row is position `anchor_pos - 1`. It
    returns gamma tokens (target ids), their draft distributions [gamma, V] over the
    target's vocabulary -- at T > 0 the distributions the tokens were drawn from; at
    T = 0 None is allowed (greedy verification never reads them) -- and the new state.
    `forward_train` takes the batch described in `block_layout` and returns
    teacher-forced logits [B, A, gamma, N] ([A, gamma, N] for one unbatched sequence)
    over the drafter's vocabulary (`vocab.size`: N = the draft vocabulary, else V)."""

    gamma: int
    target_layer_ids: List[int]
    needs_history: bool

    def new_state(self): ...
    def draft(self, state, new_features: torch.Tensor, anchor_id: int, anchor_pos: int,
              temperature: float, generator: Optional[torch.Generator] = None): ...
    def cache_bytes(self, state) -> int: ...
    def forward_train(self, batch: dict) -> torch.Tensor: ...


# `mask_token_id` when the target has no spare embedding row (SmolLM2: 49152 tokens in
# 49152 rows): the drafter then owns a learned MASK embedding (`FrozenVocab.mask_embed`).
LEARNED_MASK = -1


class FrozenVocab(nn.Module):
    """The target's token embedding and lm_head, shared and frozen: non-persistent
    buffers, so they never train and are never written into a drafter checkpoint.

    MASK: a frozen unused target row when there is one (`mask_token_id` >= 0), else
    (`LEARNED_MASK`) a trainable `mask_embed` of the embedding width, initialised to
    the mean embedding row (an "average token" of the right scale) and saved with the
    drafter. Block ids carry `mask_token_id` in MASK slots either way, so training,
    drafting and export share one code path (`embed`).

    Draft vocabulary (`draft_vocab`: sorted target ids, or None = the full vocabulary):
    the drafter's logits are over those N ids only; the lm_head rows are sliced once
    (`out_weight` [N, H]) and the id map is a persistent buffer (`draft_ids`), saved
    in model.safetensors. `to_target` / `to_draft` map between the two id spaces."""

    def __init__(self, embed_weight: torch.Tensor, lm_head_weight: torch.Tensor, mask_token_id: int,
                 draft_vocab: Optional[torch.Tensor] = None):
        super().__init__()
        if embed_weight.shape != lm_head_weight.shape:
            raise ValueError(f"embed {tuple(embed_weight.shape)} != "
                             f"lm_head {tuple(lm_head_weight.shape)}")
        V = embed_weight.shape[0]
        if mask_token_id != LEARNED_MASK and not 0 <= mask_token_id < V:
            raise ValueError(f"mask_token_id {mask_token_id} outside vocab {V} "
                             f"(use {LEARNED_MASK} for a learned MASK embedding)")
        self.register_buffer("embed_weight", embed_weight.detach(), persistent=False)
        self.register_buffer("lm_head_weight", lm_head_weight.detach(), persistent=False)
        self.mask_token_id = mask_token_id
        if mask_token_id == LEARNED_MASK:  # mean in fp32 without a full fp32 copy of the matrix
            init = embed_weight.detach().mean(0, dtype=torch.float32).to(embed_weight.dtype)
            self.mask_embed = nn.Parameter(init)
        ids = None if draft_vocab is None else _check_draft_ids(draft_vocab, V, embed_weight.device)
        rows, index = (None, None) if ids is None else _id_maps(lm_head_weight.detach(), ids)
        self.register_buffer("draft_ids", ids)  # persistent: the artifact's id map
        self.register_buffer("draft_lm_head", rows, persistent=False)
        self.register_buffer("draft_index", index, persistent=False)

    @property
    def size(self) -> int:
        """Width of the drafter's logits: N with a draft vocabulary, else the target's V."""
        return self.embed_weight.shape[0] if self.draft_ids is None else self.draft_ids.shape[0]

    @property
    def out_weight(self) -> torch.Tensor:
        """The output projection [size, H]: the lm_head, or its draft-vocabulary rows."""
        return self.lm_head_weight if self.draft_ids is None else self.draft_lm_head

    def embed(self, ids):
        """Target embedding of target ids; MASK slots (`LEARNED_MASK`) get `mask_embed`."""
        if self.mask_token_id != LEARNED_MASK:
            return F.embedding(ids, self.embed_weight)
        e = F.embedding(ids.clamp_min(0), self.embed_weight)
        return torch.where((ids == LEARNED_MASK)[..., None], self.mask_embed.to(e.dtype), e)

    def to_target(self, idx):
        """Draft-vocabulary indices -> target ids (identity without a draft vocabulary)."""
        return idx if self.draft_ids is None else self.draft_ids[idx]

    def to_draft(self, ids):
        """Target ids -> draft-vocabulary indices, -1 for ids outside it."""
        return ids if self.draft_ids is None else self.draft_index[ids]

    def to_full(self, probs):
        """Probabilities over the draft vocabulary [..., N] -> over the target's [..., V],
        zero outside: what verification compares with the target's p."""
        if self.draft_ids is None:
            return probs
        out = probs.new_zeros(*probs.shape[:-1], self.embed_weight.shape[0])
        return out.index_copy_(-1, self.draft_ids, probs)

    def coverage(self, tokens) -> Optional[float]:
        """Share of the target ids `tokens` inside the draft vocabulary; None without
        one (nothing is outside) or without tokens."""
        ids = torch.as_tensor(tokens, dtype=torch.long).reshape(-1)
        if self.draft_ids is None or ids.numel() == 0:
            return None
        return float((self.to_draft(ids.to(self.draft_index.device)) >= 0).float().mean())

    def with_draft_ids(self, draft_ids) -> "DraftVocabView":
        """The same vocabulary with other draft ids (sorted, distinct): a light view for
        one request that shares this one's embedding, lm_head and MASK embedding."""
        return DraftVocabView(self, draft_ids)


class DraftVocabView:
    """`FrozenVocab.with_draft_ids`: the frozen vocabulary of a drafter with another set
    of draft ids (e.g. a per-request one, `dlite.decoding.context_vocab`). Only the
    lm_head rows at those ids and the id map are its own; embedding, lm_head and MASK
    embedding are the drafter's tensors, not copies. Not a module: nothing to train
    or save. The id-space methods are FrozenVocab's, which read only these attributes."""

    def __init__(self, base: FrozenVocab, draft_ids):
        self.embed_weight, self.lm_head_weight = base.embed_weight, base.lm_head_weight
        self.mask_token_id = base.mask_token_id
        if base.mask_token_id == LEARNED_MASK:
            self.mask_embed = base.mask_embed
        self.draft_ids = _check_draft_ids(draft_ids, self.embed_weight.shape[0], self.embed_weight.device)
        self.draft_lm_head, self.draft_index = _id_maps(self.lm_head_weight, self.draft_ids)

    size, out_weight = FrozenVocab.size, FrozenVocab.out_weight
    embed, to_target, to_draft = FrozenVocab.embed, FrozenVocab.to_target, FrozenVocab.to_draft
    to_full, coverage = FrozenVocab.to_full, FrozenVocab.coverage

    def nbytes(self) -> int:
        """What the view holds of its own (its lm_head rows and id maps)."""
        own = (self.draft_ids, self.draft_lm_head, self.draft_index)
        return sum(t.numel() * t.element_size() for t in own)


def _id_maps(lm_head_weight: torch.Tensor, ids: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """(the lm_head rows at `ids` [N, H], target id -> draft index [V], -1 outside)."""
    index = torch.full((lm_head_weight.shape[0],), -1, dtype=torch.long, device=ids.device)
    index.index_copy_(0, ids, torch.arange(len(ids), device=ids.device))
    return lm_head_weight.index_select(0, ids), index


def _check_draft_ids(draft_vocab, V: int, device) -> torch.Tensor:
    ids = torch.as_tensor(draft_vocab, dtype=torch.long, device=device).reshape(-1)
    if ids.device.type == "meta":  # a shapes-only build (parameter counts): nothing to check
        return ids
    if ids.numel() < 1 or int(ids.min()) < 0 or int(ids.max()) >= V:
        raise ValueError(f"draft vocabulary: {ids.numel()} ids must lie in 0..{V - 1}")
    if ids.numel() > 1 and not bool((ids[1:] > ids[:-1]).all()):
        raise ValueError("draft vocabulary: ids must be sorted and distinct")
    return ids


def attach_target(model: nn.Module, cfg, embed_weight: torch.Tensor,
                  lm_head_weight: torch.Tensor, mask_token_id: int,
                  draft_vocab: Optional[torch.Tensor] = None) -> None:
    """What every drafter architecture records about its target: gamma, the captured
    layers, the frozen shared vocabulary (MASK, draft vocabulary) and the context-feature
    width. `cfg.draft_vocab_size` must match the ids given (None: none given)."""
    if cfg.gamma < 2:
        raise ValueError(f"drafter.gamma must be >= 2, got {cfg.gamma}")
    n = None if draft_vocab is None else len(draft_vocab)
    if n != cfg.draft_vocab_size:
        raise ValueError(f"drafter.draft_vocab_size={cfg.draft_vocab_size} but "
                         f"{'no' if n is None else n} draft vocabulary ids were given")
    model.cfg, model.gamma = cfg, cfg.gamma
    model.target_layer_ids = list(cfg.target_layer_ids)
    model.vocab = FrozenVocab(embed_weight, lm_head_weight, mask_token_id, draft_vocab)
    model.target_hidden = embed_weight.shape[1]
    model.feature_dim = len(cfg.target_layer_ids) * model.target_hidden
    # An inference setting, not a weight (`sample_block`): evaluation sets it from
    # eval.draft_stop_prob; 0 drafts all gamma slots every round.
    model.draft_stop_prob = 0.0


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
    """Frozen target embedding, projected to the drafter width when they differ. Cast to
    the drafter's dtype first: the vocabulary comes in the target's (`load_drafter` takes
    it from the target), so a bf16 artifact next to an fp32 target would otherwise feed
    fp32 rows into bf16 layers (a dtype error at the first draft)."""
    return model.backbone.in_proj(model.vocab.embed(ids).to(model.backbone.norm.weight.dtype))



def block_rows(model, anchors: Sequence[int], positions: Sequence[int], device):
    """Backbone input [B, g, hid] for B blocks [anchor, MASK...] and their positions
    [B, g] (row b's block starts at positions[b])."""
    ids = torch.full((len(anchors), model.gamma), model.vocab.mask_token_id, device=device)
    ids[:, 0] = torch.as_tensor(list(anchors), dtype=torch.long, device=device)
    offs = torch.arange(model.gamma, device=device)
    return embed_in(model, ids), torch.as_tensor(list(positions), device=device)[:, None] + offs


def block_inputs(model, anchor_id: int, anchor_pos: int, device):
    """Backbone input [1, g, hid] for [anchor, MASK...] and its positions [1, g]."""
    return block_rows(model, [anchor_id], [anchor_pos], device)


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


# Where `sample_block` reports each slot's own confidence while a hybrid asks for it
# (`recording_confidences`): scoped to the caller's context, so drafters keep their
# `draft` signature and nothing is recorded (no host sync) when nobody asks.
_CONFIDENCES: contextvars.ContextVar = contextvars.ContextVar("dlite_draft_confidences", default=None)


class Confidences(list):
    """The slots' records, and `first`: the first slot's distribution softmax(logits) at
    T = 1 whatever the temperature, spread over the target's vocabulary [V] (None until
    a draft ran) -- what the drafter believes of any proposed first token, a number
    fixed before anything is drawn."""
    first: Optional[torch.Tensor] = None


@contextlib.contextmanager
def recording_confidences():
    """Collect, for every slot drafted inside, {"chosen": probability of the chosen token,
    "top": the slot distribution's largest probability} (softmax over the drafter's
    vocabulary, at its temperature; T = 0: softmax(logits), and the two are equal),
    and the first slot's whole distribution (`Confidences.first`)."""
    slots = Confidences()
    token = _CONFIDENCES.set(slots)
    try:
        yield slots
    finally:
        _CONFIDENCES.reset(token)


def sample_block(step, gamma: int, anchor_id: int, temperature: float, device, vocab: FrozenVocab,
                 generator: Optional[torch.Generator] = None, stop_prob: float = 0.0):
    """Walk the block left to right: step(k, prev_token [1] (a target id), state) ->
    (logits [N], state) over the drafter's vocabulary. Tokens come back as target ids.

    T = 0: argmax of the logits, probs = None (nothing reads probabilities under greedy
    verification). T > 0: each token is drawn from softmax(logits/T) over the draft
    vocabulary, and exactly that distribution is returned, spread over the target's
    vocabulary with zeros outside (`vocab.to_full`) -- the q the rejection rule needs.

    `stop_prob` > 0: stop before the first slot where the drafter's own probability
    that the whole block so far is right (the product of each chosen token's
    probability; at T = 0 under softmax(logits)) falls below it, so fewer than gamma
    tokens (possibly none) go to verification. On this project's CPU (SmolLM2-135M at
    4K context) verifying 1 / 2 / 4 / 8 tokens costs 1.0 / 1.4 / 1.6 / 2.2 decode steps,
    so not verifying a block that will be rejected is time saved. Whether slot k is
    kept reads the earlier slots' chosen tokens and slot k's distribution, never slot
    k's own draw: at T > 0 a draw kept only when it is likely would no longer follow q,
    and the rejection rule would be inexact (slot k's own number is its distribution's
    largest probability, which at T = 0 is the chosen token's). It costs one host sync
    per slot; with stop_prob 0 and no recording, tokens stay on device."""
    prev = torch.tensor([anchor_id], device=device)
    tokens, probs, state, sure = [], [], None, 1.0
    record = _CONFIDENCES.get()
    for k in range(gamma):
        logits, state = step(k, prev, state)
        sure_needed = stop_prob > 0 or record is not None
        if temperature > 0:
            p = torch.softmax(logits.float() / temperature, dim=-1)
            idx = torch.multinomial(p, 1, generator=generator)
        else:
            idx = logits.argmax(-1, keepdim=True)
            p = torch.softmax(logits.float(), -1) if sure_needed else None
        if k == 0 and record is not None:  # before any stop: known even when nothing is kept
            first = p if temperature <= 0 else torch.softmax(logits.float(), -1)  # T = 1 either way
            record.first = vocab.to_full(first.reshape(1, -1))[0]
        if sure_needed:
            top, chosen = float(p.max()), float(p[idx])
            if stop_prob > 0 and sure * top < stop_prob:
                break
            sure *= chosen
            if record is not None:
                record.append({"chosen": chosen, "top": top})
        if temperature > 0:
            probs.append(p)
        prev = vocab.to_target(idx)
        tokens.append(prev)
    if not tokens:  # nothing worth verifying: the round is one plain target step
        full_v = vocab.lm_head_weight.shape[0]
        return (torch.empty(0, dtype=torch.long, device=device),
                None if temperature <= 0 else torch.empty(0, full_v, device=device))
    return torch.cat(tokens), (vocab.to_full(torch.stack(probs)) if probs else None)


def sample_rows(step, gamma: int, anchors: torch.Tensor, temperature: float, vocab: FrozenVocab,
                generator: Optional[torch.Generator] = None, stop_prob: float = 0.0) -> list:
    """`sample_block` for B independent blocks at once: step(k, prev [B], state) ->
    (logits [B, N], state); returns B (tokens, probs) pairs as `sample_block` would.
    Every row walks all gamma slots (one batched head step each) and is then cut where
    `sample_block`'s stop rule would have stopped it: the same rule, read afterwards,
    so no row waits on a host sync per slot."""
    prev, toks, probs, tops, chosen, state = anchors, [], [], [], [], None
    for k in range(gamma):
        logits, state = step(k, prev, state)
        if temperature > 0:
            p = torch.softmax(logits.float() / temperature, dim=-1)
            idx = torch.multinomial(p, 1, generator=generator)[:, 0]
            probs.append(p)
        else:
            idx = logits.argmax(-1)
            p = torch.softmax(logits.float(), -1) if stop_prob > 0 else None
        if stop_prob > 0:
            tops.append(p.max(-1).values)
            chosen.append(p.gather(-1, idx[:, None])[:, 0])
        prev = vocab.to_target(idx)
        toks.append(prev)
    tokens = torch.stack(toks, 1)
    cut = [gamma] * tokens.shape[0]
    if stop_prob > 0:
        keeps = stop_rule_keeps(torch.stack(chosen, 1), torch.stack(tops, 1), stop_prob)
        cut = keeps.long().cumprod(1).sum(1).tolist()
    full = vocab.to_full(torch.stack(probs, 1)) if probs else None
    return [(tokens[b, :c], None if full is None else full[b, :c]) for b, c in enumerate(cut)]


def stop_rule_keeps(chosen: torch.Tensor, tops: torch.Tensor, stop_prob: float) -> torch.Tensor:
    """`sample_block`'s stop rule read afterwards, for rows of walked blocks [B, g]: slot k
    passes iff (product of earlier slots' chosen probabilities) x top_k >= stop_prob; a
    block keeps its slots up to the first that fails (the caller's cumprod). Shared by
    `sample_rows` and the validation's greedy replay (`dlite.losses.greedy_replay`), so
    what validation cuts is what decoding cuts."""
    sure = torch.cat([torch.ones_like(chosen[:, :1]), chosen.cumprod(1)[:, :-1]], 1)
    return (sure * tops) >= stop_prob
