"""What a proposal is worth before the target sees it: each proposer's per-slot
confidence turned into P(slot k accepted | slots before it accepted), the expected
accepted length of a proposal, and its value per unit of verification cost.

Confidence features (one number per slot, what `dlite.decoding.hybrid` records):
- `model` (a learned drafter): its own probability of the token it chose (at T > 0 the
  largest probability of its first slot for every slot, a number fixed before any
  draw, so choosing by it keeps the rejection rule exact);
- `suffix` (SuffixDecoding): the tree's estimated probability of the token given the
  path to it (arctic-inference's path probability over its parent's);
- `lookup` (prompt lookup): the length of the n-gram match it continues.

``Calibration`: per source a binned map feature -> acceptance, fitted on the per-branch
records of tree rounds on validation turns (`fit`: each branch is verified in full, so
every slot up to its first miss is an observation, counterfactual to what was chosen),
Laplace-smoothed and made non-decreasing in the feature (pool-adjacent-violators).
Without a fit, `defaults`: the probability itself, and n / (n + 1) for a match of n.
A fit also keeps one map per slot depth (`DEPTH_EDGES`: slot 0, 1, 2-3, 4+), each
smoothed toward the pooled one: acceptance is conditional on the slots before it, and a
copy that has held for a few tokens tends to go on holding (prompt lookup's feature is
the same at every slot, so without depth a long right copy was scored like a short
one and cut).
A token drafter's first slot is also judged by the learned drafter, where it ran: the
probability its own first-slot distribution gives the proposed token (`agree`, a number
fixed before it draws anything). A fit keeps, per token source, a `Judge`: a logistic
model of slot 0's acceptance over the logit of the source's own slot-0 map and the log
of that probability -- three numbers, since two validation trajectories give a few dozen
judged blocks per source, too few for a map per (feature, agreement) bin. Measured on
the SmolLM2 default's held-out agent turns (stop 52): a 1-2-token lookup match was right
28% of the time, 91% when the drafter's own first token was the same, 9% when the
drafter gave it under 0.1 -- copying's features cannot tell a copy from a common phrase,
the target's hidden state, read by the drafter, largely can.

`CostCurve`: verifying m tokens (anchor included) costs cost(m) decode steps, linear
between measured points, and running the learned drafter costs `draft` steps more. The
default is this project's CPU measurement (SmolLM2-135M at 4K context, `jobs.benchmark
target_probe` step costs: 1 / 2 / 4 / 8 tokens cost 1.0 / 1.4 / 1.6 / 2.2 decode
steps); `eval.verify_cost_tokens` / `eval.verify_cost` set another machine's.
`CostTable`: curves measured at several contexts, a round priced by the curve at its
anchor's position (`at`). A decode step's cost grows with the context (attention reads
the whole cache) and a history-free draft's does not, so the draft is a larger share
of a step on short histories: measured on SmolLM2 here (stop 57), ~10 ms a draft was
~0.19 of a step at 600 tokens and ~0.1 at 3,000, where one curve measured at 2,048
tokens had priced it at 0.076 everywhere."""

import bisect
import dataclasses
import math
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

import torch

# The learned drafter's observations in rounds where no token drafter proposed: a source
# of its own, so that its typical block there is known (`calibrate.round_branches`) ...
MODEL_ALONE = "model_alone"
# ... and in rounds where one did, by how strong the best token proposal was: its
# calibrated expected accepted length E (`token_strength`) below 1, 1 to 2.5, 2.5 or more.
# Rounds where copying finds a long sure continuation are not the rounds where it finds
# a weak one, and the learned drafter is only worth its draft time in the second kind.
STRENGTH_EDGES = (1.0, 2.5)
MODEL_BESIDE = ("model_beside_weak", "model_beside_fair", "model_beside_strong")
PROB_EDGES = tuple(round(0.1 * i, 1) for i in range(1, 10))  # 10 bins over [0, 1]
MATCH_EDGES = (2, 3, 4, 5, 6, 8)  # match length 1, 2, ..., 6-7, 8+
DEPTH_EDGES = (1, 2, 4)  # slot 0, 1, 2-3, 4+
DEPTH_LABELS = ("slot 0", "slot 1", "slots 2-3", "slots 4+")


