"""Hybrids that are never worse than their best part: a history-free learned drafter
beside one or more token-reading ones (prompt lookup, SuffixDecoding, or both), per
round either

- `ChooseHybrid`: the proposal (and the prefix of it) with the most expected tokens per
  unit of verification cost, `(1 + E[accepted]) / cost(n + 1)`, from each proposer's
  calibrated per-slot confidence (`dlite.decoding.calibration`); the learned drafter is
  not even run when the token proposals -- or, without any, a plain target step --
  are worth more than its typical block (its draft cost counted) in validation rounds
  like this one (no token proposal, or a best one as weak or as strong), that block's
  acceptance corrected by what this request has seen of it so far (`model_factor`) --
  unless the calibration judges the token proposals by it: then it runs whenever there
  is one and the best is not a strong one, and each token proposal's first slot is
  scored by how likely the learned drafter finds its first token (`calibration.Judge`);
- `TreeHybrid`: every proposal (SuffixDecoding: every branch of its own tree) verified
  in one forward as a token tree (`dlite.decoding.tree`; the learned drafter joins by
  the same rule), the nodes kept within
  `budget` tokens chosen the same way: the most valuable first (a node's value is its
  expected chance of being accepted, siblings sharing their parent's, since the target
  accepts one of them at most), as many as maximise tokens per unit of cost.

Without a learned drafter (`model` None: `hybrid_free_*`, token drafters only) the same
rules choose among the token proposals and a plain step, and the target computes no
features for it: what the learned drafter adds to a hybrid is the difference between
`hybrid_lookup_suffix_*` and `hybrid_free_*` on the same turns.

Cost is priced per round at the round's anchor position (`CostTable.at`, a curve
measured at several contexts): a plain step is cheaper on a short history while a
history-free draft costs the same everywhere, so a draft worth its time at 4K tokens
may not be at 600.

Exactness at T > 0: what is verified may depend on deterministic proposals and on
numbers fixed before the learned drafter draws anything (its first slot's largest
probability), never on its draws (a block kept because its draws look likely no longer
follows q). Greedy decoding reads everything. Both are lossless either way; the round
records say which source the accepted tokens came from and, for trees, how far each
branch matched (the calibration's observations)."""

from typing import List, Optional, Sequence, Union

import torch

from dlite.decoding.calibration import (MODEL_ALONE, MODEL_BESIDE, STRENGTH_EDGES, Calibration, CostCurve,
                                        CostTable, model_context, token_strength)
from dlite.decoding.lookup import token_block
from dlite.decoding.tree import Branch, branch_matches
from dlite.models.common import recording_confidences


ONLINE_PRIOR = 2.0  # the calibration's prediction, worth this many accepted tokens


def _source(lookup) -> str:
    return getattr(lookup, "source", "lookup")


