"""Reference drafters for testing the decoding loop without a trained drafter.

`TargetAsDrafter` is the target drafting for itself: under greedy decoding every draft
is accepted, so tau reaches its ceiling γ+1 and any shortfall is a bug in the loop
(or a genuine argmax near-tie between a one-token and a block forward).
`RandomDrafter` is a random-weight head over the last feature row: almost nothing is
accepted, which exercises the rejection / correction path on every round. Both follow
the drafter protocol of `dlite.models.common.Drafter` (probs at the drafting
temperature; at T=0 argmax tokens with their T=1 softmax)."""

from typing import List, Optional

import torch
from dlite.decoding.decode import _device, crop_cache, new_cache, target_forward
from dlite.decoding.sequence import AcceptedSequence


def _pick(logits: torch.Tensor, temperature: float, generator):
    """(token [1], probs [V]) following the drafter convention."""
    logits = logits.float()
    if temperature > 0:
        p = torch.softmax(logits / temperature, -1)
        return torch.multinomial(p, 1, generator=generator), p
    return logits.argmax(-1, keepdim=True), torch.softmax(logits, -1)


class TargetAsDrafter:
    """The target itself as a (history-needing) drafter for one prompt.

    It ignores the features and rebuilds the token sequence from successive calls
    (`AcceptedSequence`). It keeps its own target cache."""

    needs_history = True

    def __init__(self, target, prompt_ids, gamma: int = 4, target_layer_ids: Optional[List[int]] = None):
        self.target, self.gamma = target, gamma
        self.prompt_ids = [int(x) for x in torch.as_tensor(prompt_ids).reshape(-1)]
        n_layers = target.config.num_hidden_layers
        self.target_layer_ids = list(target_layer_ids if target_layer_ids is not None else [n_layers - 1])

    def new_state(self) -> dict:
        return dict(cache=new_cache(self.target), seq=AcceptedSequence(self.prompt_ids))

    @torch.no_grad()
    def draft(self, state, new_features, anchor_id: int, anchor_pos: int, temperature: float,
              generator: Optional[torch.Generator] = None):
        seq, cache = state["seq"].advance(anchor_id, anchor_pos), state["cache"]
        # Cached rows past the accepted prefix belong to rejected drafts: drop them.
        crop_cache(cache, min(cache.get_seq_length(), anchor_pos))
        done = cache.get_seq_length()
        dev = _device(self.target)
        feed = torch.tensor(seq[done:] + [anchor_id], device=dev)
        tokens, probs = [], []
        for k in range(self.gamma):
            logits = target_forward(self.target, feed, done, cache, logits_to_keep=1)[-1]
            tok, p = _pick(logits, temperature, generator)
            tokens.append(tok)
            probs.append(p)
            done, feed = done + feed.shape[0], tok
        draft = torch.cat(tokens)
        state["seq"].drafted(draft.tolist())
        return draft, torch.stack(probs), state

    def cache_bytes(self, state) -> int:
        cache = state["cache"]
        return sum(t.numel() * t.element_size() for layer in cache.layers
                   for t in (getattr(layer, "keys", None), getattr(layer, "values", None))
                   if isinstance(t, torch.Tensor))


class RandomDrafter:
    """History-free random-weight drafter: h = W_f f + e(prev), logits = W_v h, where
    f is the last feature row, e the target's (frozen, shared) input embedding and W_v
    has the target lm_head's shape [V, H]. `scale` sets how peaked its guesses are.
    A plain object, not a module: it must not adopt (and move) the target's embedding."""

    needs_history = False

    def __init__(self, target, gamma: int = 4, target_layer_ids: Optional[List[int]] = None,
                 seed: int = 0, scale: float = 1.0):
        cfg, dev = target.config, _device(target)
        self.gamma = gamma
        self.target_layer_ids = list(target_layer_ids if target_layer_ids is not None
                                     else [cfg.num_hidden_layers - 1])
        hidden, vocab = cfg.hidden_size, target.lm_head.weight.shape[0]
        g = torch.Generator().manual_seed(seed)
        k = len(self.target_layer_ids)
        self.w_f = (torch.randn(hidden, k * hidden, generator=g) / (k * hidden) ** 0.5).to(dev)
        self.w_v = (torch.randn(vocab, hidden, generator=g) * scale / hidden ** 0.5).to(dev)
        self.embed = target.get_input_embeddings()

    def new_state(self):
        return None

    @torch.no_grad()
    def draft(self, state, new_features, anchor_id: int, anchor_pos: int, temperature: float,
              generator: Optional[torch.Generator] = None):
        base = self.w_f @ new_features[-1].float()
        prev = torch.tensor([anchor_id], device=new_features.device)
        tokens, probs = [], []
        for _ in range(self.gamma):
            h = base + self.embed(prev)[0].float()
            h = h / h.norm().clamp_min(1e-6) * h.shape[0] ** 0.5
            prev, p = _pick(self.w_v @ h, temperature, generator)
            tokens.append(prev)
            probs.append(p)
        return torch.cat(tokens), torch.stack(probs), None

    def cache_bytes(self, state) -> int:
        return 0
