"""Training-free drafting and early stopping: prompt lookup's proposals on crafted
contexts, the hybrid's choice per round, a learned drafter stopping its block early
(`draft_stop_prob`), each lossless in the real loop (greedy = plain) and exact at T = 1
(chi-square against the target's distribution; a wrong q is caught), and accept_at_k
counting only the slots a round actually drafted."""

import pytest
import torch
from omegaconf import OmegaConf

from dlite.config_schema import EvalConfig
from dlite.decoding import lookup
from dlite.decoding.decode import plain_generate, speculative_generate
from dlite.decoding.lookup import HybridDrafter, PromptLookupDrafter, lookup_proposal
from dlite.decoding.methods import method_builders
from dlite.decoding.metrics import accept_at_k
from dlite.decoding.oracle import TargetAsDrafter
from tests.unit.test_spec_decode import _pvalues, dlite_drafter, tiny_target

V = 128


def propose(ids, gamma=4, max_ngram=3, min_ngram=1, prefer="last"):
    return lookup_proposal(torch.tensor(ids), gamma, max_ngram, min_ngram, prefer)


def test_the_longest_earlier_ngram_is_continued():
    # "1 2 3" occurred before (then 8); "2 3" also at 1 (then 9): the 3-gram wins.
    assert propose([4, 2, 3, 9, 1, 2, 3, 8, 0, 1, 2, 3]) == ([8, 0, 1, 2], 3)
    assert propose([4, 2, 3, 9, 1, 2, 3, 8, 0, 1, 2, 3], max_ngram=2) == ([8, 0, 1, 2], 2)


def test_most_recent_or_first_occurrence():
    ids = [1, 2, 7, 1, 2, 8, 5, 1, 2]
    assert propose(ids, max_ngram=2) == ([8, 5, 1, 2], 2)
    assert propose(ids, max_ngram=2, prefer="first") == ([7, 1, 2, 8], 2)


def test_no_match_and_short_continuations():
    assert propose([1, 2, 3, 4]) == ([], 0)
    assert propose([1, 2, 3, 1], min_ngram=2) == ([], 0)  # only a 1-gram repeats
    assert propose([1, 2, 3, 1]) == ([2, 3, 1], 1)  # continuation stops at the end
    assert propose([5, 6, 5, 6], gamma=7) == ([5, 6], 2)  # a repeat may overlap the suffix
    assert propose([7]) == ([], 0)


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="min_ngram"):
        PromptLookupDrafter([1, 2], V, max_ngram=1, min_ngram=2)
    with pytest.raises(ValueError, match="prefer"):
        PromptLookupDrafter([1, 2], V, prefer="best")


@pytest.fixture(scope="module")
def target():
    return tiny_target(vocab=V)


REPEAT = [5, 17, 99, 3, 42, 8, 61, 7, 5, 17, 99, 3, 42, 8, 61, 7, 5, 17, 99]


def test_prompt_lookup_is_lossless_and_drafts_from_the_context(target):
    ref, _ = plain_generate(target, REPEAT, 40)
    drafter = PromptLookupDrafter(REPEAT, V, gamma=5, max_ngram=3)
    out, rounds = speculative_generate(target, drafter, REPEAT, 40)
    assert out == ref
    assert all(0 <= r["accepted"] <= r["drafted"] <= 5 for r in rounds)
    assert any(r["drafted"] > 0 for r in rounds) and sum(r["emitted"] for r in rounds) == len(out) - 1
    # A self-repeating output: lookup finds it and the target agrees with some of it.
    assert any(r["accepted"] > 0 for r in rounds) or len(set(ref)) == len(ref)


def test_hybrid_takes_lookup_on_long_matches_and_the_drafter_otherwise(target):
    model = dlite_drafter(target, list(range(V)), gamma=4)
    ref, _ = plain_generate(target, REPEAT, 30)
    for min_match in (1, 3):
        hybrid = HybridDrafter(model, PromptLookupDrafter(REPEAT, V, gamma=4, max_ngram=3), min_match)
        out, _ = speculative_generate(target, hybrid, REPEAT, 30)
        assert out == ref
    feats = torch.zeros(1, model.feature_dim)
    # Anchor 3 after "... 17 99": "17 99 3" occurred before (then 42 8 61 7): a 3-gram.
    hybrid = HybridDrafter(model, PromptLookupDrafter(REPEAT, V, gamma=4, max_ngram=3), 3)
    tokens, _, state = hybrid.draft(hybrid.new_state(), feats, 3, len(REPEAT), 0.0)
    assert state["source"] == ["lookup"] and tokens.tolist() == [42, 8, 61, 7]
    # Anchor 42 after "... 17 99": only "42" repeats (a 1-gram): the drafter's block.
    tokens, _, state = hybrid.draft(hybrid.new_state(), feats, 42, len(REPEAT), 0.0)
    assert state["source"] == ["model"] and tokens.numel() == 4
    with pytest.raises(ValueError, match="history-free"):
        HybridDrafter(TargetAsDrafter(target, REPEAT), PromptLookupDrafter(REPEAT, V), 2)


