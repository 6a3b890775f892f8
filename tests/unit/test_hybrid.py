"""The choose and tree hybrids (`dlite.decoding.hybrid`) over a real tiny target: lossless
under greedy with prompt lookup and with SuffixDecoding (its own multi-branch trees
too), exact at T = 1 (chi-square), the choice following the calibrated value per unit
of verification cost, the tree within its budget; the calibration's fit and cost curve;
and the early-stop rule keeping a draw's distribution (no selection on the draw)."""

import math

import pytest
import torch
from omegaconf import OmegaConf

from dlite.config_schema import EvalConfig
from dlite.decoding.calibration import (AGREE_FLOOR, BinnedMap, Calibration, CostCurve, CostTable, Judge,
                                        expected_accepted, fit, observations)
from dlite.decoding.decode import plain_generate, speculative_generate
from dlite.decoding.hybrid import ChooseHybrid, TreeHybrid
from dlite.decoding.lookup import PromptLookupDrafter
from dlite.decoding.methods import method_builders
from dlite.decoding.suffix import SuffixDecoding, tree_paths
from dlite.decoding.tree import Branch
from dlite.models.common import recording_confidences, sample_block
from tests.unit.test_lookup import REPEAT, V

TRAJ_IDS = [1, 2, 3]  # any prompt: building a drafter reads nothing from it
from tests.unit.test_spec_decode import TRAJ, _pvalues, dlite_drafter, tiny_target, tokenizer  # noqa: F401  (fixture)


@pytest.fixture(scope="module")
def target():
    return tiny_target(vocab=V)


@pytest.fixture(scope="module")
def model(target):
    return dlite_drafter(target, list(range(V)), gamma=4)


def _lookup(prompt, vocab=V, gamma=4):
    return PromptLookupDrafter(prompt, vocab, gamma=gamma, max_ngram=3)


def test_cost_curve_and_expected_length():
    c = CostCurve()
    assert c(1) == 1.0 and c(3) == pytest.approx(1.5) and c(8) == 2.2 and c(12) == pytest.approx(2.8)
    assert expected_accepted([0.5, 0.5]) == [0.0, 0.5, 0.75]
    assert c.best_prefix([0.05, 0.05])[0] == 0  # nothing worth a bigger verification
    assert c.best_prefix([0.95] * 7)[0] == 7


def test_calibration_fit_is_monotone_and_round_trips():
    recs = [{"source": "model", "feats": [0.95, 0.9, 0.2], "matched": 2},
            {"source": "model", "feats": [0.15, 0.95], "matched": 0},
            {"source": "lookup", "feats": [3.0] * 4, "matched": 4}]
    obs = observations(recs)
    # the first record: slots 0, 1 accepted, slot 2 its miss; the second: slot 0 missed.
    assert obs["model"] == [(0.95, True, 0), (0.9, True, 1), (0.2, False, 2), (0.15, False, 0)]
    assert len(obs["lookup"]) == 4
    cal = fit(recs * 20)
    p = cal.maps["model"].p
    assert all(a <= b for a, b in zip(p, p[1:])) and cal.prob("model", 0.95) > 0.9 > cal.prob("model", 0.15)
    again = Calibration.from_dict(cal.to_dict())
    assert again.prob("lookup", 3) == pytest.approx(cal.prob("lookup", 3), abs=1e-4)
    assert Calibration().prob("lookup", 1) == 0.5  # default: n / (n + 1)


def test_calibration_conditions_on_the_slot_depth():
    """A copy that is right at its first slot goes on being right: slot 0 holds half the
    time, later slots (given the ones before held) nearly always. The pooled map says
    ~0.7 everywhere; the depth maps say so per slot, and survive a round trip."""
    recs = ([{"source": "lookup", "feats": [2.0] * 6, "matched": 6}] * 30
            + [{"source": "lookup", "feats": [2.0] * 6, "matched": 0}] * 30)
    cal = fit(recs)
    p = cal.slot_probs("lookup", [2.0] * 6)
    assert p[0] < 0.55 and min(p[1:]) > 0.9
    pooled = cal.prob("lookup", 2.0)
    assert p[0] < pooled < p[1]
    again = Calibration.from_dict(cal.to_dict())
    assert again.slot_probs("lookup", [2.0] * 6) == pytest.approx(p, abs=1e-4)
    # The expected accepted length follows: the pooled map would cut this copy short.
    assert CostCurve().best_prefix(p)[0] == 6
    # A depth bin without observations stays at the pooled estimate.
    sparse = fit([{"source": "model", "feats": [0.95], "matched": 1}] * 10)
    assert sparse.prob("model", 0.95, 5) == pytest.approx(sparse.prob("model", 0.95))
    bad = {**cal.to_dict(), "depth_edges": [1, 3]}
    with pytest.raises(ValueError, match="refit"):
        Calibration.from_dict(bad)


def test_calibration_judges_a_first_slot_by_the_learned_drafter():
    """Half of these lookup blocks are right: the ones whose first token the learned
    drafter believed. The match length cannot tell them apart; the judge does, at slot
    0 only, and survives a round trip. Without an agreement (the drafter did not run),
    slot 0 keeps its map by depth."""
    recs = ([{"source": "lookup", "feats": [2.0] * 4, "matched": 4, "agree": 0.8}] * 30
            + [{"source": "lookup", "feats": [2.0] * 4, "matched": 0, "agree": 0.02}] * 30
            + [{"source": "model", "feats": [0.9] * 4, "matched": 1}] * 5)
    cal = fit(recs)
    assert cal.judged("lookup") and not cal.judged("model") and cal.fitted_on["judged"] == {"lookup": 60}
    believed, doubted = cal.prob("lookup", 2.0, 0, agree=0.8), cal.prob("lookup", 2.0, 0, agree=0.02)
    assert believed > 0.85 and doubted < 0.15 and doubted < cal.prob("lookup", 2.0, 0) < believed
    assert cal.slot_probs("lookup", [2.0] * 4, 0.02)[1:] == cal.slot_probs("lookup", [2.0] * 4)[1:]
    again = Calibration.from_dict(cal.to_dict())
    assert again.prob("lookup", 2.0, 0, agree=0.02) == pytest.approx(doubted, abs=1e-4)
    # Few judged blocks: the judge stays near the map (shrunk toward "unchanged").
    few = fit(recs[:1] + recs[30:31])
    assert abs(few.prob("lookup", 2.0, 0, agree=0.8) - few.prob("lookup", 2.0, 0)) < 0.15
    assert Judge()(0.7, 0.01) == pytest.approx(0.7) and Judge()(0.7, 0.9) == pytest.approx(0.7)
    assert not fit([{**recs[0], "agree": None}]).judged("lookup")


def _judged(believed: float, doubted: float, rated: float = 0.6) -> Calibration:
    """Lookup rated `rated` a slot on its match alone (0.6: a fair proposal, not a strong
    one), and at slot 0 judged `believed` when the learned drafter gives its first token
    1, `doubted` when it gives it nothing, log-linear in between."""
    sure = BinnedMap((2, 3, 4, 5, 6, 8), [rated] * 7, [0] * 7)
    lo, hi = (math.log(p / (1 - p)) for p in (doubted, believed))
    w2 = (hi - lo) / -math.log(AGREE_FLOOR)
    return Calibration({"lookup": sure, "model": BinnedMap((0.5,), [0.3, 0.3], [0, 0])},
                       judges={"lookup": Judge((hi, 0.0, w2))})