def depth_bin(k: int) -> int:
    return sum(k >= e for e in DEPTH_EDGES)


def edges_for(source: str) -> Tuple[float, ...]:
    return MATCH_EDGES if source == "lookup" else PROB_EDGES


@dataclasses.dataclass
class BinnedMap:
    """feature -> probability, constant on the bins `edges` cut (x >= edge: above it)."""
    edges: Tuple[float, ...]
    p: List[float]
    n: List[int]

    def __call__(self, x: float) -> float:
        return self.p[sum(x >= e for e in self.edges)]

    def to_dict(self) -> dict:
        return {"edges": list(self.edges), "p": [round(v, 6) for v in self.p], "n": list(self.n)}


def _midpoints(edges: Sequence[float], source: str) -> List[float]:
    if source == "lookup":  # a match of n: n / (n + 1), at each bin's lower end
        return [n / (n + 1) for n in (1, *edges)]
    bounds = (0.0, *edges, 1.0)
    return [(lo + hi) / 2 for lo, hi in zip(bounds, bounds[1:])]


def _isotonic(values: List[float], weights: List[float]) -> List[float]:
    """Pool adjacent violators: the closest non-decreasing sequence (weighted)."""
    blocks = [[v, w, 1] for v, w in zip(values, weights)]
    out: List[list] = []
    for b in blocks:
        out.append(b)
        while len(out) > 1 and out[-2][0] > out[-1][0]:
            v2, w2, c2 = out.pop()
            v1, w1, c1 = out.pop()
            w = w1 + w2
            out.append([(v1 * w1 + v2 * w2) / w if w else (v1 + v2) / 2, w, c1 + c2])
    return [v for v, _, c in out for _ in range(c)]


def fit_map(source: str, pairs: Iterable[Tuple[float, bool]], prior_weight: float = 2.0,
            prior: Sequence[float] = None) -> BinnedMap:
    """Binned acceptance from (feature, accepted) pairs, smoothed toward `prior` (one
    probability per bin; default: the uncalibrated map)."""
    edges = edges_for(source)
    prior = list(prior) if prior is not None else _midpoints(edges, source)
    hits, n = [0] * len(prior), [0] * len(prior)
    for x, y in pairs:
        i = sum(x >= e for e in edges)
        n[i] += 1
        hits[i] += bool(y)
    p = [(h + prior_weight * q) / (c + prior_weight) for h, c, q in zip(hits, n, prior)]
    return BinnedMap(edges, _isotonic(p, [c + prior_weight for c in n]), n)


def _map_from(d: dict) -> BinnedMap:
    return BinnedMap(tuple(d["edges"]), list(d["p"]), list(d["n"]))


