"""Fitting the hybrids' calibration on validation turns (never the reported ones).

Each token drafter a choose / tree hybrid pairs with (prompt lookup, SuffixDecoding) is
replayed greedily beside the primary learned drafter as an unpruned tree (every slot of
every proposal verified: a flat cost curve and a budget no proposal reaches), so each
round says, for every proposer, how many of its slots the target's greedy output
confirms -- counterfactual acceptance, whichever proposal a hybrid would have picked.
`dlite.decoding.calibration.fit` turns those per-slot observations into the maps.

`measure_cost`: the verify-cost curve on this machine and target at each of a few
contexts over the reported turns' range (`cost_contexts`; `forward_rounds`: after a
warm-up, rounds of timed cached forwards of every size m after a prefill of that many
tokens; per size the median over rounds of m tokens' time over one token's in the same
round), and the learned drafter's draft in decode steps at each, so that what a hybrid
verifies, and whether it drafts, is priced by what they cost here, at the round's
context, rather than by another machine's figures."""

import statistics
import time
from typing import Dict, Iterable, List, Optional, Sequence

import torch

from dlite.config_schema import HYBRIDS
from dlite.decoding.calibration import (MODEL_ALONE, Calibration, CostCurve, CostTable, fit, model_context,
                                        token_strength)
from dlite.decoding.hybrid import TreeHybrid

FLAT = CostCurve((1,), (1.0,))  # every node is worth verifying: nothing pruned


def scored_token_methods(hybrids: Iterable[str]) -> List[str]:
    """The token drafters (`prompt_lookup`, `suffix`) the choose / tree hybrids pair with."""
    from dlite.decoding.methods import hybrid_rule
    return sorted({m for h in hybrids if hybrid_rule(h) != "match" for m in HYBRIDS[h]})


def calibration_builders(ev, primary, vocab_size: int) -> Dict[str, object]:
    """{calib_<token method>: builder of an unpruned tree hybrid over it}."""
    from dlite.decoding.methods import _TOKEN_DRAFTERS, _hybrid, token_gammas
    gamma = token_gammas(ev, primary)[1]  # observed at the length the hybrids propose
    budget = 4 * max(gamma, primary.gamma)  # above any chain pair, and room for a suffix tree

    def one(model, lk):  # the learned drafter in every round: each is an observation of it
        return TreeHybrid(model, lk, Calibration(), FLAT, budget, skip_model=False, online_prior=None,
                          exclusive=False)
    return {f"calib_{m}": (lambda m=m: _hybrid(primary, [_TOKEN_DRAFTERS[m](ev, vocab_size, gamma)], one))
            for m in scored_token_methods(ev.hybrids)}


def branch_records(raw: dict) -> List[dict]:
    """Every `branches` entry of every round in `replay_methods`' raw results, the
    learned drafter's once more under the source of the round it was in (see
    `round_branches`); how strong a round's token proposals were is read from a first
    fit on the same rounds (the token drafters' maps do not depend on the second)."""
    rounds = [r.get("branches", []) for per_t in raw.values() for results, _ in per_t.values()
              for res in results for r in res["rounds"]]
    first = fit([b for branches in rounds for b in branches])
    return [b for branches in rounds for b in round_branches(branches, first)]


def round_branches(branches: List[dict], calibration: Calibration = None) -> List[dict]:
    """One round's branches, plus the learned drafter's again as the source of rounds
    like this one: `MODEL_ALONE` when it is the round's only one, else (with the token
    drafters' `calibration`) `MODEL_BESIDE[...]` by the best token proposal's expected
    accepted length. A hybrid decides whether to run the drafter from its typical block
    in rounds like the one it is in: without a token proposal those are the free-text
    turns of an agent history, where the drafter does worse than on average; beside a
    weak one, the rounds where it is the only hope; beside a strong one, copying, where
    it is not needed."""
    models = [b for b in branches if b["source"] == "model"]
    if not models:
        return branches
    if len(models) == len(branches):
        return branches + [{**b, "source": MODEL_ALONE} for b in models]
    if calibration is None:
        return branches
    context = model_context(token_strength(calibration, branches))
    return branches + [{**b, "source": context} for b in models]