def test_hybrid_falls_back_to_the_drafter_without_a_match(target):
    model = dlite_drafter(target, list(range(V)), gamma=4)
    prompt = [1, 2, 3, 4, 5]
    hybrid = HybridDrafter(model, PromptLookupDrafter(prompt, V, gamma=4), 2)
    feats = torch.zeros(1, model.feature_dim)
    tokens, _, state = hybrid.draft(hybrid.new_state(), feats, 9, len(prompt), 0.0)
    assert state["source"] == ["model"] and tokens.numel() == 4


@pytest.mark.parametrize("stop_prob", [0.0, 0.5, 0.999999])
def test_a_drafter_stopping_early_stays_lossless(target, stop_prob):
    drafter = dlite_drafter(target, list(range(0, 120, 3)))
    drafter.draft_stop_prob = stop_prob
    ref, _ = plain_generate(target, REPEAT, 30)
    out, rounds = speculative_generate(target, drafter, REPEAT, 30)
    assert out == ref
    drafted = {r["drafted"] for r in rounds}
    if stop_prob == 0:
        assert drafted == {drafter.gamma}
    elif stop_prob > 0.99:  # a random drafter is never that sure: every round is a plain step
        assert drafted == {0} and all(r["accepted"] == 0 for r in rounds)
    else:
        assert max(drafted) <= drafter.gamma and min(drafted) < drafter.gamma


@pytest.mark.parametrize("wrong_q", [False, True])
def test_prompt_lookup_sampling_is_exact(monkeypatch, wrong_q):
    """One-hot q for a deterministic proposal keeps sampling exact; a uniform q (what a
    careless implementation might report) is caught."""
    vocab, prompt = 8, [1, 5, 2, 7, 1, 5, 2, 7, 1, 5]
    model = tiny_target(vocab=vocab, init=0.1, seed=3)
    if wrong_q:
        monkeypatch.setattr(lookup, "token_block",
                            lambda p, v, temp: (torch.tensor(p, dtype=torch.long), torch.full((len(p), v), 1.0 / v)))
    pvals = _pvalues(model, PromptLookupDrafter(prompt, vocab, gamma=2, max_ngram=2), prompt, vocab)
    assert (min(pvals) < 1e-3) if wrong_q else (min(pvals) > 1e-3)


def test_early_stopping_sampling_is_exact():
    vocab, prompt = 8, [1, 5, 2, 7]
    model = tiny_target(vocab=vocab, init=0.1, seed=3)
    drafter = dlite_drafter(model, [0, 2, 3, 5, 6], gamma=2, layers=(1,), seed=1)
    drafter.draft_stop_prob = 0.3
    assert min(_pvalues(model, drafter, prompt, vocab)) > 1e-3


def test_accept_at_k_counts_only_drafted_slots():
    rounds = [dict(accepted=2, drafted=2), dict(accepted=0, drafted=3), dict(accepted=1, drafted=3)]
    # slot 1 reached by all 3 (2 accept); slot 2 by rounds 1 and 3 (1 accepts);
    # slot 3 by none (round 1 drafted only 2, round 3 stopped at slot 2).
    assert accept_at_k(rounds, 3) == [2 / 3, 1 / 2, None]


def test_method_builders_order_and_refusals(target):
    ev = OmegaConf.structured(EvalConfig(baselines=["prompt_lookup"], hybrids=["hybrid_lookup"],
                                         draft_stop_prob=0.4))
    model = dlite_drafter(target, list(range(V)), gamma=4)
    builders = method_builders(ev, {"dlite": model}, V)
    assert list(builders) == ["dlite", "prompt_lookup", "hybrid_lookup"]
    assert builders["dlite"]() is model and model.draft_stop_prob == 0.4  # eval's setting
    lk = builders["prompt_lookup"]()(REPEAT)
    assert isinstance(lk, PromptLookupDrafter) and lk.gamma == 4  # the primary drafter's gamma
    assert isinstance(builders["hybrid_lookup"]()(REPEAT), HybridDrafter)
    with pytest.raises(ValueError, match="learned drafter"):
        method_builders(ev, {}, V)


def test_lookup_check_runs_both_loops_on_the_same_turns(target):
    """The cross-check against transformers' prompt lookup: the four outputs (HF plain
    and lookup, ours plain and lookup) are the same greedy text, and each speedup is
    the ratio of the times it reports."""
    from dlite.bench.lookup_check import run
    rep = run(target, [REPEAT, REPEAT[3:]], eos=(127,), max_new_tokens=12, num_tokens=4, ngram=2)
    assert rep["outputs_agree"] is True and [t["context_len"] for t in rep["turns"]] == [19, 16]
    s = rep["seconds"]
    assert rep["speedup_hf_prompt_lookup"] == pytest.approx(s["hf_plain"] / s["hf_lookup"])
    assert rep["speedup_ours_prompt_lookup"] == pytest.approx(s["ours_plain"] / s["ours_lookup"])