def test_the_choice_asks_the_learned_drafter_about_a_copy(model):
    """Lookup's block [42, 8, 61, 7] is a fair proposal by its match. Judged by the
    drafter, whatever its first distribution gives 42: the block is verified where the
    judge trusts it, dropped for the drafter's own block or a plain step where it does
    not; either way the drafter ran to judge it, and the branch carries the
    probability it was judged by. A strong copy is not judged: the drafter, not worth
    its draft time beside it, does not run."""
    feats = torch.zeros(1, model.feature_dim)
    with recording_confidences() as conf:
        model.draft(model.new_state(), feats, 3, len(REPEAT), 0.0)
    p42 = float(conf.first[42])
    assert conf.first.shape == (V,) and float(conf.first.sum()) == pytest.approx(1.0, abs=1e-4)
    trusted = _judged(0.99, 0.99)
    hybrid = ChooseHybrid(model, _lookup(REPEAT), trusted)
    tokens, _, state = hybrid.draft(hybrid.new_state(), feats, 3, len(REPEAT), 0.0)
    assert state["source"] == ["lookup"] and tokens.tolist() == [42, 8, 61] and state["ran"]  # a prefix worth it
    hybrid = ChooseHybrid(model, _lookup(REPEAT), _judged(0.01, 0.01))
    tokens, _, state = hybrid.draft(hybrid.new_state(), feats, 3, len(REPEAT), 0.0)
    assert state["source"] in (["model"], ["none"]) and state["ran"]
    tree = TreeHybrid(model, _lookup(REPEAT), trusted)
    branches, _ = tree.draft_tree(tree.new_state(), feats, 3, len(REPEAT), 0.0)
    looked = [b for b in branches if b.source == "lookup"]
    assert looked and looked[0].agree == pytest.approx(p42)
    hybrid = ChooseHybrid(model, _lookup(REPEAT), _judged(0.01, 0.01, rated=0.99))
    tokens, _, state = hybrid.draft(hybrid.new_state(), feats, 3, len(REPEAT), 0.0)
    assert state["source"] == ["lookup"] and tokens.tolist() == [42, 8, 61, 7] and not state["ran"]


@pytest.mark.parametrize("kind", ["choose", "tree"])
def test_hybrids_are_lossless_with_prompt_lookup(target, model, kind):
    ref, _ = plain_generate(target, REPEAT, 30)
    make = ChooseHybrid if kind == "choose" else TreeHybrid
    out, rounds = speculative_generate(target, make(model, _lookup(REPEAT)), REPEAT, 30)
    assert out == ref
    assert {r["source"] for r in rounds} <= {"lookup", "model", "none", "shared"}
    if kind == "tree":
        assert all(r["verified"] <= 16 and r["branches"] is not None for r in rounds)
        # A random drafter is never sure of itself: with the default (identity) map its
        # nodes are not worth their cost; rated high (and the rating kept, whatever
        # this request shows of it) and verification priced flat (a disagreeing sibling
        # keeps only what the surer one leaves), both branches are verified.
        assert not any(b["source"] == "model" for r in rounds for b in r["branches"])
        rated = Calibration({"model": BinnedMap((0.0,), [0.9, 0.9], [0, 0])})
        tree = TreeHybrid(model, _lookup(REPEAT), rated, CostCurve((1,), (1.0,)), online_prior=None)
        out, rounds = speculative_generate(target, tree, REPEAT, 30)
        assert out == ref and any(len(r["branches"]) == 2 for r in rounds)
    # Judged by the learned drafter (which then runs whenever lookup proposes): lossless.
    for judged in (_judged(0.99, 0.5), _judged(0.5, 0.01)):
        out, rounds = speculative_generate(target, make(model, _lookup(REPEAT), judged), REPEAT, 30)
        assert out == ref


@pytest.mark.parametrize("kind", ["choose", "tree"])
def test_hybrids_are_lossless_with_suffix_decoding(target, model, kind):
    ref, _ = plain_generate(target, REPEAT, 30)
    make = ChooseHybrid if kind == "choose" else TreeHybrid
    drafter = make(model, SuffixDecoding(V, gamma=4)(REPEAT))
    out, rounds = speculative_generate(target, drafter, REPEAT, 30)
    assert out == ref and any(r["source"] in ("suffix", "shared") for r in rounds)


@pytest.mark.parametrize("kind", ["choose", "tree"])
def test_hybrids_with_both_token_drafters_are_lossless(target, model, kind):
    """Prompt lookup and SuffixDecoding beside the learned drafter: every round's
    proposals come from any of the three, the output is plain greedy's."""
    ref, _ = plain_generate(target, REPEAT, 30)
    make = ChooseHybrid if kind == "choose" else TreeHybrid
    drafter = make(model, [_lookup(REPEAT), SuffixDecoding(V, gamma=4)(REPEAT)])
    out, rounds = speculative_generate(target, drafter, REPEAT, 30)
    assert out == ref
    assert {r["source"] for r in rounds} <= {"lookup", "suffix", "model", "none", "shared"}
    if kind == "tree":
        assert {"lookup", "suffix"} <= {b["source"] for r in rounds for b in r["branches"]}
    with pytest.raises(ValueError, match="one token drafter per source"):
        make(model, [_lookup(REPEAT), _lookup(REPEAT)])


def test_the_choice_takes_the_best_of_several_token_drafters(model):
    """Two token proposals: the one the calibration rates higher is verified; with both
    rated low and the learned drafter high, the learned drafter's block."""
    feats = torch.zeros(1, model.feature_dim)
    sx = SuffixDecoding(V, gamma=4)
    lookup_first = Calibration({"lookup": BinnedMap((2,), [0.99, 0.99], [0, 0]),
                                "suffix": BinnedMap((0.5,), [0.01, 0.01], [0, 0]),
                                "model": BinnedMap((0.5,), [0.01, 0.01], [0, 0])})
    hybrid = ChooseHybrid(model, [_lookup(REPEAT), sx(REPEAT)], lookup_first)
    tokens, _, state = hybrid.draft(hybrid.new_state(), feats, 3, len(REPEAT), 0.0)
    assert state["source"] == ["lookup"] and tokens.tolist() == [42, 8, 61, 7]
    suffix_first = Calibration({"lookup": BinnedMap((2,), [0.01, 0.01], [0, 0]),
                                "suffix": BinnedMap((0.5,), [0.99, 0.99], [0, 0]),
                                "model": BinnedMap((0.5,), [0.01, 0.01], [0, 0])})
    hybrid = ChooseHybrid(model, [_lookup(REPEAT), sx(REPEAT)], suffix_first)
    tokens, _, state = hybrid.draft(hybrid.new_state(), feats, 3, len(REPEAT), 0.0)
    assert state["source"] == ["suffix"] and tokens.numel() > 0
    model_first = Calibration({"lookup": BinnedMap((2,), [0.01, 0.01], [0, 0]),
                               "suffix": BinnedMap((0.5,), [0.01, 0.01], [0, 0]),
                               "model": BinnedMap((0.0,), [0.99, 0.99], [0, 0])})
    hybrid = ChooseHybrid(model, [_lookup(REPEAT), sx(REPEAT)], model_first)
    _, _, state = hybrid.draft(hybrid.new_state(), feats, 3, len(REPEAT), 0.0)
    assert state["source"] == ["model"]


