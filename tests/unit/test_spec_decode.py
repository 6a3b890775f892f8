"""Speculative decoding over a tiny random-weight Qwen3 target: greedy output is
token-identical to plain decoding (random, oracle and half-right drafters, and a
DLite drafter over a draft vocabulary; EOS and token-budget edges) and each round's
record matches its drafts and the plain output, cache cropping is exact, sampled
output follows the target's distribution (and the same test catches a wrong residual;
also with a restricted-vocabulary drafter), the oracle reaches tau = γ+1, hooks
capture exactly the configured layers, and replay grows histories."""

import json

import pytest
import torch
from scipy.stats import chisquare
from transformers import Qwen3Config, Qwen3ForCausalLM

from dlite.decoding import decode, ties, verify
from dlite.decoding.capture import LayerCapture
from dlite.decoding.decode import crop_cache, new_cache, plain_generate, speculative_generate, target_forward
from dlite.decoding.metrics import accept_at_k, tau
from dlite.decoding.oracle import RandomDrafter, TargetAsDrafter
from dlite.decoding.replay import EvalArgs, _run_task, aggregate, evaluate_prompts, iter_tasks

GAMMA = 4



def tiny_target(vocab=128, layers=2, init=0.5, seed=0):
    """A wide initializer spreads the logits, so argmax near-ties (which a 1-token and a
    block forward could round differently) do not occur."""
    torch.manual_seed(seed)
    cfg = Qwen3Config(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                      max_position_embeddings=1024, initializer_range=init, tie_word_embeddings=False)
    return Qwen3ForCausalLM(cfg).eval()


@pytest.fixture(scope="module")
def target():
    return tiny_target()


PROMPTS = [[5, 17, 99, 3, 42, 8, 61], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13], [77, 21]]


