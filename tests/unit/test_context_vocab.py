"""The per-request draft vocabulary (`dlite.decoding.context_vocab`, issue 20): its ids
are the static draft vocabulary | the prompt's tokens, gathered once per request; the
drafter stays lossless at T = 0 and exact at T = 1 (chi-square against the target;
a q spread without the per-request id map is caught); a model with nothing to extend
is refused; replay reports its coverage beside the static set's; `method_builders`
adds `<primary>_ctxvocab` only when eval.context_vocab asks for it."""

import dataclasses

import pytest
import torch
from omegaconf import OmegaConf

from dlite.config_schema import EvalConfig
from dlite.decoding.context_vocab import ContextVocab, ContextVocabDrafter
from dlite.decoding.decode import plain_generate, speculative_generate
from dlite.decoding.methods import method_builders
from dlite.decoding.replay import EvalArgs, _run_task, aggregate
from dlite.models import LEARNED_MASK, DrafterConfig, build_drafter, common
from tests.unit.test_spec_decode import PROMPTS, _pvalues, dlite_drafter, tiny_target

V = 128
STATIC = list(range(0, 120, 3))  # 40 of the 128 tokens: multiples of 3 below 120


@pytest.fixture(scope="module")
def target():
    return tiny_target(vocab=V)


def other_drafter(target, arch="dlite"):
    """A drafter without a draft vocabulary (dlite), or a DSpark one with it."""
    n = None if arch == "dlite" else len(STATIC)
    cfg = DrafterConfig(arch=arch, gamma=4, target_layer_ids=[0, 1], hidden_size=32, num_layers=1,
                        num_heads=2, num_kv_heads=1, head_dim=16, intermediate_size=64,
                        head_hidden=32, markov_rank=8, draft_vocab_size=n)
    return build_drafter(cfg, target.get_input_embeddings().weight.detach(), target.lm_head.weight.detach(),
                         LEARNED_MASK, None if n is None else torch.tensor(STATIC)).eval()


def test_ids_are_static_and_prompt_built_once_per_request(target, monkeypatch):
    model = dlite_drafter(target, STATIC)
    builds = []
    real = common.FrozenVocab.with_draft_ids
    monkeypatch.setattr(common.FrozenVocab, "with_draft_ids",
                        lambda self, ids: builds.append(ids) or real(self, ids))
    prompt = [5, 17, 99, 3, 42, 8, 61, 5]
    d = ContextVocab(model)(prompt)
    assert d.vocab is None and not builds  # nothing gathered until the first draft
    _, rounds = speculative_generate(target, d, prompt, 20)
    assert len(rounds) > 1 and len(builds) == 1  # once per request, not per round
    assert d.vocab.draft_ids.tolist() == sorted(set(STATIC) | set(prompt))
    # The view shares the model's frozen tensors and holds only its rows and id map.
    assert d.vocab.lm_head_weight is model.vocab.lm_head_weight and d.vocab.mask_embed is model.vocab.mask_embed
    assert torch.equal(d.vocab.out_weight, model.vocab.lm_head_weight[d.vocab.draft_ids])
    assert d.vocab.to_target(d.vocab.to_draft(torch.tensor(prompt))).tolist() == prompt
    assert rounds[0]["cache_bytes"] == d.vocab.nbytes() > 0  # per-request memory, counted
    assert ContextVocab(model)(prompt).vocab is None  # a new request, a new view


def test_greedy_is_lossless(target):
    factory = ContextVocab(dlite_drafter(target, STATIC))
    for prompt in PROMPTS:
        ref, _ = plain_generate(target, prompt, 30)
        out, rounds = speculative_generate(target, factory(prompt), prompt, 30)
        assert out == ref and rounds