def test_the_choice_follows_the_calibration(model):
    feats = torch.zeros(1, model.feature_dim)
    sure = Calibration({"lookup": BinnedMap((2, 3, 4, 5, 6, 8), [0.99] * 7, [0] * 7),
                        "model": BinnedMap((0.5,), [0.01, 0.02], [0, 0])})
    hybrid = ChooseHybrid(model, _lookup(REPEAT), sure)
    tokens, _, state = hybrid.draft(hybrid.new_state(), feats, 3, len(REPEAT), 0.0)
    assert state["source"] == ["lookup"] and tokens.tolist() == [42, 8, 61, 7]
    doubt = Calibration({"lookup": BinnedMap((2,), [0.01, 0.01], [0, 0]),
                         "model": BinnedMap((0.0,), [0.99, 0.99], [0, 0])})
    hybrid = ChooseHybrid(model, _lookup(REPEAT), doubt)
    tokens, _, state = hybrid.draft(hybrid.new_state(), feats, 3, len(REPEAT), 0.0)
    assert state["source"] == ["model"] and tokens.numel() == 4


def test_the_tree_keeps_the_most_valuable_nodes_within_its_budget(target, model):
    ref, _ = plain_generate(target, REPEAT, 20)
    for budget in (1, 3):
        out, rounds = speculative_generate(target, TreeHybrid(model, _lookup(REPEAT), budget=budget), REPEAT, 20)
        assert out == ref and max(r["verified"] for r in rounds) <= budget


def test_suffix_trees_become_paths():
    # 4 -> 5 -> {9, 8}, 4 -> 6 -> 7 (arctic-inference's shape: parents, path probabilities)
    paths = tree_paths([4, 5, 6, 9, 8, 7], [-1, 0, 0, 1, 1, 2], [0.75, 0.5, 0.25, 0.25, 0.25, 0.25], 7)
    assert [p for p, _ in paths] == [[4, 5, 9], [4, 5, 8], [4, 6, 7]]
    assert paths[0][1] == pytest.approx([0.75, 0.5 / 0.75, 0.5])
    assert [p for p, _ in tree_paths([4, 5, 6, 9, 8, 7], [-1, 0, 0, 1, 1, 2], [0.75] + [0.25] * 5, 2)] == [[4, 5], [4, 6]]


@pytest.mark.parametrize("kind", ["choose", "tree"])
@pytest.mark.parametrize("tokens", ["lookup", "lookup+suffix"])
def test_hybrids_sample_exactly(kind, tokens):
    vocab, prompt = 8, [1, 5, 2, 7, 1, 5, 2, 7, 1, 5]
    tm = tiny_target(vocab=vocab, init=0.1, seed=3)
    drafter_model = dlite_drafter(tm, list(range(vocab)), gamma=2, layers=(1,), seed=1)
    make = ChooseHybrid if kind == "choose" else TreeHybrid

    def token_drafters():
        lk = _lookup(prompt, vocab, gamma=2)
        return lk if tokens == "lookup" else [lk, SuffixDecoding(vocab, gamma=2)(prompt)]
    # Rated so that lookup wins on its longest matches and the drafter otherwise (the
    # tree then holds both): every kind of candidate is exercised.
    # The online factor is on in the chi-square run (it reads past rounds only); the
    # run that checks coverage keeps the rating fixed, since this drafter does well
    # enough on an 8-token vocabulary to push lookup out once it has been seen.
    rated = Calibration({"model": BinnedMap((0.0,), [0.55, 0.55], [0, 0])})
    hybrid = make(drafter_model, token_drafters(), rated)
    assert min(_pvalues(tm, hybrid, prompt, vocab)) > 1e-3
    # Token proposals judged by the drafter's first distribution (fixed before its draw):
    # which block is verified depends on it, and sampling stays exact.
    judged = Calibration(rated.maps, judges={s: Judge((1.0, 0.5, 0.5)) for s in ("lookup", "suffix")})
    assert min(_pvalues(tm, make(drafter_model, token_drafters(), judged), prompt, vocab)) > 1e-3
    _, rounds = speculative_generate(tm, make(drafter_model, token_drafters(), rated, online_prior=None), prompt, 12,
                                     temperature=1.0, generator=torch.Generator().manual_seed(0))
    used = {b["source"] for r in rounds for b in r["branches"]} if kind == "tree" else {r["source"] for r in rounds}
    assert "model" in used and used & {"lookup", "suffix"}


def test_early_stop_never_selects_on_the_draw(model):
    """q = [0.9, 0.1] at every slot, stop_prob 0.5: the first slot is always kept, so
    its token follows q (a rule reading the draw itself would never keep the 0.1 one)."""
    logits = torch.full((V,), -1e4)
    logits[[3, 4]] = torch.log(torch.tensor([0.9, 0.1]))
    g = torch.Generator().manual_seed(0)
    firsts = [int(sample_block(lambda k, prev, s: (logits, s), 4, 1, 1.0, "cpu", model.vocab, g, 0.5)[0][0])
              for _ in range(2000)]
    assert 0.07 < firsts.count(4) / 2000 < 0.13


def test_method_builders_make_the_new_rows(model):
    ev = OmegaConf.structured(EvalConfig(hybrids=["hybrid_lookup_choose", "hybrid_lookup_tree", "hybrid_lookup",
                                                  "hybrid_lookup_suffix_choose", "hybrid_lookup_suffix_tree"]))
    builders = method_builders(ev, {"dlite": model}, V, Calibration().to_dict())
    assert isinstance(builders["hybrid_lookup_choose"]()(REPEAT), ChooseHybrid)
    tree = builders["hybrid_lookup_tree"]()(REPEAT)
    assert isinstance(tree, TreeHybrid) and tree.budget == ev.tree_budget
    both = builders["hybrid_lookup_suffix_tree"]()
    assert hasattr(both, "fork")  # the suffix cache's global tree can be forked for a warm-up
    assert [type(lk).__name__ for lk in both(REPEAT).lookups] == ["PromptLookupDrafter", "SuffixDrafter"]
    assert isinstance(builders["hybrid_lookup_suffix_choose"]()(REPEAT), ChooseHybrid)


def test_hybrids_propose_up_to_their_own_gamma(model):
    """eval.hybrid_gamma lengthens the token drafters inside hybrids only (a hybrid
    verifies the prefix worth its cost); alone they keep eval.lookup_gamma, and with no
    hybrid_gamma both are the same. The calibration observes the hybrids' length."""
    from dlite.decoding.calibrate import calibration_builders
    names = ["hybrid_lookup_suffix_choose", "hybrid_lookup_suffix_tree", "hybrid_lookup"]
    ev = OmegaConf.structured(EvalConfig(baselines=["prompt_lookup", "suffix"], hybrids=names,
                                         lookup_gamma=5, hybrid_gamma=16))
    builders = method_builders(ev, {"dlite": model}, V, Calibration().to_dict())
    assert builders["prompt_lookup"]()(REPEAT).gamma == 5 and builders["suffix"]()(REPEAT).gamma == 5
    for name in names[:2]:
        assert [lk.gamma for lk in builders[name]()(REPEAT).lookups] == [16, 16]
    assert builders["hybrid_lookup"]()(REPEAT).lookup.gamma == 16
    calib = calibration_builders(ev, model, V)["calib_prompt_lookup"]()(REPEAT)
    assert [lk.gamma for lk in calib.lookups] == [16]
    same = method_builders(OmegaConf.structured(EvalConfig(hybrids=names[:1], baselines=["prompt_lookup"])),
                           {"dlite": model}, V, Calibration().to_dict())
    assert same["prompt_lookup"]()(REPEAT).gamma == model.gamma
    assert [lk.gamma for lk in same[names[0]]()(REPEAT).lookups] == [model.gamma] * 2


