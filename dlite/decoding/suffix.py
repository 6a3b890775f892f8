"""SuffixDecoding (Oliaro et al., 2024; Snowflake `arctic-inference` 0.3.0, Apache-2.0)
as a training-free drafter, the model-free baseline built for agent workloads.

Each request's prompt and output are indexed in a suffix tree (per request) and every
output also goes into ONE global tree shared by all requests, so a later request can
copy spans that earlier responses produced. A round matches the longest suffix of the
context (up to `max_tree_depth` tokens) in both trees and proposes the most frequent
continuation, at most `max_spec_factor * match_len + max_spec_offset` tokens (and at
most gamma): short matches draft little, so a miss costs little verification.

`SuffixDecoding(vocab_size, ...)` owns the shared cache; calling it with a prompt gives
a `SuffixDrafter` for that prompt (the factory `replay` takes). The drafter follows
`PromptLookupDrafter`'s protocol, state included (an `AcceptedSequence`), so the hybrid
can wrap it too. The proposal is deterministic: q is one-hot at T > 0, still exact.

The native module is built by `bash scripts/setup.sh` and imported lazily, so the rest
of `dlite` imports without it."""

from typing import List, Optional, Sequence, Tuple

import torch

from dlite.decoding.lookup import TokenDrafter
from dlite.decoding.sequence import AcceptedSequence


def _cache_class():
    try:
        from arctic_inference.suffix_decoding import SuffixDecodingCache
    except ImportError as e:
        raise ImportError("SuffixDecoding needs arctic-inference 0.3.0 (built from its "
                          "sdist): run `bash scripts/setup.sh`") from e
    return SuffixDecodingCache


class SuffixState(AcceptedSequence):
    """The accepted sequence plus this request's bookkeeping in the suffix cache."""

    def __init__(self, prompt_ids: Sequence[int]):
        super().__init__(prompt_ids)
        self.req_id: Optional[int] = None  # started at the first draft
        self.fed = len(self.ids)  # sequence positions already in the trees
        self.tree_bytes, self.tree_bytes_at = 0, 0


class SuffixDecoding:
    """The shared suffix cache, and a factory prompt_ids -> `SuffixDrafter`.

    min_token_prob must stay <= 0.5 to draft from a span seen once before: the
    request's own tail is in its tree too, so a single earlier occurrence scores 1/2.
    global_tree=False keeps per-request trees only (prompt lookup's information)."""

    def __init__(self, vocab_size: int, gamma: int = 7, max_tree_depth: int = 64,
                 max_spec_factor: float = 1.0, max_spec_offset: float = 0.0,
                 min_token_prob: float = 0.1, global_tree: bool = True):
        if gamma < 1 or max_tree_depth < 2:
            raise ValueError(f"need gamma >= 1 and max_tree_depth >= 2, got {gamma}, {max_tree_depth}")
        if not 0.0 <= min_token_prob <= 1.0:
            raise ValueError(f"min_token_prob must be in [0, 1], got {min_token_prob}")
        self._settings = dict(gamma=gamma, max_tree_depth=max_tree_depth, max_spec_factor=max_spec_factor,
                              max_spec_offset=max_spec_offset, min_token_prob=min_token_prob,
                              global_tree=global_tree)
        # max_cached_requests: -1 keeps every response in the global tree, 0 disables it.
        self.cache = _cache_class()(max_tree_depth, -1 if global_tree else 0)
        self.vocab_size, self.gamma, self.max_tree_depth = vocab_size, gamma, max_tree_depth
        self.spec_kw = dict(max_spec_tokens=gamma, max_spec_factor=max_spec_factor,
                            max_spec_offset=max_spec_offset, min_token_prob=min_token_prob,
                            use_tree_spec=False)  # one chain; tree hybrids ask for trees
        self._active: set = set()  # several at once under batched decoding
        self._next_id = 0

    def __call__(self, prompt_ids) -> "SuffixDrafter":
        return SuffixDrafter(self, prompt_ids)

    def fork(self) -> "SuffixDecoding":
        """The same settings over empty trees (a warm-up run that must not teach this one)."""
        return SuffixDecoding(self.vocab_size, **self._settings)

    def stop(self, req_id: int) -> None:
        """End request `req_id`: its prompt tree goes, its response stays global."""
        if req_id in self._active:
            self.cache.stop_request(req_id)
            self._active.discard(req_id)

    def start(self, prompt_ids: List[int]) -> int:
        """A fresh request id. Several may be active at once (batched decoding: every
        row's request), each ended by its drafter's `finish`."""
        req_id, self._next_id = self._next_id, self._next_id + 1
        self.cache.start_request(req_id, prompt_ids)
        self._active.add(req_id)
        return req_id

    def global_bytes(self) -> int:
        """Host memory of the tree over all earlier responses (shared, not per request)."""
        return int(self.cache._global_tree.estimate_memory())


