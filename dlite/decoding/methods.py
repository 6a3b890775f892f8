"""The decoding methods an evaluation compares, built from the `eval` config section:
the learned drafters it is given, the training-free baselines (`eval.baselines`:
`prompt_lookup`, `suffix`) and hybrids of a history-free drafter with one of them
(`eval.hybrids`: `hybrid_lookup`, `hybrid_suffix`: the lookup's proposal when its match
is >= `eval.hybrid_min_match` tokens, else the drafter's block; `hybrid_*_choose`: the
proposal with the most expected tokens per unit of verification cost; `hybrid_*_tree`:
all verified as one token tree of at most `eval.tree_budget` tokens -- see
`dlite.decoding.hybrid`; `hybrid_lookup_suffix_*`: both token drafters beside the
learned one; `hybrid_free_*`: both without it -- the same rules, no learned drafter to
run or pair with). The choose / tree hybrids score proposals with a
`Calibration` (fitted on validation turns by the evaluation, else the defaults) and the
verify-cost curve measured with the calibration (`eval.measure_verify_cost`), else
`eval.verify_cost_tokens` -> `eval.verify_cost`.

Each method is a builder: `build() -> drafter or factory prompt_ids -> drafter`. A
builder is called once per replay, so SuffixDecoding's global tree of earlier outputs
starts empty for every (method, temperature) replay and only ever holds outputs of
turns replayed before the current one.

`eval.context_vocab`: also the primary drafter over a per-request vocabulary (its
static draft vocabulary | the prompt's tokens, `dlite.decoding.context_vocab`), named
`<primary>_ctxvocab` and listed right after the learned drafters."""

import functools
from typing import Callable, Dict, Optional

from dlite.config_schema import FREE_HYBRIDS, HYBRIDS
from dlite.decoding.calibrate import cost_curve
from dlite.decoding.calibration import Calibration
from dlite.decoding.context_vocab import ContextVocab
from dlite.decoding.hybrid import ChooseHybrid, TreeHybrid
from dlite.decoding.lookup import HybridDrafter, PromptLookupDrafter


def context_vocab_name(primary: str) -> str:
    """The per-request-vocabulary method's name (MLflow metric names allow no '+')."""
    return f"{primary}_ctxvocab"


def _lookup(ev, vocab_size: int, gamma: int):
    lk = ev.lookup
    return functools.partial(PromptLookupDrafter, vocab_size=vocab_size, gamma=gamma,
                             max_ngram=lk.max_ngram, min_ngram=lk.min_ngram, prefer=lk.prefer)


def _suffix(ev, vocab_size: int, gamma: int):
    from dlite.decoding.suffix import SuffixDecoding  # needs the native module
    sx = ev.suffix
    return SuffixDecoding(vocab_size, gamma=gamma, max_tree_depth=sx.max_tree_depth,
                          max_spec_factor=sx.max_spec_factor, max_spec_offset=sx.max_spec_offset,
                          min_token_prob=sx.min_token_prob, global_tree=sx.global_tree)


_TOKEN_DRAFTERS = {"prompt_lookup": _lookup, "suffix": _suffix}


def token_gammas(ev, primary=None) -> tuple:
    """(tokens a training-free method may propose alone, inside a hybrid):
    `eval.lookup_gamma` (default: the primary drafter's gamma, else 7) and
    `eval.hybrid_gamma` (default: the first)."""
    alone = ev.lookup_gamma or (primary.gamma if primary is not None else 7)
    return alone, ev.hybrid_gamma or alone


def hybrid_rule(name: str) -> str:
    """`match` (hybrid_lookup / hybrid_suffix), `choose` or `tree`, from the name."""
    return name.rsplit("_", 1)[1] if name.endswith(("_choose", "_tree")) else "match"


def hybrid_maker(ev, name: str, calibration: Optional[dict] = None) -> Callable:
    """(model, token drafters) -> the hybrid `name` names, with eval's settings and the
    calibration (`Calibration.to_dict()`, its measured cost curve with it)."""
    rule = hybrid_rule(name)
    cost = cost_curve(ev, calibration)
    calibration = Calibration.from_dict(calibration)
    if rule == "choose":
        return lambda model, lks: ChooseHybrid(model, lks, calibration, cost)
    if rule == "tree":
        return lambda model, lks: TreeHybrid(model, lks, calibration, cost, ev.tree_budget)
    return lambda model, lks: HybridDrafter(model, lks[0], ev.hybrid_min_match)


def _hybrid(model, token_factories: list, make_one: Callable):
    """Factory prompt_ids -> hybrid sharing the token factories' state (a suffix cache's
    global tree) across prompts."""
    def make(prompt_ids):
        return make_one(model, [f(prompt_ids) for f in token_factories])
    if any(hasattr(f, "fork") for f in token_factories):
        make.fork = lambda: _hybrid(model, [f.fork() if hasattr(f, "fork") else f for f in token_factories],
                                    make_one)
    return make


def _context_vocab(learned: Dict[str, object]) -> Dict[str, Callable]:
    """{<primary>_ctxvocab: builder of the per-request factory}; refused here, before
    any replay, when the primary drafter cannot take a per-request vocabulary."""
    if not learned:
        raise ValueError("eval.context_vocab: needs a learned drafter whose vocabulary to extend")
    name, primary = next(iter(learned.items()))
    try:
        factory = ContextVocab(primary)
    except ValueError as e:
        raise ValueError(f"eval.context_vocab: primary drafter {name!r}: {e}") from e
    return {context_vocab_name(name): lambda: factory}


def method_builders(ev, learned: Dict[str, object], vocab_size: int,
                    calibration: Optional[dict] = None) -> Dict[str, Callable]:
    """{name: builder} for the learned drafters (given, already loaded), then
    `<primary>_ctxvocab` when eval.context_vocab, then the baselines, then the hybrids
    (each over the primary -- first -- learned drafter).
    Training-free drafters propose up to `eval.lookup_gamma` tokens (default: the
    primary drafter's gamma), inside a hybrid up to `eval.hybrid_gamma` (default: the
    same; `token_gammas`). The learned drafters get the evaluation's inference
    setting `eval.draft_stop_prob` here, the one place that turns `eval` into methods.
    `calibration`: `Calibration.to_dict()` of a fit on validation turns (None: defaults)."""
    for d in learned.values():
        d.draft_stop_prob = ev.draft_stop_prob
    primary = next(iter(learned.values()), None)
    gamma, hybrid_gamma = token_gammas(ev, primary)
    out = {name: (lambda d=d: d) for name, d in learned.items()}
    if ev.context_vocab:
        out.update(_context_vocab(learned))
    for name in ev.baselines:
        out[name] = functools.partial(_TOKEN_DRAFTERS[name], ev, vocab_size, gamma)
    for name in ev.hybrids:
        model = None if name in FREE_HYBRIDS else primary
        if model is None and name not in FREE_HYBRIDS:
            raise ValueError(f"eval.hybrids: {name} needs a learned drafter to pair with")
        makers, one = [_TOKEN_DRAFTERS[m] for m in HYBRIDS[name]], hybrid_maker(ev, name, calibration)
        out[name] = lambda makers=makers, one=one, model=model: _hybrid(
            model, [m(ev, vocab_size, hybrid_gamma) for m in makers], one)
    return out