def test_hybrid_gamma_unset_keeps_finished_evaluations_reusable():
    """Added after evaluate stages were hashed: null hashes as a config without the key."""
    from dlite.config import load_config
    from pipelines.orchestration import dag
    cfg = load_config(None, [])
    d = dag.BY_NAME["evaluate"]
    before = OmegaConf.to_container(cfg, resolve=True)
    del before["eval"]["hybrid_gamma"]
    old = dag._stage_hash(OmegaConf.create(before), d, {}, "t")
    assert dag._stage_hash(cfg, d, {}, "t") == old
    assert dag._stage_hash(OmegaConf.merge(cfg, {"eval": {"hybrid_gamma": 16}}), d, {}, "t") != old


def test_calibration_fits_on_replayed_turns_and_feeds_the_report(tokenizer):
    """On a real replay: the unpruned tree's rounds give observations for both
    proposers, the fit is saved as a dict, and a report's hybrid rows carry the source
    of each round and (trees) each branch alone."""
    from dlite.decoding.calibrate import branch_records, calibration_builders, fit_calibration
    from dlite.decoding.replay import aggregate, replay_methods
    tm = tiny_target(vocab=len(tokenizer))
    drafter = dlite_drafter(tm, list(range(len(tokenizer))), gamma=4)
    ev = OmegaConf.structured(EvalConfig(max_new_tokens=8, hybrids=["hybrid_lookup_tree", "hybrid_lookup_choose"],
                                         cost_contexts=[64, 256]))
    assert list(calibration_builders(ev, drafter, len(tokenizer))) == ["calib_prompt_lookup"]
    cal = fit_calibration(tm, tokenizer, ev, drafter, len(tokenizer), [TRAJ])
    assert cal["fitted_on"]["records"] == ["t1"] and cal["fitted_on"]["slots"]["model"] > 0
    assert len(cal["typical"]["model"]) == 4 and set(cal["typical"]) == set(cal["by_depth"])
    # Priced by the configured CPU curve (the tiny target's measured one is nearly flat:
    # there, verifying one more token costs next to nothing, so even a poor one pays).
    builders = method_builders(ev, {"dlite": drafter}, len(tokenizer), {**cal, "cost": None})
    raw, a = replay_methods(tm, tokenizer, builders, [TRAJ], ev, [0.0], timed=False)
    tree = aggregate(*raw["hybrid_lookup_tree"]["0.0"], a)
    assert tree["lossless"] is True and tree["verified"] is not None
    assert set(tree["by_source"]) <= {"lookup", "model", "shared", "none"}
    # A random drafter is never right: the fit says so, and the tree then leaves it out.
    m = cal["maps"]["model"]
    assert max(p for p, n in zip(m["p"], m["n"]) if n) < 0.2 and "model" not in tree["branches"]
    # Tree rounds record their branches; the learned drafter's branch counts twice, once
    # as the source of rounds like its own (no token proposal, or how strong the best was).
    rounds = [r["branches"] for per_t in raw.values() for results, _ in per_t.values()
              for res in results for r in res["rounds"] if r.get("branches")]
    alone = sum(all(b["source"] == "model" for b in bs) for bs in rounds)
    with_model = sum(any(b["source"] == "model" for b in bs) for bs in rounds)
    recs = branch_records(raw)
    assert len(recs) == sum(map(len, rounds)) + with_model and sum(b["source"] == "model_alone" for b in recs) == alone
    assert sum(b["source"].startswith("model_beside_") for b in recs) == with_model - alone
    # The calibration's own replay (the drafter in every round) fitted it beside lookup,
    # and judged every lookup block by it.
    assert any(s.startswith("model_beside_") for s in cal["fitted_on"]["slots"])
    assert list(cal["judges"]) == ["lookup"] and cal["fitted_on"]["judged"]["lookup"] > 0
    # The cost curve was measured on this target at each context, one point per size,
    # never decreasing, the drafter's draft priced at each; the hybrids price each round
    # by the curve at its anchor (the middle context's is also the report's top level).
    cost = cal["cost"]
    assert [c["context"] for c in cost["by_context"]] == [64, 256] and cost["context"] == 256
    assert cost["tokens"] == [1, 2, 4, 8, 16, 32] and cost["draft_ms"] > 0 and cost["reps"] == 9
    for c in cost["by_context"]:
        assert c["costs"][0] == 1.0 and c["decode_ms"] > 0 and c["draft"] > 0
        assert all(a <= b for a, b in zip(c["costs"], c["costs"][1:]))
        assert set(c["spread"]) == {"1", "2", "4", "8", "16", "32"}
        assert all(lo <= hi for lo, hi in c["spread"].values()) and c["spread"]["1"] == [1.0, 1.0]
    measured = method_builders(ev, {"dlite": drafter}, len(tokenizer), cal)["hybrid_lookup_tree"]()(TRAJ_IDS)
    assert measured.costs.contexts == (64, 256)
    assert measured.costs.at(300).costs == tuple(cost["costs"])
    assert measured.costs.at(10).costs == tuple(cost["by_context"][0]["costs"])
    choose = aggregate(*raw["hybrid_lookup_choose"]["0.0"], a)
    assert choose["lossless"] is True and sum(f["rounds"] for f in choose["by_source"].values()) == choose["n_rounds"]


def test_cost_curve_takes_per_round_ratios():
    """A round slowed as a whole (the machine busy for a moment) leaves the curve alone:
    each point is the median of m tokens' time over one token's in the same round, not a
    ratio of times taken at different moments; a faster larger forward is noise (the
    curve never falls) and nothing costs less than one step."""
    from dlite.decoding.calibrate import curve_from_rounds
    sizes = (1, 2, 4, 8)
    steady = {1: 10.0, 2: 12.0, 4: 15.0, 8: 22.0}
    slowed = {m: 3 * t for m, t in steady.items()}
    assert curve_from_rounds([steady, slowed, steady], sizes) == [1.0, 1.2, 1.5, 2.2]
    # A ratio of bests would mix rounds: the slowed round's 1-token time is not the best,
    # but one stray fast 8-token forward would have set that point alone.
    stray = {1: 10.0, 2: 12.0, 4: 15.0, 8: 9.0}
    assert curve_from_rounds([steady, stray, steady], sizes) == [1.0, 1.2, 1.5, 2.2]
    assert curve_from_rounds([{1: 10.0, 2: 9.0, 4: 8.0, 8: 20.0}], sizes) == [1.0, 1.0, 1.0, 2.0]


def test_timed_replay_runs_every_new_hybrid(tokenizer):
    """The evaluation's timed replay (warm-up, both loops per method, alternating order)
    takes the choose and tree hybrids as the untimed one does (a tree hybrid drafts
    with `draft_tree`, not `draft`: once taken for a factory), losslessly."""
    from dlite.decoding.replay import aggregate, replay_methods
    tm = tiny_target(vocab=len(tokenizer))
    drafter = dlite_drafter(tm, list(range(len(tokenizer))), gamma=4)
    names = ["hybrid_lookup_tree", "hybrid_lookup_choose", "hybrid_free_choose", "hybrid_free_tree"]
    ev = OmegaConf.structured(EvalConfig(max_new_tokens=8, hybrids=names))
    raw, a = replay_methods(tm, tokenizer, method_builders(ev, {"dlite": drafter}, len(tokenizer)),
                            [TRAJ], ev, [0.0], timed=True)
    for name in names:
        row = aggregate(*raw[name]["0.0"], a)
        assert row["n_rounds"] > 0 and row["speedup_vs_ar"] > 0, name