class HalfRightDrafter(TargetAsDrafter):
    """The oracle with slot (anchor_pos // γ) % γ of each block wrong: exactly that many
    drafts pass, and as the anchor moves on every count 0..γ-1 occurs."""

    def draft(self, state, feats, anchor_id, anchor_pos, temperature, generator=None):
        tokens, probs, state = super().draft(state, feats, anchor_id, anchor_pos, temperature, generator)
        k = (anchor_pos // self.gamma) % self.gamma
        tokens = tokens.clone()
        tokens[k] = (tokens[k] + 1) % probs.shape[-1]
        return tokens, probs, state


DRAFTERS = {
    "random": lambda t, p: RandomDrafter(t, GAMMA, target_layer_ids=[0, 1]),
    "oracle": lambda t, p: TargetAsDrafter(t, p, GAMMA),
    "half_right": lambda t, p: HalfRightDrafter(t, p, GAMMA),
}


def test_hooks_capture_exactly_the_configured_layers():
    model = tiny_target(layers=3)
    ids = torch.tensor([[4, 8, 15, 16, 23, 42]])
    with torch.inference_mode(), LayerCapture(model, [0, 2]) as cap:
        assert [len(l._forward_hooks) for l in model.model.layers] == [1, 0, 1]
        hs = model(input_ids=ids, output_hidden_states=True).hidden_states
        feats = cap.features()
        assert feats.shape == (6, 128)
        assert torch.allclose(feats[:, :64], hs[1][0])
        # HF's last hidden state is post-norm; the hook sees the raw layer output.
        assert torch.allclose(model.model.norm(feats[:, 64:]), hs[-1][0], atol=1e-5)
        cap.last_only = True
        model(input_ids=ids)
        assert torch.allclose(cap.features(), feats[-1:])
        inside = [len(l._forward_hooks) for l in model.model.layers]  # HF may add its own
    assert [len(l._forward_hooks) for l in model.model.layers] == [n - m for n, m in zip(inside, [1, 0, 1])]


def test_cropped_cache_matches_a_fresh_forward(target):
    prompt, block = torch.tensor(PROMPTS[0]), torch.tensor([9, 10, 11, 12, 13])
    with torch.inference_mode():
        cache = new_cache(target)
        target_forward(target, prompt, 0, cache)
        target_forward(target, block, len(prompt), cache)
        crop_cache(cache, len(prompt) + 2)
        assert cache.get_seq_length() == len(prompt) + 2
        nxt = target_forward(target, torch.tensor([50]), len(prompt) + 2, cache)[-1]
        full = torch.cat([prompt, block[:2], torch.tensor([50])])
        fresh = target_forward(target, full, 0, new_cache(target))[-1]
    assert torch.allclose(nxt, fresh, atol=1e-5)


class Recorded:
    """A drafter whose drafts are kept, so each round's accepted count can be recomputed."""

    def __init__(self, inner):
        self.inner, self.drafts = inner, []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def draft(self, *args, **kw):
        tokens, probs, state = self.inner.draft(*args, **kw)
        self.drafts.append(tokens.tolist())
        return tokens, probs, state


@pytest.mark.parametrize("name", DRAFTERS)
def test_greedy_is_lossless_and_rounds_add_up(target, name):
    """Output equals plain decoding, and every round record is what it claims: its
    accepted count is the length of its drafts' agreement with the plain output after
    the anchor, the next round starts right after it, and the emitted tokens add up."""
    for prompt in PROMPTS:
        longer, _ = plain_generate(target, prompt, 30 + GAMMA + 1)  # the last round sees past 30
        drafter = Recorded(DRAFTERS[name](target, prompt))
        out, rounds = speculative_generate(target, drafter, prompt, 30)
        assert out == longer[:30]
        t = len(prompt)
        for r, d in zip(rounds, drafter.drafts, strict=True):
            n = t - len(prompt)                                  # out[n] is the anchor
            agree = next((j for j in range(len(d)) if d[j] != longer[n + 1 + j]), len(d))
            assert (r["context_len"], r["accepted"]) == (t, agree)
            t += agree + 1
        assert [r["emitted"] for r in rounds[:-1]] == [r["accepted"] + 1 for r in rounds[:-1]]
        assert sum(r["emitted"] for r in rounds) == len(out) - 1  # the prefill's token is no round
        # tau = 1 + sum_k P(a >= k), and P(a >= k) is the product of the conditional rates
        rates = torch.tensor([a or 0.0 for a in accept_at_k(rounds, GAMMA)], dtype=torch.float64)
        assert tau(rounds) == pytest.approx(1 + rates.cumprod(0).sum().item())
        if name == "oracle":
            assert tau(rounds) == GAMMA + 1 and accept_at_k(rounds, GAMMA) == [1.0] * GAMMA
        if name == "half_right":
            got = [r["accepted"] for r in rounds]
            assert got == [(r["context_len"] // GAMMA) % GAMMA for r in rounds]
            assert set(got) == set(range(GAMMA))


def test_a_broken_crop_breaks_losslessness(target, monkeypatch):
    """The lossless test has teeth: leaving rejected drafts in the cache is caught."""
    prompt = PROMPTS[0]
    ref, _ = plain_generate(target, prompt, 30)
    monkeypatch.setattr(decode, "crop_cache", lambda cache, length: None)
    out, _ = speculative_generate(target, DRAFTERS["random"](target, prompt), prompt, 30)
    assert out != ref
    # fp32: the tie rule is effectively strict, so evaluation's two verdicts agree.
    a = EvalArgs(max_new_tokens=30, buckets=(1024,))
    res = _run_task(target, DRAFTERS["random"](target, prompt), {"id": 0, "turn": 0, "prompt_ids": prompt},
                    a, [], True, 0)
    assert res["divergence"] and not res["divergence"]["tie"]
    report = aggregate([res], 0, a)
    assert report["lossless"] is False and report["lossless_up_to_ties"] is False
    assert ties.lossless_verdict(report, "float32") is False


@pytest.mark.parametrize("name", ["random", "oracle"])
def test_budget_and_eos_edges(target, name):
    prompt = PROMPTS[1]
    ref, _ = plain_generate(target, prompt, 24)
    for n in (0, 1, 2, GAMMA, GAMMA + 1, GAMMA + 2, 24):
        out, _ = speculative_generate(target, DRAFTERS[name](target, prompt), prompt, n)
        assert out == ref[:n]
    for k in (0, 2, 6, 11):  # EOS as the prefill token, inside and at the end of blocks
        eos = ref[k]
        plain, _ = plain_generate(target, prompt, 24, eos_ids=[eos])
        out, _ = speculative_generate(target, DRAFTERS[name](target, prompt), prompt, 24, eos_ids=[eos])
        assert out == plain == ref[: ref.index(eos) + 1]


def _exact_two_tokens(model, prompt, vocab):
    """Exact target distributions: joint of tokens 1-2, marginal of token 3 (T=1)."""
    with torch.inference_mode():
        p1 = torch.softmax(model(input_ids=torch.tensor([prompt])).logits[0, -1].float(), -1)
        ctx = torch.tensor([prompt + [a, b] for a in range(vocab) for b in range(vocab)])
        logits = model(input_ids=ctx).logits.float()
        p2 = torch.softmax(logits[::vocab, -2], -1)         # [a, b] = p(b | a)
        p3 = torch.softmax(logits[:, -1], -1).view(vocab, vocab, vocab)
    joint = p1[:, None] * p2
    return joint.flatten(), (joint[..., None] * p3).sum((0, 1))


def _sampled_counts(model, drafter, prompt, vocab, n):
    g = torch.Generator().manual_seed(123)
    joint, third = torch.zeros(vocab * vocab), torch.zeros(vocab)
    for _ in range(n):
        out, _ = speculative_generate(model, drafter, prompt, 3, temperature=1.0, generator=g)
        joint[out[0] * vocab + out[1]] += 1
        third[out[2]] += 1
    return joint, third


def _pvalue(counts, probs):
    """Chi-square with cells of expected count < 5 pooled (so the test stays valid)."""
    exp = probs * counts.sum()
    small = exp < 5
    obs_c, exp_c = counts[~small].tolist(), exp[~small].tolist()
    if small.any():
        obs_c.append(float(counts[small].sum()))
        exp_c.append(float(exp[small].sum()))
    exp_c = [e * sum(obs_c) / sum(exp_c) for e in exp_c]  # renormalise float drift
    return chisquare(obs_c, exp_c).pvalue


def _pvalues(model, drafter, prompt, vocab, n=400) -> tuple:
    """Chi-square p-values of n sampled (first two tokens, third token) against the
    target's exact distributions."""
    joint, third = _sampled_counts(model, drafter, prompt, vocab, n)
    exact_joint, exact_third = _exact_two_tokens(model, prompt, vocab)
    return _pvalue(joint, exact_joint), _pvalue(third, exact_third)


@pytest.mark.parametrize("wrong_residual", [False, True])
def test_sampling_follows_the_target_distribution(monkeypatch, wrong_residual):
    vocab, prompt = 8, [1, 5, 2, 7]
    model = tiny_target(vocab=vocab, init=0.1, seed=3)
    drafter = RandomDrafter(model, gamma=2, target_layer_ids=[1], seed=1, scale=4.0)
    if wrong_residual:
        monkeypatch.setattr(verify, "residual_distribution", lambda p, q: q)
    pvals = _pvalues(model, drafter, prompt, vocab)
    if wrong_residual:
        assert min(pvals) < 1e-6
    else:
        assert min(pvals) > 1e-3


def dlite_drafter(target, draft_ids, gamma=GAMMA, layers=(0, 1), seed=0):
    """A random-weight DLite drafter over a draft vocabulary, with a learned MASK (the
    tiny target has no spare embedding row): what a SmolLM2 drafter looks like."""
    from dlite.models import LEARNED_MASK, DrafterConfig, build_drafter
    cfg = DrafterConfig(gamma=gamma, target_layer_ids=list(layers), hidden_size=32, num_layers=1,
                        num_heads=2, num_kv_heads=1, head_dim=16, intermediate_size=64,
                        head_hidden=32, draft_vocab_size=len(draft_ids))
    torch.manual_seed(seed)
    return build_drafter(cfg, target.get_input_embeddings().weight.detach(),
                         target.lm_head.weight.detach(), LEARNED_MASK, torch.tensor(draft_ids)).eval()


def test_greedy_is_lossless_with_a_draft_vocabulary(target):
    """Drafts come from 40 of the 128 tokens (and the plain output uses others), yet
    the output is the plain output, token for token."""
    drafter = dlite_drafter(target, list(range(0, 120, 3)))
    for prompt in PROMPTS:
        ref, _ = plain_generate(target, prompt, 30)
        out, rounds = speculative_generate(target, drafter, prompt, 30)
        assert out == ref and rounds and any(t % 3 for t in ref)


@pytest.mark.parametrize("wrong_q", [False, True])
def test_sampling_is_exact_with_a_draft_vocabulary(monkeypatch, wrong_q):
    """A drafter restricted to 5 of 8 tokens: its q (renormalised over the 5, zero
    elsewhere) keeps the rejection rule exact, so sampled output follows the target's
    distribution, including the 3 tokens it can never propose. The test has teeth: q
    spread over the target's vocabulary without the id map (draft index i reported as
    target id i, not draft_ids[i]) is caught."""
    vocab, prompt = 8, [1, 5, 2, 7]
    model = tiny_target(vocab=vocab, init=0.1, seed=3)
    drafter = dlite_drafter(model, [0, 2, 3, 5, 6], gamma=2, layers=(1,), seed=1)
    if wrong_q:
        from dlite.models import common

        def unmapped(self, probs):
            return torch.nn.functional.pad(probs, (0, vocab - probs.shape[-1]))
        monkeypatch.setattr(common.FrozenVocab, "to_full", unmapped)
    pvals = _pvalues(model, drafter, prompt, vocab)
    if wrong_q:
        assert min(pvals) < 1e-3
    else:
        assert min(pvals) > 1e-3


TRAJ = {"id": "t1", "tools": [{"type": "function", "function": {"name": "read", "parameters": {}}}],
        "messages": [
            {"role": "system", "content": "You fix bugs."},
            {"role": "user", "content": "Fix foo."},
            {"role": "assistant", "content": "Reading.", "tool_calls": [
                {"type": "function", "function": {"name": "read", "arguments": "{\"path\": \"a.py\"}"}}]},
            {"role": "tool", "content": "def foo(): return 1"},
            {"role": "assistant", "content": "Done."}]}


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from dlite.tiny.tokenizer import train_tokenizer
    texts = [m["content"] for m in TRAJ["messages"]] + ["assistant user system tool_call read"]
    return train_tokenizer(texts, 300, tmp_path_factory.mktemp("tok"))


def test_replay_grows_histories_and_reports(tokenizer):
    tasks = list(iter_tasks(tokenizer, TRAJ))
    texts = [tokenizer.decode(t["prompt_ids"]) for t in tasks]
    assert [t["turn"] for t in tasks] == [0, 1] and len(tasks[0]["prompt_ids"]) < len(tasks[1]["prompt_ids"])
    assert texts[1].startswith(texts[0]) and "def foo(): return 1" in texts[1] and "Reading." in texts[1]
    assert texts[1].endswith("<|im_start|>assistant\n") and "# Tools" in texts[0]

    model = tiny_target(vocab=len(tokenizer))
    records = [TRAJ, {"turns": ["Say hi.", "Again."]}]
    report = evaluate_prompts(model, tokenizer, lambda ids: TargetAsDrafter(model, ids, GAMMA),
                              records, {"max_new_tokens": 6, "buckets": [16, 64]})
    for key in ("tau", "accept_at_k", "tau_by_bucket", "accept_at_k_by_bucket", "speedup_vs_ar",
                "tokens_per_s", "time_split", "lossless"):
        assert key in report
    assert report["lossless"] is True and report["tau"] == GAMMA + 1 and report["n_tasks"] == 4
    assert report["lossless_up_to_ties"] is True and report["n_tie_divergences"] == 0
    assert all(t["divergence"] is None for t in report["per_task"])
    turns = [t for t in report["per_task"] if t["id"] is None]
    assert turns[0]["context_len"] < turns[1]["context_len"]  # 2nd turn holds the 1st reply
    assert set(report["tau_by_bucket"]) <= {"<16", "16-64", ">64"}
    json.dumps(report)  # the report is written as JSON as is


def test_prefill_features_slice_like_a_capture_of_their_own():
    model = tiny_target(layers=3)
    ids = [4, 8, 15, 16, 23, 42]
    pre = decode.prefill(model, ids, [2, 0], all_rows=True)
    with torch.inference_mode(), LayerCapture(model, [2, 0]) as cap:
        model(input_ids=torch.tensor([ids]))
        own = cap.features()
    assert pre.layer_ids == (0, 2) and pre.t == len(ids) and pre.ms > 0
    assert torch.equal(pre.features([2, 0], True), own)  # the drafter's own layer order
    assert torch.equal(pre.features([0], False), own[-1:, 64:])
    last = decode.prefill(model, ids, [0, 2])
    assert last.feats.shape == (1, 128)
    with pytest.raises(ValueError, match="every position"):
        last.features([0], True)
    with pytest.raises(ValueError, match=r"not \[1\]"):
        pre.features([1], False)


def test_shared_prefill_changes_no_token_and_runs_once_per_history(tokenizer, monkeypatch):
    """replay_methods: every method and temperature from one prefill per history gives the
    tokens, rounds and plain outputs each method gets from a prefill of its own; untimed
    (shared plain) and timed give the same tokens too."""
    from dlite.decoding import replay as replay_mod
    model = tiny_target(vocab=len(tokenizer))
    builders = {"oracle": lambda: (lambda ids: TargetAsDrafter(model, ids, GAMMA)),   # history, last layer
                "random": lambda: RandomDrafter(model, GAMMA, target_layer_ids=[0, 1]),
                "half": lambda: (lambda ids: HalfRightDrafter(model, ids, GAMMA))}
    args = {"max_new_tokens": 10, "buckets": [16, 64]}
    prompt_lens = []

    def counted(target, ids, *a, **kw):  # the real prefill, counted
        prompt_lens.append(len(ids))
        return decode.prefill(target, ids, *a, **kw)
    monkeypatch.setattr(replay_mod, "prefill", counted)
    timed, _ = replay_mod.replay_methods(model, tokenizer, builders, [TRAJ], args, temperatures=[0.0, 1.0])
    tasks = list(iter_tasks(tokenizer, TRAJ))
    assert sorted(prompt_lens) == sorted(len(t["prompt_ids"]) for t in tasks)  # one prefill each
    shared, _ = replay_mod.replay_methods(model, tokenizer, builders, [TRAJ], args, temperatures=[0.0, 1.0], timed=False)
    for name, build in builders.items():
        for t in ("0.0", "1.0"):
            a = EvalArgs(max_new_tokens=10, temperature=float(t))
            own = [_run_task(model, build(), task, a, (), True, k) for k, task in enumerate(tasks)]
            for mine, other, ref in zip(timed[name][t][0], shared[name][t][0], own):
                assert mine["spec_ids"] == other["spec_ids"] == ref["spec_ids"]
                assert mine["plain_ids"] == other["plain_ids"] == ref["plain_ids"]
                assert [r["accepted"] for r in mine["rounds"]] == [r["accepted"] for r in ref["rounds"]]
                assert mine["spec_e2e_ms"] >= mine["prefill_ms"] > 0
    greedy = aggregate(*timed["half"]["0.0"], EvalArgs(max_new_tokens=10, buckets=(16, 64)))
    assert greedy["lossless"] is True and greedy["n_tasks"] == len(tasks)