class Calibration:
    """{source: BinnedMap} (pooled over slots) and, where fitted, {source: [BinnedMap
    per depth bin]} and {token source: its slot-0 `Judge`}; a source without a fit gets
    its default map."""

    def __init__(self, maps: Dict[str, BinnedMap] = None, fitted_on: dict = None,
                 by_depth: Dict[str, List[BinnedMap]] = None, judges: Dict[str, "Judge"] = None):
        self.maps, self.fitted_on = dict(maps or {}), fitted_on or {}
        self.by_depth, self.judges = dict(by_depth or {}), dict(judges or {})

    def judged(self, source: str) -> bool:
        """Whether `source`'s first slot is judged by the learned drafter's agreement."""
        return source in self.judges

    def prob(self, source: str, x: float, depth: int = None, agree: float = None) -> float:
        """P(accepted | feature x, every slot before it accepted) at slot `depth`
        (None: pooled over depths); at slot 0, with the learned drafter's probability
        `agree` of the token, the source's judge where fitted."""
        if depth == 0 and agree is not None and source in self.judges:
            return self.judges[source](self.prob(source, x, 0), agree)
        if depth is not None and source in self.by_depth:
            return self.by_depth[source][depth_bin(depth)](x)
        if source not in self.maps:
            edges = edges_for(source)
            self.maps[source] = BinnedMap(edges, _midpoints(edges, source), [0] * (len(edges) + 1))
        return self.maps[source](x)

    def slot_probs(self, source: str, feats: Sequence[float], agree: float = None) -> List[float]:
        return [self.prob(source, x, k, agree) for k, x in enumerate(feats)]

    def fitted(self, source: str) -> bool:
        return source in self.by_depth

    def typical_probs(self, source: str, n: int) -> List[float]:
        """P(slot k accepted | the slots before it) for k < n, averaged over the features
        the fit saw at that depth (weighted by its observations): what a block of
        `source` is worth before it is drafted. Unfitted: the map's top, as sure as it
        could be."""
        out = []
        for k in range(n):
            m = self.by_depth[source][depth_bin(k)] if source in self.by_depth else None
            seen = sum(m.n) if m else 0
            out.append(sum(p * c for p, c in zip(m.p, m.n)) / seen if seen else self.prob(source, 1.0, k))
        return out

    def to_dict(self) -> dict:
        return {"maps": {s: m.to_dict() for s, m in self.maps.items()},
                "by_depth": {s: [m.to_dict() for m in ms] for s, ms in self.by_depth.items()},
                "judges": {s: [round(w, 6) for w in j.w] for s, j in self.judges.items()},
                "depth_edges": list(DEPTH_EDGES), "fitted_on": self.fitted_on}

    @classmethod
    def from_dict(cls, d: dict) -> "Calibration":
        if not d:
            return cls()
        if d.get("by_depth") and tuple(d.get("depth_edges", ())) != DEPTH_EDGES:
            raise ValueError(f"calibration fitted with depth bins {d.get('depth_edges')}, "
                             f"this code reads {list(DEPTH_EDGES)}: refit it")
        maps = {s: _map_from(m) for s, m in d["maps"].items()}
        by_depth = {s: [_map_from(m) for m in ms] for s, ms in (d.get("by_depth") or {}).items()}
        judges = {s: Judge(tuple(w)) for s, w in (d.get("judges") or {}).items()}
        return cls(maps, d.get("fitted_on"), by_depth, judges)


def reached_slots(branch: dict) -> List[Tuple[float, bool, int]]:
    """(feature, accepted, slot) per slot a branch record reached: slots 0..matched (the
    first miss included), each accepted iff before the miss; never past its features
    or its verified tokens (`n`)."""
    feats, m = branch["feats"], branch["matched"]
    return [(feats[k], k < m, k) for k in range(min(m + 1, len(feats), branch.get("n", len(feats))))]


def observations(branch_records: Iterable[dict]) -> Dict[str, List[Tuple[float, bool, int]]]:
    """Every branch record's `reached_slots`, per source."""
    out: Dict[str, List[Tuple[float, bool, int]]] = {}
    for b in branch_records:
        out.setdefault(b["source"], []).extend(reached_slots(b))
    return out


@dataclasses.dataclass
class Judge:
    """P(a token drafter's slot 0 accepted) = sigmoid(w0 + w1 * logit(p) + w2 * log(a)):
    p its own slot-0 map's probability, a the learned drafter's probability of the token
    (floored: a token outside a draft vocabulary has 0). `w` = (0, 1, 0) is the map
    unchanged, which `fit_judge` shrinks toward."""
    w: Tuple[float, float, float] = (0.0, 1.0, 0.0)

    def __call__(self, p: float, agree: float) -> float:
        z = sum(wi * xi for wi, xi in zip(self.w, judge_inputs(p, agree)))
        return 1.0 / (1.0 + math.exp(-max(-30.0, min(30.0, z))))


# The smallest agreement a judge reads: a token outside the drafter's draft vocabulary
# gets probability 0, whose log the judge cannot take.
AGREE_FLOOR = 1e-4


def judge_inputs(p: float, agree: float) -> Tuple[float, float, float]:
    """(1, logit(p), log(agree)), both clamped away from 0 and 1."""
    p = min(max(p, 1e-3), 1 - 1e-3)
    return 1.0, math.log(p / (1 - p)), math.log(max(agree, AGREE_FLOOR))