@pytest.mark.parametrize("override,key", [("eval.verify_cost=[1.0,0.5,1.6,2.2]", "eval.verify_cost"),
                                          ("eval.verify_cost_tokens=[1,2]", "eval.verify_cost"),
                                          ("eval.tree_budget=0", "eval.tree_budget"),
                                          ("eval.cost_contexts=[4096,1024]", "eval.cost_contexts"),
                                          ("eval.hybrids=[hybrid_lookup_forest]", "eval.hybrids")])
def test_bad_hybrid_settings_fail_naming_the_key(override, key):
    from dlite.config import ConfigError, load_config
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config("configs/experiments/tiny.yaml", [override])


def test_the_cost_curve_falls_back_to_the_configured_one():
    """Without a measurement, the configured curve; a report from before the curves
    per context (one curve at its top level) still reads back as that curve; measured
    at several contexts, a table over them. Where it is measured: the reported turns'
    range (its ends and middle, the short end at least 256 tokens, room left for the
    largest verification within the target's positions), else 2048 alone."""
    from dlite.decoding.calibrate import cost_contexts, cost_curve
    ev = OmegaConf.structured(EvalConfig())
    assert cost_curve(ev, None) == CostCurve((1, 2, 4, 8), (1.0, 1.4, 1.6, 2.2))
    assert cost_curve(ev, {"cost": {"tokens": [1, 4], "costs": [1.0, 1.3]}}) == CostCurve((1, 4), (1.0, 1.3))
    two = {"tokens": [1, 4], "costs": [1.0, 1.3], "by_context": [
        {"context": 512, "costs": [1.0, 1.5], "draft": 0.2}, {"context": 4096, "costs": [1.0, 1.3], "draft": 0.1}]}
    assert cost_curve(ev, {"cost": two}) == CostTable((512, 4096), (CostCurve((1, 4), (1.0, 1.5), 0.2),
                                                                   CostCurve((1, 4), (1.0, 1.3), 0.1)))
    assert cost_contexts(ev) == [2048]
    assert cost_contexts(OmegaConf.structured(EvalConfig(min_context=1024, max_context=8000))) == [1024, 4512, 8000]
    assert cost_contexts(OmegaConf.structured(EvalConfig(min_context=0, max_context=8000)), 8192) == [256, 4128, 8000]
    assert cost_contexts(OmegaConf.structured(EvalConfig(max_context=100000)), 32768) == [256, 32736]
    assert cost_contexts(OmegaConf.structured(EvalConfig(max_context=8000, cost_contexts=[600, 3000]))) == [600, 3000]


def test_a_round_is_priced_by_the_curve_at_its_context(model):
    """Between measured contexts every point and the draft cost are interpolated,
    outside them the nearest curve holds. A draft that costs most of a step on a short
    history (where a decode step is cheap) is not worth running there, and is on a long
    one: the same drafter, calibration and token proposal, priced at its anchor."""
    short, long = CostCurve((1, 8), (1.0, 3.0), 0.9), CostCurve((1, 8), (1.0, 2.0), 0.1)
    table = CostTable((1000, 3000), (short, long))
    assert table.at(0) == short and table.at(5000) == long and table.at(1000) == short
    mid = table.at(2000)
    assert mid.costs == (1.0, 2.5) and mid.draft == pytest.approx(0.5)
    with pytest.raises(ValueError, match="increase"):
        CostTable((3000, 1000), (short, long))
    with pytest.raises(ValueError, match="same token counts"):
        CostTable((1000, 3000), (short, CostCurve((1, 4), (1.0, 1.5))))
    cal = fit([{"source": "model", "feats": [0.95] * 4, "matched": 1}] * 20)
    hybrid = ChooseHybrid(model, _lookup([1, 2, 3]), cal, table)
    worth = []
    for anchor in (500, 4000):
        hybrid.priced_at(anchor)
        worth.append(hybrid.model_worth_running(None))
    assert worth == [False, True]
    # draft() prices the round itself: with no proposal (token 9 never appears before)
    # on the short history, a plain step without a draft; on the long one it drafts.
    for n, ran, curve in ((500, False, short), (4000, True, long)):
        hybrid = ChooseHybrid(model, _lookup([1 + k % 7 for k in range(n)]), cal, table)
        tokens, _, state = hybrid.draft(hybrid.new_state(), torch.zeros(1, model.feature_dim), 9, n, 0.0)
        assert state["ran"] is ran and hybrid.cost == curve and (ran or tokens.numel() == 0)


def test_hybrid_vs_best_names_the_best_single_method_per_bucket():
    from dlite.decoding.metrics import hybrid_vs_best
    m = {"dlite": {"tau": 1.5, "tau_by_bucket": {"<1K": 1.2, "1K-4K": 1.8}, "speedup_vs_ar": 1.1,
                   "speedup_vs_ar_by_bucket": {"<1K": 1.0, "1K-4K": 1.3}},
         "suffix": {"tau": 2.0, "tau_by_bucket": {"<1K": 1.1, "1K-4K": 2.6}, "speedup_vs_ar": 1.5,
                    "speedup_vs_ar_by_bucket": {"<1K": 0.9, "1K-4K": 2.0}},
         "hybrid_lookup_suffix_choose": {"tau": 2.2, "tau_by_bucket": {"<1K": 1.2, "1K-4K": 2.5},
                                         "speedup_vs_ar": 1.6, "speedup_vs_ar_by_bucket": {"<1K": 1.05, "1K-4K": 2.1}}}
    row = hybrid_vs_best(m)["hybrid_lookup_suffix_choose"]
    assert row["tau"]["<1K"] == {"ratio": 1.0, "best": "dlite", "best_value": 1.2, "value": 1.2}
    assert row["tau"]["1K-4K"]["best"] == "suffix" and row["tau"]["1K-4K"]["ratio"] == pytest.approx(2.5 / 2.6, abs=1e-4)
    assert row["speedup"]["all"]["ratio"] == pytest.approx(1.6 / 1.5, abs=1e-4)
    assert row["ge_best_everywhere"] is False  # 1K-4K tau is short
    m["hybrid_lookup_suffix_choose"]["tau_by_bucket"]["1K-4K"] = 2.7
    assert hybrid_vs_best(m)["hybrid_lookup_suffix_choose"]["ge_best_everywhere"] is True
    assert "time" not in hybrid_vs_best(m)["hybrid_lookup_suffix_choose"]  # no task times: no direct figures


