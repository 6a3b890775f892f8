"""Tree verification against a real (tiny) target: the tree mask and depth positions give
each branch the logits of its own linear forward (sdpa, eager, sdpa_packed_gqa); the
accepted path's cache is what a linear forward leaves; crafted trees (shared prefixes,
both branches wrong, the second right, a branch reaching the block end) decode exactly
as plain greedy; and at T = 1 the recursive rejection over siblings follows the target's
distribution (chi-square), while a rule that skips the residual update is caught."""

import pytest
import torch

import dlite.target.attention  # noqa: F401  (registers sdpa_packed_gqa)
from dlite.decoding import tree as T
from dlite.decoding.decode import plain_generate, prefill, speculative_generate, target_forward
from dlite.decoding.oracle import RandomDrafter
from dlite.decoding.tree import Branch, branch_matches, build_tree
from tests.unit.test_spec_decode import _pvalues, tiny_target

PROMPT = [5, 17, 99, 3, 42, 8, 61]


@pytest.fixture(scope="module")
def target():
    return tiny_target()


def test_shared_prefixes_merge_into_one_trie():
    tree = build_tree(9, [Branch([1, 2, 3], None, "a"), Branch([1, 2, 4], None, "b"), Branch([5], None, "c")])
    assert tree.tokens == [9, 1, 2, 3, 4, 5] and tree.parent == [-1, 0, 1, 2, 2, 0]
    assert tree.depth == [0, 1, 2, 3, 3, 1] and tree.paths == [[1, 2, 3], [1, 2, 4], [5]]
    assert tree.size == 5
    assert branch_matches([Branch([1, 2, 3], None, "a"), Branch([1, 7], None, "b")], [1, 2, 8]) == [2, 1]


@pytest.mark.parametrize("attn", ["sdpa", "eager", "sdpa_packed_gqa"])
def test_tree_forward_matches_each_branch_alone_and_keeps_the_path(target, attn):
    target.config._attn_implementation = attn
    try:
        pre = prefill(target, PROMPT)
        branches = [Branch([1, 2, 3], None, "a"), Branch([1, 2, 9, 4], None, "b"), Branch([7, 8], None, "c")]
        tree = build_tree(11, branches)
        cache = pre.fresh_cache()
        logits = target_forward(target, torch.tensor(tree.tokens), pre.t, cache,
                                position_ids=T.tree_positions(tree, pre.t, "cpu"),
                                attention_mask=T.tree_mask(tree, pre.t, target.dtype, "cpu"))
        for br, path in zip(branches, tree.paths):
            alone = target_forward(target, torch.tensor([11] + br.tokens), pre.t, pre.fresh_cache())
            assert torch.allclose(logits[[0] + path], alone, atol=1e-4)
        T.keep_path(cache, pre.t, [0] + tree.paths[1][:3])  # anchor, 1, 2, 9
        linear = pre.fresh_cache()
        target_forward(target, torch.tensor([11, 1, 2, 9]), pre.t, linear)
        assert cache.get_seq_length() == linear.get_seq_length() == pre.t + 4
        for a, b in zip(cache.layers, linear.layers):
            assert torch.allclose(a.keys, b.keys, atol=1e-5) and torch.allclose(a.values, b.values, atol=1e-5)
    finally:
        target.config._attn_implementation = "sdpa"


class CraftedTrees:
    """Branches built from the plain greedy output `ref` by `mode`, per round:
    shared -- both right for 2 tokens, then only the second goes on right;
    both_wrong -- neither branch's first token is right;
    second -- the first branch wrong from its first token, the second right;
    to_end -- the second branch right for the whole block (gamma tokens)."""

    target_layer_ids, needs_history, gamma = [], False, 4

    def __init__(self, prompt, ref, mode):
        self.prompt, self.ref, self.mode, self.sources = list(prompt), ref, mode, []

    def new_state(self):
        return None

    def _truth(self, anchor_pos):
        i = anchor_pos - len(self.prompt)  # the anchor is output token i
        return (self.ref[i + 1: i + 1 + self.gamma] + [0] * self.gamma)[: self.gamma]

    def draft_tree(self, state, feats, anchor_id, anchor_pos, temperature, generator=None):
        t = self._truth(anchor_pos)
        wrong = [(x + 1) % 128 for x in t]
        first, second = {"shared": (t[:2] + wrong[2:], t[:3] + wrong[3:]),
                         "both_wrong": (wrong, [(x + 2) % 128 for x in t]),
                         "second": (wrong, t[:2] + wrong[2:]),
                         "to_end": (wrong[:2], t)}[self.mode]
        return [Branch(first, None, "first"), Branch(second, None, "second")], state

    def tree_verified(self, state, branches, emit):
        m = branch_matches(branches, emit)
        self.sources.append(m)
        return state, {"source": "second" if m[1] > m[0] else ("none" if not max(m) else "first")}

    def cache_bytes(self, state):
        return 0


@pytest.mark.parametrize("mode,accepted", [("shared", 3), ("both_wrong", 0), ("second", 2), ("to_end", 4)])
def test_crafted_trees_are_lossless(target, mode, accepted):
    ref, _ = plain_generate(target, PROMPT, 30)
    drafter = CraftedTrees(PROMPT, ref, mode)
    out, rounds = speculative_generate(target, drafter, PROMPT, 30)
    assert out == ref
    full = [r for r in rounds if r["context_len"] - len(PROMPT) + 1 + 4 <= len(ref)]  # truth known
    assert full and all(r["accepted"] == accepted for r in full)
    assert all(r["verified"] == {"shared": 6, "both_wrong": 8, "second": 8, "to_end": 6}[mode] for r in rounds)
    if accepted:
        assert all(r["source"] == "second" for r in full)


class TwoBranchSampler(RandomDrafter):
    """At T = 1: a deterministic branch (fixed tokens, one-hot q) beside a random
    drafter's sampled block, so siblings mix both kinds of candidate."""

    def draft_tree(self, state, feats, anchor_id, anchor_pos, temperature, generator=None):
        tokens, q, state = self.draft(state, feats, anchor_id, anchor_pos, temperature, generator)
        fixed = [(anchor_id + 1) % self.vocab, (anchor_id + 3) % self.vocab]
        return [Branch(fixed, None, "fixed"), Branch(tokens.tolist(), q, "model")], state

    def tree_verified(self, state, branches, emit):
        return state, {}


@pytest.mark.parametrize("skip_residual", [False, True])
def test_tree_sampling_follows_the_target_distribution(monkeypatch, skip_residual):
    vocab, prompt = 8, [1, 5, 2, 7]
    model = tiny_target(vocab=vocab, init=0.1, seed=3)
    drafter = TwoBranchSampler(model, gamma=2, target_layer_ids=[1], seed=1, scale=4.0)
    drafter.vocab = vocab
    if skip_residual:  # a rule that forgets to subtract a rejected candidate's q
        monkeypatch.setattr(T, "residual_distribution", lambda p, q: p)
    pvals = _pvalues(model, drafter, prompt, vocab)
    assert (min(pvals) < 1e-6) if skip_residual else (min(pvals) > 1e-3)