class _Proposers:
    """The proposers of one prompt (the learned drafter and each token drafter, with
    its own accepted-sequence state) and how their proposals are scored."""

    def __init__(self, model, lookups, calibration: Optional[Calibration] = None,
                 cost: Union[CostCurve, CostTable, None] = None, skip_model: bool = True,
                 online_prior: Optional[float] = ONLINE_PRIOR):
        if model is not None and model.needs_history:
            raise ValueError("the hybrid needs a history-free drafter: one with a history "
                             "cache would miss the positions of the rounds lookup drafts")
        self.lookups = list(lookups) if isinstance(lookups, (list, tuple)) else [lookups]
        sources = [_source(lk) for lk in self.lookups]
        if not sources or len(set(sources)) != len(sources):
            raise ValueError(f"a hybrid takes one token drafter per source, got {sources}")
        self.model, self.skip_model, self.online_prior = model, skip_model, online_prior
        self.calibration, self.costs = calibration or Calibration(), cost or CostCurve()
        # The curve pricing the current round (`priced_at`: the one at its anchor).
        self.cost = self.costs.at(0)
        # The learned drafter's typical block: fixed by the calibration, read every round;
        # and in rounds like the one it is in (no token proposal, or a weak, fair or
        # strong one), the typical block of such rounds where they were fitted apart
        # (`calibrate.round_branches`), else the same.
        model_gamma = model.gamma if model is not None else 0
        self.typical = self.calibration.typical_probs("model", model_gamma)
        self.typical_in = {c: self.calibration.typical_probs(c, model_gamma)
                           for c in (MODEL_ALONE, *MODEL_BESIDE) if self.calibration.fitted(c)}
        self.vocab_size = self.lookups[0].vocab_size
        self.gamma = max(model_gamma, *(lk.gamma for lk in self.lookups))
        # no learned drafter: no target features to compute for it
        self.target_layer_ids = model.target_layer_ids if model is not None else []
        self.needs_history = False

    def new_state(self):
        # online, over this request: `hits` (tokens of the learned drafter accepted) and
        # `expected` (tokens the calibration expected on the same slots) over its
        # verified blocks; `sure` (calibrated acceptance of its drafted slots) and
        # `typical` (its typical block's on as many slots) over every block it drafted.
        online = dict(hits=0.0, expected=0.0, sure=0.0, typical=0.0)
        model = self.model.new_state() if self.model is not None else None
        return dict(seq=[lk.new_state() for lk in self.lookups], model=model, source=[],
                    online=online, pending=None, ran=False, first=None)

    def priced_at(self, anchor_pos: int) -> None:
        """Price this round by the cost curve at its anchor's position: the learned
        drafter's draft is a larger share of a decode step on a short history."""
        self.cost = self.costs.at(anchor_pos)

    def token_branches(self, state, anchor_id: int, anchor_pos: int, tree_nodes: int = 0) -> List[Branch]:
        """Every token drafter's proposal(s), each with its per-slot confidence features
        (every drafter's sequence advances to the anchor, proposing or not);
        `tree_nodes` > 0: SuffixDecoding's speculation tree of up to that many nodes."""
        out = []
        for lk, seq in zip(self.lookups, state["seq"]):
            if _source(lk) == "suffix":
                out += [Branch(t, None, "suffix", f) for t, f in lk.propose_branches(
                    seq, anchor_id, anchor_pos, tree_nodes > 0, tree_nodes or None)]
                continue
            tokens, n = lk.propose(seq, anchor_id, anchor_pos)
            out += [Branch(tokens, None, "lookup", [float(n)] * len(tokens))] if tokens else []
        return out

    def drafted(self, state, tokens: List[int]) -> None:
        for seq in state["seq"]:
            seq.drafted(tokens)

    def model_branch(self, state, feats, anchor_id: int, anchor_pos: int, temperature: float,
                     generator) -> Branch:
        """The learned drafter's block; its features: each chosen token's probability at
        T = 0, the first slot's largest probability (fixed before any draw) at T > 0,
        for all gamma slots so that no choice depends on where it stopped early."""
        state["ran"] = True
        with recording_confidences() as conf:
            tokens, q, state["model"] = self.model.draft(state["model"], feats, anchor_id, anchor_pos,
                                                         temperature, generator)
        if temperature > 0:
            feats = [conf[0]["top"] if conf else 0.0] * self.model.gamma
        else:
            feats = [c["chosen"] for c in conf]
        state["online"]["sure"] += sum(self.calibration.slot_probs("model", feats))
        state["online"]["typical"] += sum(self.typical[: len(feats)])
        state["first"] = conf.first
        return Branch(tokens.tolist(), q, "model", feats)

    def judging(self, branches: Sequence[Branch]) -> bool:
        """Whether the learned drafter must run to judge these token proposals: the
        calibration scores some of their sources' first slot by its agreement, and the
        best of them is not a strong one (`STRENGTH_EDGES`). A long sure copy is left
        alone: judging every round cost the 4K-8K turns' copies 3.5% (modelled from the
        rounds, stop 52) for verdicts that rarely changed them."""
        tokens = [b for b in branches if b.source != "model"]
        if self.model is None or not any(self.calibration.judged(b.source) for b in tokens):
            return False
        return token_strength(self.calibration, tokens) < STRENGTH_EDGES[-1]

    def judge(self, state, branches: Sequence[Branch]) -> None:
        """Each token proposal gets the learned drafter's probability of its first token
        (`Branch.agree`), from the distribution of this round's draft (fixed before
        anything was drawn, so choices that read it stay exact at T > 0)."""
        first = state.get("first")
        for b in branches:
            if b.source != "model" and b.tokens and first is not None:
                b.agree = float(first[b.tokens[0]])

    def slot_probs(self, br: Branch, state=None) -> List[float]:
        """Calibrated P(slot k accepted | the slots before it); the learned drafter's
        scaled by this request's `model_factor` (`state` given)."""
        probs = self.calibration.slot_probs(br.source, br.feats, br.agree)
        return self._corrected(probs, state) if br.source == "model" else probs

    def _corrected(self, probs: Sequence[float], state) -> List[float]:
        f = self.model_factor(state) if state is not None else 1.0
        return [min(1.0, p * f) for p in probs]

    def model_factor(self, state) -> float:
        """This request's acceptance of the learned drafter over what the calibration
        predicted for the same slots, shrunk toward 1 by `ONLINE_PRIOR`: validation
        turns say how a drafter does on average, a request's own rounds say how it does
        on this history (an agent's file dumps, where copying wins, or free text, where
        the learned drafter does). `online_prior` None: always 1. Reads only rounds
        already verified, never this round's draws, so the choices it feeds stay exact
        at T > 0."""
        return self._shrunk(state["online"]["hits"], state["online"]["expected"])

    def confidence_factor(self, state) -> float:
        """How sure the learned drafter has been on this request over how sure it is on
        average (its drafted blocks' calibrated acceptance over its typical block's on
        as many slots), shrunk toward 1 by `online_prior`. Known from every block it
        drafted, even one the tree then cut, so a request where it only ever guesses
        stops paying its draft time before any of its blocks is verified. Reads
        numbers fixed before any draw (exact at T > 0)."""
        return self._shrunk(state["online"]["sure"], state["online"]["typical"])

    def _shrunk(self, seen: float, predicted: float) -> float:
        """seen / predicted with `online_prior` tokens of the prediction on both sides
        (None: the calibration alone, 1)."""
        if self.online_prior is None:
            return 1.0
        return (self.online_prior + seen) / (self.online_prior + predicted)

    def observe_model(self, state, br: Branch, matched: int) -> None:
        """One verified model block of which `matched` tokens held: slots
        0..min(matched, n - 1) were observed (the first miss included)."""
        probs = self.calibration.slot_probs("model", br.feats[: len(br.tokens)])
        seen = min(matched + 1, len(probs))
        state["online"]["hits"] += min(matched, seen)
        state["online"]["expected"] += sum(probs[:seen])

    def model_value(self, state=None, context: str = "model") -> float:
        """What running the learned drafter is worth before it drafts: the value of its
        typical block (the calibration's acceptance per depth, averaged over what the
        fit saw -- in rounds of `context` (`calibration.model_context`) where those
        were fitted apart, else over all; unfitted: as sure as it could be; corrected by
        this request's rounds when `state` is given), its draft cost counted."""
        typical = self._corrected(self.typical_in.get(context, self.typical), state)
        if state is not None:  # its typical block, as sure as it has been on this request
            typical = [min(1.0, p * self.confidence_factor(state)) for p in typical]
        return self.cost.best_prefix(typical, drafted=True)[1]

    def model_worth_running(self, token_value: Optional[float], state=None, branches=None) -> bool:
        """Run the learned drafter only where its typical block in rounds like this one
        (the token proposals `branches`: none, or how strong the best is; not given: the
        typical block over all rounds) beats the token proposals' value -- None: there
        are none, so beats a plain target step (a drafter whose best block is empty is
        not worth its draft time). Reads deterministic proposals, the calibration and
        past rounds only, so the choice never depends on a draw (exact at T > 0)."""
        if self.model is None:
            return False
        if not self.skip_model:
            return True
        floor = self.cost.value(0.0, 0) if token_value is None else token_value
        if token_value is None:
            context = MODEL_ALONE
        else:
            context = "model" if branches is None else model_context(token_strength(self.calibration, branches))
        return floor < self.model_value(state, context)

    def _online_info(self, state) -> dict:
        """For the round's record: whether the learned drafter ran, this request's factor."""
        return {"model_ran": state["ran"], "model_factor": round(self.model_factor(state), 4),
                "model_confidence": round(self.confidence_factor(state), 4)}

    def finish(self, state, new_tokens: List[int]) -> None:
        for lk, seq in zip(self.lookups, state["seq"]):
            if hasattr(lk, "finish"):  # SuffixDecoding indexes the whole response
                lk.finish(seq, new_tokens)

    def cache_bytes(self, state) -> int:
        return (self.model.cache_bytes(state["model"]) if self.model is not None else 0) + sum(
            lk.cache_bytes(seq) for lk, seq in zip(self.lookups, state["seq"]))


