"""A per-request draft vocabulary (issue 20): the drafter's static draft vocabulary
(`dlite.data.draft_vocab`, from the training data) united with the distinct tokens of
the current prompt. A static set caps held-out coverage near 0.9, mostly on the
identifiers and file names an agent copies from its own history; those are exactly
the tokens its context holds.

`ContextVocab(model)` is a factory prompt_ids -> `ContextVocabDrafter` (what `replay`
and `dlite.decoding.methods` take). The per-request drafter drafts with the same
model and weights over ids = sorted(static ids | prompt ids): the lm_head rows at those
ids and the id map are gathered ONCE per request, lazily at the first `draft`, so the
cost lands in draft_ms as a server would pay it. The prompt alone decides the set:
tokens the target generates later in the turn are not added (one gather per turn,
none per round).

Verification is unchanged, so greedy decoding stays lossless; at T > 0 the drafter's q
is the softmax over the per-request ids it sampled from, zero elsewhere, so the
rejection rule stays exact."""

import inspect
from typing import Optional, Sequence

import torch


class ContextVocab:
    """Factory prompt_ids -> per-request drafter over `model`. Refuses a model without
    a static draft vocabulary (it already drafts over every token: nothing to extend)
    and one whose `draft` cannot take another vocabulary (DSpark's Markov head is a
    bias sized to its static vocabulary; the history teacher is no deployed drafter)."""

    def __init__(self, model):
        if getattr(getattr(model, "vocab", None), "draft_ids", None) is None:
            raise ValueError("context vocabulary: the drafter has no static draft vocabulary "
                             "(drafter.draft_vocab_size) to extend; it drafts over all tokens already")
        if "vocab" not in inspect.signature(model.draft).parameters:
            raise ValueError(f"context vocabulary: {type(model).__name__} drafts over its static "
                             f"vocabulary only (a history-free DLite drafter can take another)")
        self.model = model

    def __call__(self, prompt_ids: Sequence[int]) -> "ContextVocabDrafter":
        return ContextVocabDrafter(self.model, prompt_ids)


class ContextVocabDrafter:
    """`model` drafting over static ids | prompt ids, for one prompt. `vocab` (the
    per-request `FrozenVocab.with_draft_ids` view) is None until the first draft."""

    needs_history = False

    def __init__(self, model, prompt_ids: Sequence[int]):
        self.model, self.prompt_ids, self.vocab = model, prompt_ids, None
        self.gamma, self.target_layer_ids = model.gamma, model.target_layer_ids

    def request_ids(self) -> torch.Tensor:
        """sorted(static draft ids | distinct prompt ids), on the model's device."""
        static = self.model.vocab.draft_ids
        prompt = torch.as_tensor(self.prompt_ids, dtype=torch.long).reshape(-1).to(static.device)
        return torch.unique(torch.cat([static, prompt]))  # sorted and distinct

    def new_state(self):
        return self.model.new_state()

    def draft(self, state, new_features: torch.Tensor, anchor_id: int, anchor_pos: int,
              temperature: float, generator: Optional[torch.Generator] = None):
        if self.vocab is None:  # once per request, inside the timed draft
            self.vocab = self.model.vocab.with_draft_ids(self.request_ids())
        return self.model.draft(state, new_features, anchor_id, anchor_pos, temperature,
                                generator, vocab=self.vocab)

    def cache_bytes(self, state) -> int:
        # The ids come from the target's own context, but the gathered lm_head rows are
        # per-request memory that grows with the prompt's distinct tokens: counted.
        own = 0 if self.vocab is None else self.vocab.nbytes()
        return self.model.cache_bytes(state) + own

    def vocab_coverage(self, tokens) -> Optional[float]:
        """Share of the target ids `tokens` inside the per-request vocabulary (the view's
        own `coverage`; built here if no draft was made)."""
        vocab = self.vocab if self.vocab is not None else self.model.vocab.with_draft_ids(self.request_ids())
        return vocab.coverage(tokens)

    def static_coverage(self, tokens) -> Optional[float]:
        """The static draft vocabulary's share of `tokens`, for comparison."""
        return self.model.vocab.coverage(tokens)