def fit_calibration(target, tokenizer, ev, primary, vocab_size: int, records: list, max_turns=None) -> dict:
    """Replay the validation `records` greedily and fit; `Calibration.to_dict()` with
    what it was fitted on, and (`eval.measure_verify_cost`) the cost curve measured
    here under "cost"."""
    from dlite.decoding.replay import replay_methods
    builders = calibration_builders(ev, primary, vocab_size)
    if not builders:
        return Calibration().to_dict()
    raw, _ = replay_methods(target, tokenizer, builders, records, ev, [0.0], timed=False,
                            max_turns=max_turns or ev.max_turns)
    obs = branch_records(raw)
    tasks = len(next(iter(raw.values()))["0.0"][0])
    cal = fit(obs, {"records": [r.get("id") for r in records], "tasks": tasks, "methods": sorted(builders)})
    out = cal.to_dict()
    # What each source's block is worth before it is drafted (the learned drafter's
    # decides whether it runs): for a reader of the report, not read back.
    out["typical"] = {s: [round(p, 4) for p in cal.typical_probs(s, primary.gamma)] for s in sorted(cal.by_depth)}
    if ev.measure_verify_cost:
        positions = getattr(target.config, "max_position_embeddings", None)
        out["cost"] = measure_cost(target, cost_contexts(ev, positions), threads=ev.threads, drafter=primary)
    return out


def cost_contexts(ev, max_positions: Optional[int] = None) -> List[int]:
    """Where the cost curve is measured: `eval.cost_contexts` when set; else the
    shortest, middle and longest history of the reported turns' range
    (eval.min_context -- at least 256 -- to max_context); without a max_context, 2048
    tokens alone. Each is cut to leave room for the largest verification within the
    target's `max_positions`."""
    if ev.cost_contexts:
        points = list(ev.cost_contexts)
    elif ev.max_context:
        lo = min(max(ev.min_context or 0, 256), ev.max_context)
        points = [lo, (lo + ev.max_context) // 2, ev.max_context]
    else:
        points = [2048]
    room = (max_positions or 1 << 30) - max(COST_SIZES)
    return sorted({max(1, min(p, room)) for p in points})


def cost_curve(ev, calibration: dict = None):
    """What the hybrids price verification by: the curves measured with the
    calibration when there are some (a `CostTable` over their contexts when measured
    at several, else the one `CostCurve`), else eval.verify_cost_tokens ->
    eval.verify_cost at every context."""
    measured = (calibration or {}).get("cost")
    if not measured:
        return CostCurve(tuple(ev.verify_cost_tokens), tuple(ev.verify_cost))
    tokens = tuple(measured["tokens"])
    per = measured.get("by_context") or [measured]
    curves = tuple(CostCurve(tokens, tuple(p["costs"]), p.get("draft", 0.0)) for p in per)
    if len(curves) == 1:
        return curves[0]
    return CostTable(tuple(p["context"] for p in per), curves)


COST_SIZES = (1, 2, 4, 8, 16, 32)  # tokens per verification (anchor included)


@torch.no_grad()
def forward_rounds(model, context: int, sizes: Sequence[int], reps: int = 3, seed: int = 0) -> List[Dict[int, float]]:
    """[{m: ms}] per round: `reps` rounds, each timing one cached forward of m random
    tokens for every m in `sizes`, after a prefill of `context` random tokens (the cache
    cropped back after each). One untimed round first: the first forwards after a
    prefill are slower (allocator, caches), which used to inflate the one-token time
    and flatten the whole curve. Interleaving the sizes inside a round means a drift of
    the machine's speed hits every size of that round alike instead of one size."""
    from dlite.decoding.decode import crop_cache, loop_cache, new_cache, target_forward
    dev = next(model.parameters()).device
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, model.config.vocab_size, (context + max(sizes),), generator=gen).to(dev)
    cache = new_cache(model)
    target_forward(model, ids[:context], 0, cache, logits_to_keep=1)
    cache = loop_cache(cache, max(sizes), copy_of=False)  # the loops' cache: no per-forward copy
    rounds = []
    for r in range(reps + 1):
        times = {}
        for m in sizes:
            t = time.perf_counter()
            target_forward(model, ids[context:context + m], context, cache)
            times[m] = (time.perf_counter() - t) * 1000
            crop_cache(cache, context)
        if r:  # round 0 is the warm-up
            rounds.append(times)
    return rounds