def test_hybrid_vs_best_compares_decode_times_on_the_same_tasks():
    """With each method's timed tasks: the hybrid's decode rate over the fastest single
    method's per bucket, on the tasks all of them ran (a task only one ran is left out),
    beside the speedups and not part of `ge_best_everywhere`."""
    from dlite.decoding.metrics import hybrid_vs_best

    def times(*ms):  # tasks a (<1K), b (<1K), c (1K-4K), 10 tokens each
        return [{"id": i, "turn": 0, "bucket": b, "tokens": 10, "spec_ms": x}
                for i, b, x in zip("abcd", ["<1K", "<1K", "1K-4K", "1K-4K"], ms)]
    figs = {"tau": 2.0, "speedup_vs_ar": 1.5}
    m = {"dlite": {**figs, "task_times": times(100.0, 100.0, 400.0)},
         "suffix": {**figs, "task_times": times(200.0, 200.0, 100.0, 50.0)},
         "hybrid_suffix_tree": {**figs, "task_times": times(80.0, 120.0, 125.0)}}
    row = hybrid_vs_best(m)["hybrid_suffix_tree"]
    assert row["time"]["<1K"]["best"] == "dlite" and row["time"]["<1K"]["ratio"] == 1.0
    assert row["time"]["1K-4K"] == {"ratio": 0.8, "best": "suffix", "best_value": 100.0, "value": 80.0,
                                    "lower_bound": None, "upper_bound": None, "n_tasks": 1}
    assert row["time"]["all"]["best"] == "suffix"  # 30 tokens in 500 ms against dlite's 600
    assert row["time"]["all"]["ratio"] == pytest.approx(500 / 325, abs=1e-4)
    assert row["time_ge_best_everywhere"] is False and row["ge_best_everywhere"] is True


def test_the_decode_time_comparison_has_a_paired_bootstrap_interval():
    """Per bucket the 5th-95th percentile of the hybrid's rate over the best single
    method's, tasks resampled together for both: a hybrid faster on every turn has its
    whole interval above 1, one slower on every turn is `time_behind` there, one
    faster on some turns and slower on others cannot tell (the interval holds 1), and
    turns that are noisy for both methods alike (paired) leave a narrow interval."""
    from dlite.decoding.metrics import hybrid_vs_best

    def times(ms, bucket):
        return [{"id": f"{bucket}{i}", "turn": 0, "bucket": bucket, "tokens": 48, "spec_ms": x}
                for i, x in enumerate(ms)]
    slow = [100.0, 300.0, 150.0, 600.0, 200.0, 90.0]  # turns of very different cost
    suffix = times(slow, "<1K") + times(slow, "1K-4K") + times(slow, "4K-8K")
    hybrid = (times([x * 0.9 for x in slow], "<1K")  # faster on every turn
              + times([x * 1.1 for x in slow], "1K-4K")  # slower on every turn
              + times([x * f for x, f in zip(slow, [0.6, 1.5, 0.7, 1.3, 0.8, 1.4])], "4K-8K"))
    m = {"suffix": {"tau": 2.0, "task_times": suffix}, "hybrid_suffix_tree": {"tau": 2.5, "task_times": hybrid}}
    row = hybrid_vs_best(m)["hybrid_suffix_tree"]
    t = row["time"]
    assert t["<1K"]["lower_bound"] == pytest.approx(1 / 0.9, abs=1e-3)  # the same ratio on every turn
    assert t["<1K"]["upper_bound"] == pytest.approx(1 / 0.9, abs=1e-3)
    assert t["1K-4K"]["upper_bound"] < 1.0 and t["1K-4K"]["n_tasks"] == 6
    assert t["4K-8K"]["lower_bound"] < 1.0 < t["4K-8K"]["upper_bound"]
    assert t["4K-8K"]["lower_bound"] <= t["4K-8K"]["ratio"] <= t["4K-8K"]["upper_bound"]
    assert row["time_behind"] == ["1K-4K"] and row["time_ge_best_everywhere"] is False
    assert t["all"]["n_tasks"] == 18


def test_calibration_reliability_compares_predicted_and_observed_slots():
    """Per source and depth bin, over the slots each tree branch reached (0 to its first
    miss), the calibration's mean P(accepted) beside the share the target accepted;
    slots past a branch's kept tokens and rounds without branches are not counted."""
    from dlite.decoding.calibration import Calibration, reliability
    cal = Calibration()
    rounds = [{"branches": [{"source": "suffix", "n": 2, "matched": 1, "feats": [0.8, 0.5]},
                            {"source": "lookup", "n": 3, "matched": 3, "feats": [3.0, 3.0, 3.0]},
                            {"source": "model", "n": 1, "matched": 0, "feats": [0.9, 0.9, 0.9]}]},
              {"branches": [{"source": "suffix", "n": 1, "matched": 0, "feats": [0.3]}]},
              {"accepted": 2}]  # a choose round: no branches
    rel = reliability(cal, rounds)
    sfx = rel["suffix"]
    assert sfx["slot 0"]["slots"] == 2 and sfx["slot 0"]["observed"] == 0.5
    assert sfx["slot 0"]["predicted"] == pytest.approx((cal.prob("suffix", 0.8, 0) + cal.prob("suffix", 0.3, 0)) / 2,
                                                       abs=1e-4)
    assert sfx["slot 1"] == {"slots": 1, "predicted": pytest.approx(cal.prob("suffix", 0.5, 1), abs=1e-4),
                             "observed": 0.0, "ratio": 0.0}
    assert sfx["all"]["slots"] == 3 and sfx["all"]["observed"] == pytest.approx(1 / 3, abs=1e-4)
    assert rel["lookup"]["slots 2-3"]["slots"] == 1 and rel["lookup"]["all"]["observed"] == 1.0
    assert rel["lookup"]["all"]["ratio"] > 1.0  # every lookup slot held, each predicted below 1
    assert rel["model"]["all"]["slots"] == 1  # one kept token: its two other slots were never verified
    assert reliability(cal, [{"accepted": 1}]) is None


def test_the_learned_drafter_runs_only_where_its_typical_block_could_win(model):
    """Fitted on blocks that fail at their first slot, the learned drafter is worth
    less than a fair token proposal and is not run; with no proposal it runs only if
    its block beats a plain step; an unfitted calibration rates it as sure as it could
    be (as before: it runs)."""
    recs = ([{"source": "model", "feats": [0.95] * 4, "matched": 0}] * 20
            + [{"source": "model", "feats": [0.95] * 4, "matched": 4}] * 2)
    cal = fit(recs)
    typical = cal.typical_probs("model", 4)
    assert typical[0] < 0.25 and typical[1] > 0.5  # slot 0 rarely holds; past it, it does
    hybrid = ChooseHybrid(model, _lookup(REPEAT), cal)
    assert not hybrid.model_worth_running(1.2) and not hybrid.model_worth_running(None)
    fair = fit([{"source": "model", "feats": [0.95] * 4, "matched": 4}] * 20)
    assert ChooseHybrid(model, _lookup(REPEAT), fair).model_worth_running(None)
    # No proposal and a drafter not worth a plain step: the round is a plain step.
    none = ChooseHybrid(model, _lookup([1, 2, 3]), cal)
    tokens, _, state = none.draft(none.new_state(), torch.zeros(1, model.feature_dim), 9, 3, 0.0)
    assert tokens.numel() == 0 and state["source"] == ["none"] and state["ran"] is False
    assert ChooseHybrid(model, _lookup(REPEAT)).model_worth_running(1.2)
    assert ChooseHybrid(model, _lookup(REPEAT), cal, skip_model=False).model_worth_running(5.0)
    # its draft cost counts: the same block is worth less when drafting it costs a step
    costly = ChooseHybrid(model, _lookup(REPEAT), cal, CostCurve(draft=1.0))
    assert costly.model_value() < hybrid.model_value()


