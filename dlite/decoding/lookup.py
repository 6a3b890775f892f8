"""Training-free drafting from the context itself, the baselines a user tries before
training anything (issue: prompt lookup, as `generate(prompt_lookup_num_tokens=)` in
transformers and `method: ngram` in vLLM), and the hybrid with a learned drafter.

`PromptLookupDrafter`: the longest n-gram (max_ngram down to min_ngram) ending at the
anchor that also occurs earlier in the sequence; the tokens that followed that earlier
occurrence are the draft (up to gamma; none when nothing matches, and the round is a
plain target step). `prefer="last"` takes the most recent occurrence (agent histories
re-read and edit the latest version of a file), `"first"` the earliest, as transformers
does. The proposal is deterministic, so at T > 0 its q is one-hot: the rejection rule
accepts x with probability p(x) and resamples from the residual -- still exact.

`HybridDrafter`: per round, the lookup's proposal when its n-gram match is at least
`min_match` tokens long, else the learned drafter's block. A history-free drafter
(DLite) can simply skip the rounds lookup takes: it keeps no cache to extend. A
drafter with a history cache (DSpark-style) cannot, and is refused."""

from typing import List, Optional, Sequence, Tuple

import torch

from dlite.decoding.sequence import AcceptedSequence


def longest_match(ids: torch.Tensor, max_ngram: int, min_ngram: int = 1,
                  prefer: str = "last") -> Tuple[Optional[int], int]:
    """(index where the continuation starts, n) for the longest n-gram in
    max_ngram..min_ngram that ends `ids` [L] and occurs earlier with at least one
    token after it; (None, 0) when there is none."""
    L = ids.numel()
    for n in range(min(max_ngram, L - 1), min_ngram - 1, -1):
        # Windows starting at 0..L-1-n: each ends before the last token, so a
        # continuation token exists (it may overlap the suffix: repeats are fine).
        hits = (ids[: L - 1].unfold(0, n, 1) == ids[L - n:]).all(1).nonzero().flatten()
        if hits.numel():
            start = int(hits[-1] if prefer == "last" else hits[0])
            return start + n, n
    return None, 0


def lookup_proposal(ids: torch.Tensor, gamma: int, max_ngram: int, min_ngram: int = 1,
                    prefer: str = "last") -> Tuple[List[int], int]:
    """(up to gamma continuation tokens, match length n); ([], 0) without a match."""
    start, n = longest_match(ids, max_ngram, min_ngram, prefer)
    return ([] if start is None else ids[start: start + gamma].tolist()), n


def token_block(proposal: List[int], vocab_size: int, temperature: float):
    """(tokens [n], q) for a deterministic proposal, as every drafter returns a block:
    q is None at T = 0 (greedy never reads it), else one-hot rows [n, V]."""
    tokens = torch.tensor(proposal, dtype=torch.long)
    if temperature <= 0:
        return tokens, None
    q = torch.zeros(tokens.numel(), vocab_size)
    return tokens, q.scatter_(1, tokens[:, None], 1.0)


class TokenDrafter:
    """What every drafter that reads tokens rather than features shares: `draft` is its
    `propose(state, anchor_id, anchor_pos) -> (tokens, match length)` recorded in the
    state's `AcceptedSequence`, with a one-hot q at T > 0. No target layers."""

    needs_history = False
    target_layer_ids: List[int] = []
    vocab_size: int

    def draft(self, state, new_features, anchor_id: int, anchor_pos: int, temperature: float,
              generator: Optional[torch.Generator] = None):
        proposal, _ = self.propose(state, anchor_id, anchor_pos)
        state.drafted(proposal)
        return (*token_block(proposal, self.vocab_size, temperature), state)


class PromptLookupDrafter(TokenDrafter):
    """Prompt lookup for one prompt (make one per prompt; `replay` takes a factory
    prompt_ids -> drafter). Reads tokens only: no target layers, no cache."""

    def __init__(self, prompt_ids: Sequence[int], vocab_size: int, gamma: int = 7,
                 max_ngram: int = 4, min_ngram: int = 1, prefer: str = "last"):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}..{max_ngram}")
        if prefer not in ("last", "first"):
            raise ValueError(f"prefer must be 'last' or 'first', got {prefer!r}")
        self.prompt_ids = [int(x) for x in torch.as_tensor(prompt_ids).reshape(-1)]
        self.vocab_size, self.gamma = vocab_size, gamma
        self.max_ngram, self.min_ngram, self.prefer = max_ngram, min_ngram, prefer

    def new_state(self) -> AcceptedSequence:
        return AcceptedSequence(self.prompt_ids)

    def propose(self, state: AcceptedSequence, anchor_id: int, anchor_pos: int) -> Tuple[List[int], int]:
        """Advance the sequence to the anchor and return (proposal, match length)."""
        ids = torch.tensor(state.advance(anchor_id, anchor_pos) + [int(anchor_id)])
        return lookup_proposal(ids, self.gamma, self.max_ngram, self.min_ngram, self.prefer)

    def cache_bytes(self, state) -> int:
        return 0  # the token ids it searches are the target's own context


class HybridDrafter:
    """A token-reading drafter's proposal (`PromptLookupDrafter` or a `SuffixDrafter`:
    anything with `propose`) when its match is >= `min_match` tokens, else the learned
    drafter's block. For one prompt, like the drafter it wraps; `state["source"]` lists
    which one drafted each round."""

    def __init__(self, model, lookup, min_match: int = 2):
        if model.needs_history:
            raise ValueError("the hybrid needs a history-free drafter: one with a history "
                             "cache would miss the positions of the rounds lookup drafts")
        self.model, self.lookup, self.min_match = model, lookup, min_match
        self.gamma = max(model.gamma, lookup.gamma)
        self.target_layer_ids, self.needs_history = model.target_layer_ids, False

    def new_state(self):
        return dict(seq=self.lookup.new_state(), model=self.model.new_state(), source=[])

    def draft(self, state, new_features, anchor_id: int, anchor_pos: int, temperature: float,
              generator: Optional[torch.Generator] = None):
        proposal, n = self.lookup.propose(state["seq"], anchor_id, anchor_pos)
        if proposal and n >= self.min_match:
            tokens, probs = token_block(proposal, self.lookup.vocab_size, temperature)
            state["source"].append("lookup")
        else:
            tokens, probs, state["model"] = self.model.draft(state["model"], new_features, anchor_id,
                                                             anchor_pos, temperature, generator)
            state["source"].append("model")
        state["seq"].drafted(tokens.tolist())
        return tokens, probs, state

    def finish(self, state, new_tokens: List[int]) -> None:
        if hasattr(self.lookup, "finish"):  # SuffixDecoding indexes the whole response
            self.lookup.finish(state["seq"], new_tokens)

    def round_info(self, state) -> dict:
        """What the round record says drafted this round (`lookup` or `model`)."""
        return {"source": state["source"][-1]}

    def cache_bytes(self, state) -> int:
        return self.model.cache_bytes(state["model"]) + self.lookup.cache_bytes(state["seq"])