def forward_ms(model, context: int, sizes: Sequence[int], reps: int = 3, seed: int = 0) -> Dict[int, float]:
    """{m: ms}: the best of `reps` interleaved timed forwards of m tokens (`forward_rounds`)."""
    rounds = forward_rounds(model, context, sizes, reps, seed)
    return {m: min(r[m] for r in rounds) for m in sizes}


def curve_from_rounds(rounds: List[Dict[int, float]], sizes: Sequence[int]) -> List[float]:
    """Decode steps per size: the median over rounds of m tokens' time over one token's
    in the same round (a round slowed as a whole leaves its ratios alone), never below
    the previous point (a faster larger forward is timing noise) nor below 1."""
    costs, floor = [], 1.0
    for m in sizes:
        floor = max(floor, statistics.median(r[m] / r[sizes[0]] for r in rounds))
        costs.append(round(floor, 4))
    return costs


@torch.no_grad()
def draft_ms(target, drafter, reps: int = 5) -> float:
    """The median of `reps` greedy drafts of `drafter` as a hybrid runs it (each slot's
    confidence recorded, its own stop rule on) after an untimed one, from the features
    of a short real prefill. On the SmolLM2 main job's drafter (stop 58): 9.05 ms here,
    7.5 ms (median; mean 8.5) over 19 anchors of a real held-out prompt, 19-22 ms when
    every slot is drafted. History-free: its cost does not grow with the context. The
    median, as for the one-token forward it is divided by."""
    from dlite.decoding.decode import _new_state, prefill
    from dlite.models.common import recording_confidences
    ids = list(range(1, 33))
    pre = prefill(target, ids, drafter.target_layer_ids)
    feats, times = pre.features(drafter.target_layer_ids, False), []
    for r in range(reps + 1):
        state = _new_state(drafter, ids)
        t = time.perf_counter()
        with recording_confidences():
            drafter.draft(state, feats, 1, len(ids), 0.0)
        if r:  # the first draft is the warm-up
            times.append((time.perf_counter() - t) * 1000)
    return statistics.median(times)


def measure_cost(target, contexts: Sequence[int], sizes: Sequence[int] = COST_SIZES, reps: int = 9,
                 threads: int = None, drafter=None) -> dict:
    """The verify-cost curve measured here after a prefill of each of `contexts`, with
    `threads` torch threads (the timed replay's: how a forward's cost grows with its
    tokens depends on the threads it spreads over): {"tokens",
    "by_context": per context {"context", "costs" (decode steps, `curve_from_rounds`),
    "draft" (one draft of `drafter` in decode steps there; 0 without one), "decode_ms"
    (the median one-token forward), "spread" (per size, the smallest and largest
    per-round ratio: how far one round's curve could have strayed)}, "draft_ms",
    "reps", "threads", and the middle context's entry at the top level (one curve's
    readers)}; `cost_curve` makes the `CostTable` (or `CostCurve`)."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads or before)
    try:
        d_ms = draft_ms(target, drafter, reps) if drafter is not None else 0.0
        per = [_curve_at(target, c, sizes, reps, d_ms) for c in contexts]
    finally:
        torch.set_num_threads(before)
    return {**per[len(per) // 2], "tokens": list(sizes), "draft_ms": round(d_ms, 3), "reps": reps,
            "threads": threads or before, "by_context": per}


def _curve_at(target, context: int, sizes: Sequence[int], reps: int, d_ms: float) -> dict:
    """One context's entry of `measure_cost`."""
    rounds = forward_rounds(target, context, sizes, reps)
    step = statistics.median(r[sizes[0]] for r in rounds)
    ratios = {m: [r[m] / r[sizes[0]] for r in rounds] for m in sizes}
    return {"context": int(context), "costs": curve_from_rounds(rounds, sizes), "draft": round(d_ms / step, 4),
            "decode_ms": round(step, 3),
            "spread": {str(m): [round(min(v), 3), round(max(v), 3)] for m, v in ratios.items()}}
