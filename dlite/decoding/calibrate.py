"""Fitting the hybrids' calibration on validation turns (never the reported ones).

Each token drafter a choose / tree hybrid pairs with (prompt lookup, SuffixDecoding) is
replayed greedily beside the primary learned drafter as an unpruned tree (every slot of
every proposal verified: a flat cost curve and a budget no proposal reaches), so each
round says, for every proposer, how many of its slots the target's greedy output
confirms -- counterfactual acceptance, whichever proposal a hybrid would have picked.
`dlite.decoding.calibration.fit` turns those per-slot observations into the maps."""

from typing import Dict, Iterable, List

from dlite.config_schema import HYBRIDS
from dlite.decoding.calibration import Calibration, CostCurve, fit
from dlite.decoding.hybrid import TreeHybrid

FLAT = CostCurve((1,), (1.0,))  # every node is worth verifying: nothing pruned


def scored_token_methods(hybrids: Iterable[str]) -> List[str]:
    """The token drafters (`prompt_lookup`, `suffix`) the choose / tree hybrids pair with."""
    from dlite.decoding.methods import hybrid_rule
    return sorted({HYBRIDS[h] for h in hybrids if hybrid_rule(h) != "match"})


def calibration_builders(ev, primary, vocab_size: int) -> Dict[str, object]:
    """{calib_<token method>: builder of an unpruned tree hybrid over it}."""
    from dlite.decoding.methods import _TOKEN_DRAFTERS, _hybrid
    gamma = ev.lookup_gamma or primary.gamma
    budget = 4 * max(gamma, primary.gamma)  # above any chain pair, and room for a suffix tree

    def one(model, lk):
        return TreeHybrid(model, lk, Calibration(), FLAT, budget)
    return {f"calib_{m}": (lambda m=m: _hybrid(primary, _TOKEN_DRAFTERS[m](ev, vocab_size, gamma), one))
            for m in scored_token_methods(ev.hybrids)}


def branch_records(raw: dict) -> List[dict]:
    """Every `branches` entry of every round in `replay_methods`' raw results."""
    return [b for per_t in raw.values() for results, _ in per_t.values()
            for res in results for r in res["rounds"] for b in r.get("branches", [])]


def fit_calibration(target, tokenizer, ev, primary, vocab_size: int, records: list, max_turns=None) -> dict:
    """Replay the validation `records` greedily and fit; `Calibration.to_dict()` with
    what it was fitted on."""
    from dlite.decoding.replay import replay_methods
    builders = calibration_builders(ev, primary, vocab_size)
    if not builders:
        return Calibration().to_dict()
    raw, _ = replay_methods(target, tokenizer, builders, records, ev, [0.0], timed=False,
                            max_turns=max_turns or ev.max_turns)
    obs = branch_records(raw)
    tasks = len(next(iter(raw.values()))["0.0"][0])
    return fit(obs, {"records": [r.get("id") for r in records], "tasks": tasks,
                     "methods": sorted(builders)}).to_dict()