def fit_judge(rows: Sequence[Tuple[float, float, bool]], ridge: float = 1.0, steps: int = 25) -> Judge:
    """Logistic regression of accepted on `judge_inputs(p, agree)` for (p, agree,
    accepted) rows, by Newton steps, with a ridge penalty toward the unchanged map
    (w = (0, 1, 0)): with few rows the judge stays near what the map says."""
    prior = torch.tensor(Judge().w, dtype=torch.float64)
    x = torch.tensor([judge_inputs(p, a) for p, a, _ in rows], dtype=torch.float64).reshape(-1, 3)
    y = torch.tensor([float(acc) for _, _, acc in rows], dtype=torch.float64)
    w = prior.clone()
    for _ in range(steps):
        q = torch.sigmoid(x @ w)
        grad = x.T @ (q - y) + ridge * (w - prior)
        hess = (x.T * (q * (1 - q))) @ x + ridge * torch.eye(3, dtype=torch.float64)
        step = torch.linalg.solve(hess, grad)
        w = w - step
        if float(step.abs().max()) < 1e-8:
            break
    return Judge(tuple(float(v) for v in w))


def first_slot_judged(branch_records: Iterable[dict]) -> Dict[str, List[Tuple[float, float, bool]]]:
    """(the learned drafter's probability of the first token, the feature, accepted) of
    every token drafter's branch that carries one (`agree`)."""
    out: Dict[str, List[Tuple[float, float, bool]]] = {}
    for b in branch_records:
        if b.get("agree") is not None and b["feats"]:
            out.setdefault(b["source"], []).append((b["agree"], b["feats"][0], b["matched"] > 0))
    return out


def fit(branch_records: Iterable[dict], fitted_on: dict = None) -> Calibration:
    """A Calibration from the `branches` entries of tree rounds' records: per source
    the pooled map, and one per depth bin smoothed toward it (a bin with few slots
    stays near the pooled estimate); per token source whose branches carry the learned
    drafter's agreement, its slot-0 `Judge`."""
    branch_records = list(branch_records)
    obs = observations(branch_records)
    maps, by_depth, judges = {}, {}, {}
    for s, triples in obs.items():
        maps[s] = fit_map(s, [(x, y) for x, y, _ in triples])
        by_depth[s] = [fit_map(s, [(x, y) for x, y, k in triples if depth_bin(k) == d], prior=maps[s].p)
                       for d in range(len(DEPTH_EDGES) + 1)]
    judged = first_slot_judged(branch_records)
    for s, rows in judged.items():
        judges[s] = fit_judge([(by_depth[s][0](x), a, y) for a, x, y in rows])
    fitted_on = {**(fitted_on or {}), "slots": {s: len(v) for s, v in obs.items()}}
    if judged:
        fitted_on["judged"] = {s: len(v) for s, v in judged.items()}
    return Calibration(maps, fitted_on, by_depth, judges)


def reliability(calibration: "Calibration", rounds: Iterable[dict]) -> Optional[dict]:
    """Whether the calibration fitted on validation turns holds on other turns: per
    source and depth bin, over every slot a tree round's branch reached
    (`reached_slots`, as the fit reads them), the slots, the mean calibrated
    P(accepted | slots before) -- the calibration's own, before a hybrid's per-request correction of the
    learned drafter -- and the share the target accepted; `ratio` observed / predicted.
    None without tree rounds (a choose round verifies one proposal, cut to its chosen
    prefix: no counterfactual slots)."""
    sums: Dict[str, Dict[str, List[float]]] = {}
    for r in rounds:
        for b in r.get("branches") or []:
            for x, accepted, k in reached_slots(b):
                cell = sums.setdefault(b["source"], {}).setdefault(DEPTH_LABELS[depth_bin(k)], [0, 0.0, 0])
                cell[0] += 1
                cell[1] += calibration.prob(b["source"], x, k, b.get("agree"))
                cell[2] += int(accepted)
    if not sums:
        return None
    out = {}
    for src, cells in sorted(sums.items()):
        cells = {"all": [sum(c[i] for c in cells.values()) for i in range(3)], **cells}
        out[src] = {lab: {"slots": n, "predicted": round(ps / n, 4), "observed": round(h / n, 4),
                          "ratio": round(h / ps, 4) if ps > 0 else None}
                    for lab, (n, ps, h) in cells.items()}
    return out


