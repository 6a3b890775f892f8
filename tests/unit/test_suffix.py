"""SuffixDecoding drafter (arctic-inference, installed by scripts/setup.sh): proposals
on crafted token contexts (a repeated span, no match, an earlier request's response
through the global tree and not without it), the trees receive exactly the emitted
tokens whatever a round accepts, and the real decoding loop stays lossless (greedy
equals plain decoding, with drafts accepted) and runs at T = 1 with one-hot q."""

import pytest
import torch

from dlite.decoding.decode import plain_generate, speculative_generate
from dlite.decoding.suffix import SuffixDecoding
from tests.unit.test_spec_decode import tiny_target

V = 128


def propose_once(factory, prompt, anchor):
    """One draft call on a fresh request: the prompt, then `anchor` at its end."""
    drafter = factory(prompt)
    state = drafter.new_state()
    return drafter.propose(state, anchor, len(prompt))


def test_repeated_span_is_proposed_up_to_match_len_and_gamma():
    prompt = [5, 10, 11, 12, 13, 14, 15, 6, 7, 10, 11]
    # Context ends 7,10,11,12 and the earlier copy is preceded by 5: match of 3,
    # and max_spec_factor 1.0 allows 3 tokens.
    assert propose_once(SuffixDecoding(V), prompt, 12) == ([13, 14, 15], 3)
    assert propose_once(SuffixDecoding(V, gamma=2, max_spec_factor=4.0), prompt, 12)[0] == [13, 14]
    # A span seen once scores 1/2 (the request's own tail counts): above that, no draft.
    assert propose_once(SuffixDecoding(V, min_token_prob=0.6), prompt, 12)[0] == []


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_no_match_gives_an_empty_draft(temperature):
    drafter = SuffixDecoding(V)([1, 2, 3, 4])
    tokens, probs, state = drafter.draft(drafter.new_state(), None, 9, 4, temperature)
    assert tokens.dtype == torch.long and tokens.numel() == 0
    assert probs is None if temperature == 0 else probs.shape == (0, V)


def emit_one_by_one(factory, prompt, response):
    """Decode `response` with every draft rejected, so each token reaches the trees."""
    drafter = factory(prompt)
    state = drafter.new_state()
    for k, tok in enumerate(response):
        drafter.draft(state, None, tok, len(prompt) + k, 0.0)


@pytest.mark.parametrize("global_tree", [True, False])
def test_earlier_response_is_proposed_only_through_the_global_tree(global_tree):
    factory = SuffixDecoding(V, global_tree=global_tree)
    emit_one_by_one(factory, [100, 101, 102], [40, 41, 42, 43, 44, 45, 46])
    proposal, n = propose_once(factory, [7, 8, 9, 40, 41], 42)
    assert proposal == ([43, 44, 45] if global_tree else [])
    assert n == 3 or not global_tree


class FedTokens:
    """Records what reaches add_active_response, then calls through to it."""

    def __init__(self, cache):
        self.tokens, self._add = [], cache.add_active_response
        cache.add_active_response = self

    def __call__(self, req_id, token_ids):
        self.tokens += list(token_ids)
        self._add(req_id, token_ids)


def successor(tok, shift=1):
    return 20 + (tok - 20 + shift) % 16


def test_trees_receive_exactly_the_emitted_tokens_for_any_acceptance():
    factory = SuffixDecoding(V, gamma=5, max_spec_factor=4.0)
    prompt = list(range(20, 36)) * 3
    drafter = factory(prompt)
    fed = FedTokens(factory.cache)
    state, seq, anchor = drafter.new_state(), list(prompt), 20
    seen = set()
    for r in range(18):
        pos = len(seq)
        tokens, _, state = drafter.draft(state, None, anchor, pos, 0.0)
        draft = tokens.tolist()
        assert state.ids == seq and fed.tokens == seq[len(prompt):] + [anchor]
        a = [len(draft), 0, len(draft) // 2][r % 3]  # accept all, none, part
        seen.add("all" if a == len(draft) else "none" if a == 0 else "part")
        seq += [anchor] + draft[:a]
        # The bonus token: the draft's own next token would have been accepted.
        anchor = successor(seq[-1]) if a == len(draft) else successor(draft[a], 3)
    assert seen == {"all", "none", "part"} and len(seq) > len(prompt) + 30


@pytest.fixture(scope="module")
def target():
    return tiny_target(vocab=V)


PROMPT = [5, 17, 99, 3, 42, 8, 61, 5, 17, 99, 3]


def test_greedy_is_lossless_and_drafts_get_accepted(target):
    plain, _ = plain_generate(target, PROMPT, 40)
    factory = SuffixDecoding(V, gamma=4)
    for run in range(2):  # the 2nd run drafts from the 1st response in the global tree
        out, rounds = speculative_generate(target, factory(PROMPT), PROMPT, 40)
        assert out == plain, f"run {run}"
        assert all(r["drafted"] <= 4 and r["cache_bytes"] > 0 for r in rounds)
    assert max(r["accepted"] for r in rounds) >= 1
    assert sum(r["accepted"] for r in rounds) >= 20


def test_sampling_with_one_hot_q_completes(target):
    factory = SuffixDecoding(V, gamma=4)
    speculative_generate(target, factory(PROMPT), PROMPT, 30)  # fills the global tree
    out, rounds = speculative_generate(target, factory(PROMPT), PROMPT, 30, temperature=1.0,
                                       generator=torch.Generator().manual_seed(0))
    assert len(out) == 30 and all(0 <= t < V for t in out)
    assert any(r["drafted"] > 0 for r in rounds)