class ChooseHybrid(_Proposers):
    """Per round one proposal, the one worth most per unit of verification cost."""

    def draft(self, state, new_features, anchor_id: int, anchor_pos: int, temperature: float,
              generator: Optional[torch.Generator] = None):
        self._observe_last(state, anchor_pos)
        self.priced_at(anchor_pos)
        state["ran"], state["first"] = False, None
        tokens = self.token_branches(state, anchor_id, anchor_pos)
        options = [self._option(br) for br in tokens]
        # Skip the learned drafter (its draft time too) when it cannot win this round
        # and nothing is to be judged by it.
        if self.judging(tokens) or self.model_worth_running(max((o[0] for o in options), default=None), state,
                                                            tokens):
            br = self.model_branch(state, new_features, anchor_id, anchor_pos, temperature, generator)
            self.judge(state, tokens)
            options = [self._option(b) for b in tokens]
            n, v = self.cost.best_prefix(self.slot_probs(br, state))
            options.append((v, br, min(n, len(br.tokens))))
        # Ties: the first listed (token drafters in their order, the learned one last);
        # nothing worth verifying: a plain target step.
        v, br, n = max(options, key=lambda o: o[0], default=(0.0, Branch([], None, "none"), 0))
        br = br.cut(n)
        state["source"].append(br.source if n else "none")
        state["pending"] = (br, anchor_pos) if n and br.source == "model" else None
        self.drafted(state, br.tokens)
        if br.source == "model" and br.q is not None:
            return torch.tensor(br.tokens, dtype=torch.long), br.q, state
        return (*token_block(br.tokens, self.vocab_size, temperature), state)

    def _option(self, br: Branch) -> tuple:
        """(value, branch, prefix length) of a token proposal."""
        n, v = self.cost.best_prefix(self.slot_probs(br))
        return v, br, n

    def _observe_last(self, state, anchor_pos: int) -> None:
        """The last round's model block, if it was verified: the anchor moved past the
        accepted tokens and the target's own one."""
        if state["pending"] is not None:
            br, pos = state["pending"]
            self.observe_model(state, br, anchor_pos - pos - 1)
            state["pending"] = None

    def round_info(self, state) -> dict:
        return {"source": state["source"][-1], **self._online_info(state)}