def test_without_a_proposal_the_drafter_is_judged_by_rounds_without_one(model):
    """Fitted where the learned drafter holds beside a token proposal (copying rounds)
    and fails alone (free text): its typical block alone is the failing one, so with no
    proposal the round is a plain step; rated on every round, it would have run."""
    from dlite.decoding.calibrate import round_branches
    from dlite.decoding.calibration import MODEL_ALONE
    beside = [{"source": "model", "feats": [0.95] * 4, "matched": 4},
              {"source": "lookup", "feats": [3.0] * 4, "matched": 4}]
    alone = [{"source": "model", "feats": [0.95] * 4, "matched": 0}]
    assert round_branches(beside) == beside
    assert [b["source"] for b in round_branches(alone)] == ["model", MODEL_ALONE]
    cal = fit([b for r in [beside] * 12 + [alone] * 12 for b in round_branches(r)])
    assert cal.typical_probs(MODEL_ALONE, 4)[0] < 0.25 < 0.5 < cal.typical_probs("model", 4)[0]
    hybrid = TreeHybrid(model, _lookup([1, 2, 3]), cal)
    assert not hybrid.model_worth_running(None) and hybrid.model_value() > hybrid.model_value(context=MODEL_ALONE)
    pooled = fit([b for r in [beside] * 12 + [alone] * 12 for b in r])  # no split: as before
    assert not pooled.fitted(MODEL_ALONE) and TreeHybrid(model, _lookup([1, 2, 3]), pooled).model_worth_running(None)
    choose = ChooseHybrid(model, _lookup([1, 2, 3]), cal)
    tokens, _, state = choose.draft(choose.new_state(), torch.zeros(1, model.feature_dim), 9, 3, 0.0)
    assert tokens.numel() == 0 and state["ran"] is False


def test_a_request_that_rejects_the_learned_drafter_stops_running_it(target, model):
    """The online factor: verified model blocks that miss pull this request's estimate
    of the drafter below the calibration's (hits push it up), so a drafter the
    validation turns rated worth a round is dropped on a history where it fails; a new
    request starts from the calibration again. Lossless throughout."""
    fair = fit([{"source": "model", "feats": [x] * 4, "matched": 4} for x in (0.05, 0.5, 0.95)] * 10)
    hybrid = TreeHybrid(model, _lookup([1, 2, 3]), fair)
    state = hybrid.new_state()
    assert hybrid.model_factor(state) == 1.0 and hybrid.model_worth_running(None, state)
    missed = Branch([5, 6, 7, 8], None, "model", [0.95] * 4)
    for _ in range(6):
        hybrid.observe_model(state, missed, 0)  # slot 0 observed, and wrong
    assert hybrid.model_factor(state) < 0.5 and not hybrid.model_worth_running(None, state)
    assert hybrid.model_worth_running(None, hybrid.new_state())
    held = hybrid.new_state()
    hybrid.observe_model(held, missed, 4)
    assert hybrid.model_factor(held) >= 1.0
    # Its confidence on this request: a random drafter is never sure, and where the
    # calibration says unsure blocks fail, a few drafted blocks (none verified) are
    # enough to stop running it.
    judged = fit([{"source": "model", "feats": [0.95] * 4, "matched": 4}] * 10
                 + [{"source": "model", "feats": [0.05] * 4, "matched": 0}] * 10)
    unsure = TreeHybrid(model, _lookup([1, 2, 3]), judged)
    state, feats = unsure.new_state(), torch.zeros(1, model.feature_dim)
    assert unsure.model_worth_running(None, state)
    for _ in range(4):
        unsure.model_branch(state, feats, 9, 3, 0.0, None)
    assert unsure.confidence_factor(state) < 0.6 and not unsure.model_worth_running(None, state)
    # Through the decoding loop: the records carry the factor and whether it ran.
    ref, _ = plain_generate(target, REPEAT, 20)
    for make in (TreeHybrid, ChooseHybrid):
        out, rounds = speculative_generate(target, make(model, _lookup(REPEAT), fair), REPEAT, 20)
        assert out == ref and all({"model_factor", "model_confidence", "model_ran"} <= set(r) for r in rounds)
        ran = [r for r in rounds if r["model_ran"]]
        assert ran, make  # the calibration rates it worth running at first


def test_the_choice_learns_from_its_verified_model_block(model):
    """ChooseHybrid infers what its last model block got from the anchor's move."""
    fair = fit([{"source": "model", "feats": [x] * 4, "matched": 4} for x in (0.05, 0.5, 0.95)] * 10)
    hybrid = ChooseHybrid(model, _lookup([1, 2, 3]), fair)
    feats = torch.zeros(1, model.feature_dim)
    tokens, _, state = hybrid.draft(hybrid.new_state(), feats, 9, 3, 0.0)
    assert state["source"] == ["model"] and tokens.numel() > 0
    _, _, state = hybrid.draft(state, feats, 11, 4, 0.0)  # anchor moved by 1: none accepted
    online = state["online"]
    assert online["hits"] == 0 and online["expected"] > 0 and hybrid.model_factor(state) < 1.0


def test_the_drafter_is_judged_by_rounds_whose_token_proposals_are_as_strong(model):
    """Fitted where the learned drafter fails beside a weak copy (text copying cannot
    find) and holds beside a strong one (text it need not draft): beside a weak
    proposal its typical block is the failing one, so it is not run there, where rated
    on every round it would have been; beside a strong one the copy wins anyway."""
    from dlite.decoding.calibrate import round_branches
    from dlite.decoding.calibration import MODEL_BESIDE, model_context, token_strength
    weak = [{"source": "lookup", "feats": [1.0] * 4, "matched": 0},
            {"source": "model", "feats": [0.95] * 4, "matched": 0}]
    strong = [{"source": "lookup", "feats": [6.0] * 4, "matched": 4},
              {"source": "model", "feats": [0.95] * 4, "matched": 4}]
    first = fit([b for r in [weak] * 12 + [strong] * 12 for b in r])
    assert token_strength(first, weak) < 1.0 and token_strength(first, strong) >= 2.5
    assert token_strength(first, weak[1:]) is None and model_context(None) == "model_alone"
    assert [b["source"] for b in round_branches(weak, first)] == ["lookup", "model", MODEL_BESIDE[0]]
    assert round_branches(strong, first)[-1]["source"] == MODEL_BESIDE[2]
    cal = fit([b for r in [weak] * 12 + [strong] * 12 for b in round_branches(r, first)])
    assert cal.typical_probs(MODEL_BESIDE[0], 4)[0] < 0.25 < 0.5 < cal.typical_probs(MODEL_BESIDE[2], 4)[0]
    hybrid = ChooseHybrid(model, _lookup(REPEAT), cal)
    copy = Branch([5, 6, 7, 8], None, "lookup", [1.0] * 4)
    value = hybrid.cost.best_prefix(hybrid.slot_probs(copy))[1]
    assert hybrid.model_worth_running(value)  # judged on every round: it runs
    assert not hybrid.model_worth_running(value, branches=[copy])  # beside a weak copy: it does not
    # Without the second pass (a calibration of the old layout) every round judges it alike.
    old = fit([b for r in [weak] * 12 + [strong] * 12 for b in r])
    assert ChooseHybrid(model, _lookup(REPEAT), old).model_worth_running(value, branches=[copy])