@pytest.mark.parametrize("wrong_q", [False, True])
def test_sampling_is_exact(monkeypatch, wrong_q):
    """Static ids {0, 2, 5} | prompt {1, 2, 5, 7}: the drafter samples from 5 of 8
    tokens, its q renormalised over them. Spread without the per-request id map (draft
    index i reported as target id i) it is caught."""
    vocab, prompt = 8, [1, 5, 2, 7]
    model = tiny_target(vocab=vocab, init=0.1, seed=3)
    drafter = ContextVocab(dlite_drafter(model, [0, 2, 5], gamma=2, layers=(1,), seed=1))(prompt)
    if wrong_q:
        def unmapped(self, probs):
            return torch.nn.functional.pad(probs, (0, vocab - probs.shape[-1]))
        monkeypatch.setattr(common.DraftVocabView, "to_full", unmapped)
    pvals = _pvalues(model, drafter, prompt, vocab)
    assert drafter.vocab.draft_ids.tolist() == [0, 1, 2, 5, 7]
    assert (min(pvals) < 1e-3) if wrong_q else (min(pvals) > 1e-3)


def test_a_model_with_nothing_to_extend_is_refused(target):
    with pytest.raises(ValueError, match="no static draft vocabulary"):
        ContextVocab(other_drafter(target, "dlite"))
    with pytest.raises(ValueError, match="DSparkDrafter drafts over its static"):
        ContextVocab(other_drafter(target, "dspark"))


def test_coverage_counts_prompt_tokens_the_static_set_lacks(target):
    model = dlite_drafter(target, STATIC)
    prompt = [7, 9, 11]  # 7 and 11 are outside the static set
    d = ContextVocab(model)(prompt)
    assert d.vocab_coverage([7, 11, 9, 13]) == 0.75 and d.static_coverage([7, 11, 9, 13]) == 0.25
    assert d.vocab is None  # coverage needs only the ids, not the gathered rows
    a = EvalArgs(max_new_tokens=8, warmup=False)
    reports = {}
    for name, drafter in (("static", model), ("ctx", ContextVocab(model))):
        res = _run_task(target, drafter, {"id": "x", "turn": 0, "prompt_ids": prompt}, a, (), True, 0)
        reports[name] = aggregate([res], 0, a)
        assert res["spec_ids"] == res["plain_ids"]
    out = res["plain_ids"]
    assert reports["static"]["draft_vocab_coverage"] == model.vocab.coverage(out)
    assert reports["ctx"]["draft_vocab_coverage"] == d.vocab_coverage(out)
    assert reports["ctx"]["per_task"][0]["vocab_coverage"] == d.vocab_coverage(out)
    # Sampled replays report no coverage (the greedy output is the measured one).
    res = _run_task(target, model, {"id": "x", "turn": 0, "prompt_ids": prompt},
                    dataclasses.replace(a, temperature=1.0), (), True, 0)
    assert aggregate([res], 0, dataclasses.replace(a, temperature=1.0))["draft_vocab_coverage"] is None


def test_method_builders_add_ctxvocab_only_when_asked(target):
    model = dlite_drafter(target, STATIC)
    off = method_builders(OmegaConf.structured(EvalConfig(baselines=["prompt_lookup"])), {"dlite": model}, V)
    assert list(off) == ["dlite", "prompt_lookup"]
    ev = OmegaConf.structured(EvalConfig(context_vocab=True, baselines=["prompt_lookup"]))
    on = method_builders(ev, {"dlite": model, "dspark": other_drafter(target, "dspark")}, V)
    assert list(on) == ["dlite", "dspark", "dlite_ctxvocab", "prompt_lookup"]
    d = on["dlite_ctxvocab"]()([7, 9])
    assert isinstance(d, ContextVocabDrafter) and d.model is model and d.gamma == model.gamma
    with pytest.raises(ValueError, match="eval.context_vocab"):
        method_builders(ev, {}, V)
    with pytest.raises(ValueError, match="eval.context_vocab.*no static draft vocabulary"):
        method_builders(ev, {"dlite": other_drafter(target, "dlite")}, V)