class TreeHybrid(_Proposers):
    """Per round every proposal, as one token tree of at most `budget` draft tokens."""

    def __init__(self, model, lookup, calibration=None, cost=None, budget: int = 16, skip_model: bool = True,
                 online_prior: Optional[float] = ONLINE_PRIOR, exclusive: bool = True):
        super().__init__(model, lookup, calibration, cost, skip_model, online_prior)
        if budget < 1:
            raise ValueError(f"tree budget must be >= 1, got {budget}")
        # exclusive: siblings share their parent's chance (`_node_values`); off for the
        # calibration's unpruned trees, where every proposed node must be verified.
        self.budget, self.exclusive = budget, exclusive

    def draft_tree(self, state, new_features, anchor_id: int, anchor_pos: int, temperature: float,
                   generator: Optional[torch.Generator] = None) -> tuple:
        self.priced_at(anchor_pos)
        branches = self.token_branches(state, anchor_id, anchor_pos, tree_nodes=self.budget)
        sampled, state["ran"], state["first"] = temperature > 0, False, None
        # The learned drafter joins the tree only where it could add value or must judge
        # the token branches: skipped when they alone are worth more than any learned
        # block could be.
        token_value = self._allocate(branches, sampled, state)[1] if branches else None
        if self.judging(branches) or self.model_worth_running(token_value, state, branches):
            branches.append(self.model_branch(state, new_features, anchor_id, anchor_pos, temperature, generator))
            self.judge(state, branches)
        keep, _ = self._allocate(branches, sampled, state)
        return [b.cut(k) for b, k in zip(branches, keep) if k], state

    def _allocate(self, branches: List[Branch], sampled: bool, state=None) -> tuple:
        """(tokens kept per branch, the tree's value): nodes by value (`_node_values`),
        as many as maximise (1 + sum of values) / cost(N + 1)."""
        nodes = self._node_values(branches, sampled, state)
        order = sorted(nodes.items(), key=lambda kv: (-kv[1], len(kv[0]) if kv[0][0] != "model" else kv[0][1]))
        best_n, best_v, total = 0, self.cost.value(0.0, 0), 0.0
        for n, (_, v) in enumerate(order[: self.budget], start=1):
            total += v
            if self.cost.value(total, n) > best_v:
                best_n, best_v = n, self.cost.value(total, n)
        chosen = {key for key, _ in order[:best_n]}
        keep = []
        for br in branches:
            k = 0
            while k < len(br.tokens) and _node_key(br, k, sampled) in chosen:
                k += 1
            keep.append(k)
        return keep, best_v

    def _node_values(self, branches: List[Branch], sampled: bool, state=None) -> dict:
        """{node key: its chance of being accepted}: the product of calibrated slot
        probabilities to it (the largest over the branches through it), then made
        consistent across siblings. The target accepts one child of a node at most, so
        its children's chances cannot sum past the node's own: calibrated one proposer
        at a time, two disagreeing proposals at 0.8 each would otherwise be worth 1.6
        tokens where at most one can hold. Where they sum past it, they are scaled down
        in proportion (each keeps its share of the confidence; capping the second at
        what the first leaves, tried in stop 41, pruned second proposals that were
        right), and a node's scale carries to everything below it. Nodes are keyed by
        their path, so shared prefixes count once -- except the learned drafter's when
        sampling, whose tokens must not decide what is kept (its nodes are siblings of
        all others)."""
        raw, parent = {}, {}
        for br in branches:
            run = 1.0
            for k, p in enumerate(self.slot_probs(br, state)[: len(br.tokens)]):
                run *= p
                key = _node_key(br, k, sampled)
                raw[key] = max(raw.get(key, 0.0), run)
                parent[key] = _node_key(br, k - 1, sampled) if k else ()
        if not self.exclusive:
            return raw
        children: dict = {}
        for key in raw:
            children.setdefault(parent[key], []).append(key)
        value, scale, todo = {(): 1.0}, {(): 1.0}, [()]
        while todo:
            node = todo.pop()
            kids = children.get(node, ())
            total = sum(raw[k] * scale[node] for k in kids)
            cut = value[node] / total if total > value[node] else 1.0
            for key in kids:
                value[key] = raw[key] * scale[node] * cut
                scale[key] = scale[node] * cut
                todo.append(key)
        del value[()]
        return value

    def tree_verified(self, state, branches: List[Branch], emit: List[int]) -> tuple:
        """After verification: the sequence learns the accepted tokens; the record gets
        the source of the accepted path and each branch's match."""
        self.drafted(state, emit[:-1])
        matched = branch_matches(branches, emit)
        for b, m in zip(branches, matched):
            if b.source == "model":
                self.observe_model(state, b, m)
        best = max(matched, default=0)
        srcs = {b.source for b, m in zip(branches, matched) if m == best}
        source = "none" if best == 0 else (srcs.pop() if len(srcs) == 1 else "shared")
        state["source"].append(source)
        info = [{"source": b.source, "n": len(b.tokens), "matched": m, "feats": [round(x, 4) for x in b.feats],
                 **({"agree": round(b.agree, 6)} if b.agree is not None else {})}
                for b, m in zip(branches, matched)]
        return state, {"source": source, "branches": info, **self._online_info(state)}


def _node_key(br: Branch, k: int, sampled: bool) -> tuple:
    """Slot k of branch `br` as a tree node: its path of tokens, or (sampling) the
    learned drafter's slot, whose token must not decide what is kept."""
    return ("model", k) if sampled and br.source == "model" else tuple(br.tokens[: k + 1])