def model_context(strength) -> str:
    """The learned drafter's source for a round whose best token proposal has expected
    accepted length `strength` (None: no token proposal)."""
    if strength is None:
        return MODEL_ALONE
    return MODEL_BESIDE[sum(strength >= e for e in STRENGTH_EDGES)]


def token_strength(calibration: "Calibration", branches: Iterable) -> Optional[float]:
    """The largest expected accepted length among the token drafters' proposals
    (`branches`: objects or dicts with `source` and `feats`; the learned drafter's are
    skipped), None when there is none."""
    def get(b, k):
        return b[k] if isinstance(b, dict) else getattr(b, k)
    vals = [expected_accepted(calibration.slot_probs(get(b, "source"), get(b, "feats")))[-1]
            for b in branches if not get(b, "source").startswith("model")]
    return max(vals) if vals else None


def expected_accepted(slot_probs: Sequence[float]) -> List[float]:
    """E[accepted] of each prefix length 0..n: sum over k of prod_{j<=k} P(slot j)."""
    out, run, total = [0.0], 1.0, 0.0
    for p in slot_probs:
        run *= p
        total += run
        out.append(total)
    return out


@dataclasses.dataclass
class CostCurve:
    """cost(m): decode steps one verification of m tokens (anchor included) costs;
    `draft`: decode steps one learned drafter's draft costs (what running it at all in
    a round costs, whatever is verified after)."""
    tokens: Tuple[int, ...] = (1, 2, 4, 8)
    costs: Tuple[float, ...] = (1.0, 1.4, 1.6, 2.2)
    draft: float = 0.0

    def __call__(self, m: int) -> float:
        t, c = self.tokens, self.costs
        if m <= t[0]:
            return c[0]
        for (t0, c0), (t1, c1) in zip(zip(t, c), zip(t[1:], c[1:])):
            if m <= t1:
                return c0 + (c1 - c0) * (m - t0) / (t1 - t0)
        slope = (c[-1] - c[-2]) / (t[-1] - t[-2]) if len(t) > 1 else 0.0
        return c[-1] + slope * (m - t[-1])  # beyond the last point: its last slope

    def at(self, position: int) -> "CostCurve":
        """One curve prices every context."""
        return self

    def value(self, expected: float, n: int) -> float:
        """Tokens per decode-step of cost: (accepted + the bonus) / cost(n + 1)."""
        return (1.0 + expected) / self(n + 1)

    def best_prefix(self, slot_probs: Sequence[float], drafted: bool = False) -> Tuple[int, float]:
        """(prefix length, its value) with the most tokens per unit of cost; `drafted`:
        the learned drafter's draft cost counted too (deciding whether to run it)."""
        exp, extra = expected_accepted(slot_probs), self.draft if drafted else 0.0
        return max(((n, (1.0 + e) / (self(n + 1) + extra)) for n, e in enumerate(exp)), key=lambda kv: kv[1])


@dataclasses.dataclass
class CostTable:
    """Cost curves measured at increasing `contexts` (the same token counts in each);
    `at(position)`: the curve for a round whose anchor is there, every point and the
    draft cost linear in the context between the two measured around it, the nearest
    one's outside them."""
    contexts: Tuple[int, ...]
    curves: Tuple[CostCurve, ...]

    def __post_init__(self):
        if not self.contexts or len(self.contexts) != len(self.curves):
            raise ValueError(f"one curve per context, got {len(self.curves)} for {self.contexts}")
        if list(self.contexts) != sorted(set(self.contexts)):
            raise ValueError(f"contexts must increase, got {self.contexts}")
        if len({c.tokens for c in self.curves}) != 1:
            raise ValueError("every curve must be measured at the same token counts")

    def at(self, position: int) -> CostCurve:
        c = self.contexts
        i = bisect.bisect_right(c, position)  # c[i - 1] <= position < c[i]
        if i == 0 or i == len(c):
            return self.curves[0 if i == 0 else -1]
        a, b, w = self.curves[i - 1], self.curves[i], (position - c[i - 1]) / (c[i] - c[i - 1])
        return CostCurve(a.tokens, tuple(x + (y - x) * w for x, y in zip(a.costs, b.costs)),
                         a.draft + (b.draft - a.draft) * w)