def test_siblings_share_their_parents_chance(model):
    """Two proposals that disagree at a slot cannot both hold: where their nodes'
    chances sum past the parent's they are scaled down in proportion (and their
    subtrees alike), so the tree no longer pays for a second branch as if both could
    be accepted. A lone branch keeps its chances; off (the calibration's unpruned
    trees): the raw chances."""
    cal = Calibration({"lookup": BinnedMap((2,), [0.8, 0.8], [0, 0]),
                       "suffix": BinnedMap((0.5,), [0.7, 0.7], [0, 0])})
    copy = Branch([5, 6], None, "lookup", [3.0, 3.0])
    other = Branch([9, 4], None, "suffix", [0.9, 0.9])
    same = Branch([5, 7], None, "suffix", [0.9, 0.9])
    flat = CostCurve((1,), (1.0,))
    v = TreeHybrid(model, _lookup(REPEAT), cal, flat)._node_values([copy, other, same], False)
    assert v[(5,)] + v[(9,)] == pytest.approx(1.0) and v[(5,)] / v[(9,)] == pytest.approx(0.8 / 0.7)
    assert v[(5, 6)] + v[(5, 7)] == pytest.approx(v[(5,)]) and v[(5, 6)] / v[(5, 7)] == pytest.approx(0.64 / 0.49)
    assert v[(9, 4)] == pytest.approx(0.49 / 1.5)  # its parent's cut, nothing of its own
    raw = TreeHybrid(model, _lookup(REPEAT), cal, flat, exclusive=False)._node_values([copy, other, same], False)
    assert raw == pytest.approx({(5,): 0.8, (5, 6): 0.64, (9,): 0.7, (9, 4): 0.49, (5, 7): 0.49})
    alone = TreeHybrid(model, _lookup(REPEAT), cal, flat)._node_values([copy], False)
    assert alone == pytest.approx({(5,): 0.8, (5, 6): 0.64})
    # Priced by the CPU curve, the disagreeing branch's last token is no longer worth it.
    three = [Branch([5, 6, 7], None, "lookup", [3.0] * 3), Branch([9, 4, 2], None, "suffix", [0.9] * 3)]
    assert TreeHybrid(model, _lookup(REPEAT), cal)._allocate(three, False)[0] == [3, 2]
    assert TreeHybrid(model, _lookup(REPEAT), cal, exclusive=False)._allocate(three, False)[0] == [3, 3]


@pytest.mark.parametrize("kind", ["choose", "tree"])
def test_a_hybrid_without_a_learned_drafter_is_lossless_and_never_drafts(target, kind):
    """`hybrid_free_*`: the same rules over the token drafters alone -- plain greedy's
    output, no round from a learned drafter, no target features asked for, and even a
    calibration that judges token proposals by the learned drafter scores them
    without it (there is none to ask)."""
    ref, _ = plain_generate(target, REPEAT, 30)
    make = ChooseHybrid if kind == "choose" else TreeHybrid
    for cal in (None, _judged(0.99, 0.5)):
        drafter = make(None, [_lookup(REPEAT), SuffixDecoding(V, gamma=4)(REPEAT)], cal)
        assert drafter.target_layer_ids == [] and drafter.gamma == 4
        out, rounds = speculative_generate(target, drafter, REPEAT, 30)
        assert out == ref
        assert {r["source"] for r in rounds} <= {"lookup", "suffix", "none", "shared"}
        assert any(r["source"] in ("lookup", "suffix", "shared") for r in rounds)
        assert not any(r["model_ran"] for r in rounds)
        assert drafter.cache_bytes(drafter.new_state()) >= 0


def test_method_builders_make_the_free_hybrids_with_or_without_a_learned_drafter(model):
    ev = OmegaConf.structured(EvalConfig(hybrids=["hybrid_free_choose", "hybrid_free_tree"]))
    for learned in ({"dlite": model}, {}):
        builders = method_builders(ev, learned, V, Calibration().to_dict())
        choose, tree = builders["hybrid_free_choose"]()(REPEAT), builders["hybrid_free_tree"]()(REPEAT)
        assert isinstance(choose, ChooseHybrid) and isinstance(tree, TreeHybrid)
        assert choose.model is None and tree.model is None
        assert [type(lk).__name__ for lk in choose.lookups] == ["PromptLookupDrafter", "SuffixDrafter"]
    ev = OmegaConf.structured(EvalConfig(hybrids=["hybrid_lookup_suffix_choose"]))
    with pytest.raises(ValueError, match="needs a learned drafter"):
        method_builders(ev, {}, V)


def test_learned_over_free_compares_the_twins_on_the_same_tasks():
    """What the learned drafter adds: each learned hybrid over its training-free twin
    (same token drafters, same rule), tau / speedup per bucket and the decode rate on
    the tasks both timed; a hybrid without its twin in the run gets no row."""
    from dlite.decoding.metrics import learned_over_free

    def times(*ms):
        return [{"id": i, "turn": 0, "bucket": b, "tokens": 10, "spec_ms": x}
                for i, b, x in zip("abcd", ["<1K", "<1K", "1K-4K", "1K-4K"], ms)]
    m = {"suffix": {"tau": 2.0, "speedup_vs_ar": 1.5, "task_times": times(100.0, 100.0, 100.0, 100.0)},
         "hybrid_lookup_suffix_choose": {"tau": 3.0, "speedup_vs_ar": 2.2, "tau_by_bucket": {"<1K": 2.0, "1K-4K": 4.0},
                                         "task_times": times(50.0, 50.0, 100.0, 100.0)},
         "hybrid_free_choose": {"tau": 2.5, "speedup_vs_ar": 2.0, "tau_by_bucket": {"<1K": 1.6, "1K-4K": 4.0},
                                "task_times": times(100.0, 100.0, 80.0, 80.0)},
         "hybrid_lookup_suffix_tree": {"tau": 3.0, "speedup_vs_ar": 2.0}}
    out = learned_over_free(m)
    assert set(out) == {"hybrid_lookup_suffix_choose"}
    row = out["hybrid_lookup_suffix_choose"]
    assert row["free"] == "hybrid_free_choose"
    assert row["tau"]["all"] == {"ratio": 1.2, "value": 3.0, "free_value": 2.5} and row["tau"]["<1K"]["ratio"] == 1.25
    assert row["tau"]["1K-4K"]["ratio"] == 1.0 and row["speedup"]["all"]["ratio"] == 1.1
    assert row["time"]["<1K"]["ratio"] == 2.0 and row["time"]["1K-4K"]["ratio"] == 0.8
    assert row["time"]["all"]["ratio"] == pytest.approx(360 / 300, abs=1e-4)
    assert learned_over_free({k: v for k, v in m.items() if k != "hybrid_free_choose"}) == {}
    # The quality benchmark's comparison carries it too (only where a twin ran).
    from pipelines.benchmarks.quality import compare
    figs = {"tau_by_bucket": {"<1K": 2.0}, "bucket_labels": ["<1K"], "settings": {"buckets": [1024]},
            "draft_ms_by_bucket": {}, "draft_cache_bytes_by_bucket": {}, "speedup_vs_ar_by_bucket": {}}
    rep = {"methods": {"dlite": {**figs, "tau": 2.0, "speedup_vs_ar": 1.2},
                       "dspark": {**figs, "tau": 1.5, "speedup_vs_ar": 1.0},
                       **{k: {**figs, **v} for k, v in m.items() if k.startswith("hybrid_")}}}
    assert compare(rep, 1536)["learned_over_free"] == learned_over_free(rep["methods"])
    del rep["methods"]["hybrid_free_choose"]
    assert "learned_over_free" not in compare(rep, 1536)