def tree_paths(token_ids: Sequence[int], parents: Sequence[int], probs: Sequence[float],
               depth: int) -> List[Tuple[List[int], List[float]]]:
    """A speculation tree (arctic-inference: node i's parent is parents[i], -1 for the
    root's children; probs are path probabilities) as its root-to-leaf paths cut to
    `depth`, most probable leaf first: (tokens, each token's probability given the path
    before it)."""
    has_child = {p for p in parents if p >= 0}
    paths, seen = [], set()
    for leaf in sorted((i for i in range(len(token_ids)) if i not in has_child), key=lambda i: -probs[i]):
        chain, i = [], leaf
        while i >= 0:
            chain.append(i)
            i = parents[i]
        chain = chain[::-1][:depth]
        key = tuple(int(token_ids[i]) for i in chain)
        if key in seen:
            continue
        seen.add(key)
        cond = [probs[i] / (probs[parents[i]] if parents[i] >= 0 and probs[parents[i]] > 0 else 1.0) for i in chain]
        paths.append((list(key), [float(min(c, 1.0)) for c in cond]))
    return paths


class SuffixDrafter(TokenDrafter):
    """SuffixDecoding for one prompt. Reads tokens only: no target layers."""

    source = "suffix"  # the name hybrids record and calibrate it under

    def __init__(self, owner: SuffixDecoding, prompt_ids):
        self.owner = owner
        self.prompt_ids = [int(x) for x in torch.as_tensor(prompt_ids).reshape(-1)]
        self.vocab_size, self.gamma = owner.vocab_size, owner.gamma

    def new_state(self) -> SuffixState:
        return SuffixState(self.prompt_ids)

    def propose(self, state: SuffixState, anchor_id: int, anchor_pos: int) -> Tuple[List[int], int]:
        """Advance to the anchor, add what was emitted since the last call (accepted
        drafts, the previous anchor, and this anchor: all response tokens) to the
        trees, and return (proposal, match length)."""
        draft = self._speculate(state, anchor_id, anchor_pos)
        return [int(x) for x in draft.token_ids][: self.gamma], int(draft.match_len)

    def propose_branches(self, state: SuffixState, anchor_id: int, anchor_pos: int, tree: bool = False,
                         max_nodes: Optional[int] = None) -> List[Tuple[List[int], List[float]]]:
        """As `propose`, but the speculation's paths with each token's probability given
        the path to it: one chain, or (`tree`) every branch of the speculation tree of at
        most `max_nodes` nodes (default gamma), each cut to gamma tokens."""
        draft = self._speculate(state, anchor_id, anchor_pos, tree, max_nodes)
        return tree_paths(draft.token_ids, draft.parents, draft.probs, self.gamma) if draft.token_ids else []

    def _speculate(self, state: SuffixState, anchor_id: int, anchor_pos: int, tree: bool = False,
                   max_nodes: Optional[int] = None):
        """The native speculation after bringing the trees up to the anchor."""
        ids = state.advance(anchor_id, anchor_pos)
        cache = self.owner.cache
        if state.req_id is None:
            # Indexing the prompt is O(L): done here so it counts in the first round's
            # draft_ms, as a server pays it when the request arrives.
            state.req_id = self.owner.start(self.prompt_ids)
        # As the authors' vLLM runner does: every emitted token, the anchor (the
        # target's bonus token) included, joins the response before speculating.
        cache.add_active_response(state.req_id, ids[state.fed:] + [int(anchor_id)])
        state.fed = anchor_pos + 1
        context = ids[max(0, len(ids) - self.owner.max_tree_depth + 1):] + [int(anchor_id)]
        kw = dict(self.owner.spec_kw, use_tree_spec=tree)
        if tree:
            kw["max_spec_tokens"] = max_nodes or self.gamma
        return cache.speculate(state.req_id, context, **kw)

    def finish(self, state: SuffixState, new_tokens: List[int]) -> None:
        """After the last round: the tokens emitted since the last `propose` (the last
        round's accepted drafts and bonus) join the response, so the global tree holds
        the whole output for later requests; then the request ends."""
        if state.req_id is not None:
            fed = state.fed - len(self.prompt_ids)
            if new_tokens[fed:]:
                self.owner.cache.add_active_response(state.req_id, [int(x) for x in new_tokens[fed:]])
            state.fed = len(self.prompt_ids) + len(new_tokens)
            self.owner.stop(state.req_id)

    def cache_bytes(self, state: SuffixState) -> int:
        """The request's own suffix tree (host memory, ~300 B per token at depth 64):
        it grows with L like a history cache does, unlike lookup's 0. The shared global
        tree is not counted (see `SuffixDecoding.global_bytes`)."""
        if state.req_id is None or state.req_id not in self.owner.cache.active_requests:
            return state.tree_bytes
        # estimate_memory walks the tree (~1 ms at 50K tokens): re-measure only after
        # the tree grew by 1/16, so the per-round cost stays flat in L.
        if state.fed - state.tree_bytes_at > state.tree_bytes_at // 16:
            tree = self.owner.cache._local_trees[state.req_id]  # no public accessor in 0.3.0
            state.tree_bytes, state.tree_bytes_at = int(tree.estimate_memory()), state.fed
        return state.tree_bytes
