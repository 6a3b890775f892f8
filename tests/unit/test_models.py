"""Unit tests for dlite.models: Qwen3 parity of the backbone layer, shapes for every
arch × injection × head, the no-peeking mask, train/inference agreement of draft()
(with a target MASK row and full vocabulary, and with a learned MASK and a draft
vocabulary), DLite's history-freedom, DSpark's growing cache, teacher -> student init,
and the draft-cost benchmark on a toy config. Tiny sizes: the whole file runs in seconds."""

import dataclasses

import pytest
import torch
from transformers import Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import Qwen3DecoderLayer, Qwen3RotaryEmbedding

from dlite.models import LEARNED_MASK, DrafterConfig, build_drafter, init_student_from_teacher, param_count
from dlite.models.layers import DecoderLayer, rope_cos_sin

V, HT, K = 40, 24, 2          # vocab, target hidden (≠ drafter width: projections in use), layers
MASK = V - 1
CFG = DrafterConfig(gamma=4, target_layer_ids=[0, 1], hidden_size=32, num_layers=2, num_heads=4,
                    num_kv_heads=2, head_dim=8, intermediate_size=64, head_hidden=32, markov_rank=8)
ARCHS = ("dlite", "teacher", "dspark")
DRAFT_IDS = torch.tensor([0, 2, 3, 5, 8, 11, 13, 17, 20, 21, 25, 30, 33, 36, 38])
# (mask id, draft vocabulary): a spare target row and all V tokens / a learned MASK and N of V
VOCABS = {"row_full": (MASK, None), "learned_draft": (LEARNED_MASK, DRAFT_IDS)}


def make(arch="dlite", seed=0, vocab="row_full", **kw):
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(123)
    embed, lm_head = torch.randn(V, HT, generator=g), torch.randn(V, HT, generator=g)
    mask, ids = VOCABS[vocab]
    cfg = dataclasses.replace(CFG, arch=arch, draft_vocab_size=None if ids is None else len(ids), **kw)
    return build_drafter(cfg, embed, lm_head, mask, ids).eval()


def make_batch(B=2, L=24, A=3, seed=1):
    g = torch.Generator().manual_seed(seed)
    return {"features": torch.randn(B, L, K * HT, generator=g),
            "input_ids": torch.randint(0, V - 1, (B, L), generator=g),
            "anchors": torch.randint(1, L - 2, (B, A), generator=g)}


@pytest.mark.parametrize("causal", [True, False])
def test_decoder_layer_matches_transformers_qwen3(causal):
    hf_cfg = Qwen3Config(hidden_size=32, intermediate_size=64, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=8, rms_norm_eps=1e-6,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    hf_cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    ref = Qwen3DecoderLayer(hf_cfg, layer_idx=0).eval()
    for p in ref.parameters():  # HF inits norms to 1: perturb so q/k norms are really tested
        torch.nn.init.normal_(p, mean=0.5 if p.dim() == 1 else 0.0, std=0.2)
    ours = DecoderLayer(CFG, 0).eval()
    ours.load_state_dict(ref.state_dict(), strict=True)
    x, pos = torch.randn(2, 6, 32), torch.arange(5, 11).expand(2, 6)
    cos, sin = Qwen3RotaryEmbedding(hf_cfg)(x, pos)
    ocos, osin = rope_cos_sin(pos, 8, 10000.0, x.dtype)
    torch.testing.assert_close(ocos, cos), torch.testing.assert_close(osin, sin)
    allowed = torch.ones(6, 6, dtype=torch.bool)
    allowed = allowed.tril() if causal else allowed
    add_mask = torch.zeros(1, 1, 6, 6).masked_fill(~allowed, float("-inf"))
    want = ref(x, attention_mask=add_mask, position_ids=pos, position_embeddings=(cos, sin))
    got = ours(x, ocos, osin, mask=allowed[None, None])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("injection,head", [("kv", "gru"), ("add", "attn"), ("kv", "none"), ("slots", "rank")])
def test_forward_train_shapes_and_grads(arch, injection, head):
    m = make(arch, context_injection=injection, head=head).train()
    batch = make_batch()
    logits = m.forward_train(batch)
    assert logits.shape == (2, 3, CFG.gamma, V) and torch.isfinite(logits).all()
    single = m.forward_train({k: v[0] for k, v in batch.items()})
    torch.testing.assert_close(single, logits[0], rtol=1e-4, atol=1e-4)
    logits.logsumexp(-1).mean().backward()
    assert all(p.grad is not None for p in m.parameters())
    assert not any("embed_weight" in n or "lm_head" in n for n, _ in m.named_parameters())


@pytest.mark.parametrize("arch", ["teacher", "dspark"])
def test_history_blocks_never_see_the_anchor_or_later(arch):
    m = make(arch)
    batch = make_batch(B=1, L=20)
    batch["anchors"] = torch.tensor([[6, 12, 3]])
    base = m.forward_train(batch)[0, 1]                    # block anchored at 12
    later = {**batch, "features": batch["features"].clone()}
    later["features"][0, 12:] += 5.0                       # at and after the anchor
    torch.testing.assert_close(m.forward_train(later)[0, 1], base)
    earlier = {**batch, "features": batch["features"].clone()}
    earlier["features"][0, 2] += 5.0                       # strictly before the anchor
    assert not torch.allclose(m.forward_train(earlier)[0, 1], base)
    alone = {**batch, "anchors": torch.tensor([[12]])}     # other blocks are invisible
    torch.testing.assert_close(m.forward_train(alone)[0, 0], base, rtol=1e-5, atol=1e-5)


def test_dlite_train_uses_only_the_feature_before_the_anchor():
    m = make("dlite")
    batch = make_batch(B=1, L=20)
    batch["anchors"] = torch.tensor([[9]])
    base = m.forward_train(batch)
    other = {**batch, "features": batch["features"].clone()}
    other["features"][0, :8] += 3.0
    other["features"][0, 9:] += 3.0
    torch.testing.assert_close(m.forward_train(other), base)
    other["features"][0, 8] += 3.0
    assert not torch.allclose(m.forward_train(other), base)


@pytest.mark.parametrize("vocab", VOCABS)
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("injection", ["kv", "add", "slots"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_draft_matches_teacher_forced_training(arch, injection, vocab, temperature):
    """Two rounds of draft() (cache extended in between) reproduce forward_train run on
    the drafted continuation: greedy tokens are its argmax (and no probs are computed);
    sampled tokens come with exactly its softmax, over the target's vocabulary."""
    _draft_agrees_with_training(make(arch, context_injection=injection, vocab=vocab), temperature,
                                VOCABS[vocab][1])


@pytest.mark.parametrize("arch", ["dlite", "teacher"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_own_vocabulary_head_drafts_as_it_trains(arch, temperature):
    """The published rank-r head on our backbone (`head: rank`, over context slots):
    the same train/inference agreement, its logits from its own r -> V matrix."""
    m = make(arch, context_injection="slots", head="rank", sequential_rank=8)
    assert m.head.output_proj.weight.shape == (V, 8)
    _draft_agrees_with_training(m, temperature, None)


@pytest.mark.parametrize("injection,head", [("slots", "gru"), ("slots", "rank"), ("kv", "rank")])
def test_batched_rows_draft_as_one_row_each(injection, head):
    """`draft_rows` (batched decoding) over context slots / the own-vocabulary head: each
    row's greedy block is the one `draft` makes alone."""
    m = make("dlite", context_injection=injection, head=head, sequential_rank=8)
    feats, anchors, positions = torch.randn(3, K * HT), [3, 9, 30], [5, 11, 17]
    rows = m.draft_rows(feats, anchors, positions, 0.0)
    for (tok, _), f, a, p in zip(rows, feats, anchors, positions):
        assert tok.tolist() == m.draft(None, f[None], a, p, 0.0)[0].tolist()


def _draft_agrees_with_training(m, temperature, draft_ids):
    batch = make_batch(B=1, L=24)
    feats, ids = batch["features"][0], batch["input_ids"][0].clone()
    state, g = m.new_state(), torch.Generator().manual_seed(5)
    _, _, state = m.draft(state, feats[:7], int(ids[7]), 7, temperature, g)
    tokens, probs, state = m.draft(state, feats[7:11], int(ids[11]), 11, temperature, g)
    assert tokens.shape == (CFG.gamma,)
    ids[12:12 + CFG.gamma] = tokens
    logits = m.forward_train({"features": feats, "input_ids": ids, "anchors": torch.tensor([11])})[0]
    assert logits.shape == (CFG.gamma, m.vocab.size)
    if temperature == 0:
        assert probs is None
        assert torch.equal(tokens, m.vocab.to_target(logits.argmax(-1)))
        return
    assert probs.shape == (CFG.gamma, V) and (probs.gather(1, tokens[:, None]) > 0).all()
    torch.testing.assert_close(probs.sum(-1), torch.ones(CFG.gamma))
    torch.testing.assert_close(m.vocab.to_full(torch.softmax(logits, -1)), probs, rtol=1e-4, atol=1e-5)
    if draft_ids is not None:
        outside = torch.ones(V, dtype=torch.bool).index_fill_(0, DRAFT_IDS, False)
        assert (probs[:, outside] == 0).all() and torch.isin(tokens, DRAFT_IDS).all()


@pytest.mark.parametrize("arch", ARCHS)
def test_sampled_draft_is_reproducible_and_from_probs(arch):
    m = make(arch)
    feats = torch.randn(5, K * HT)
    runs = [m.draft(m.new_state(), feats, 3, 5, 0.8, torch.Generator().manual_seed(7)) for _ in range(2)]
    assert torch.equal(runs[0][0], runs[1][0])
    tokens, probs, _ = runs[0]
    assert (probs.gather(1, tokens[:, None]) > 0).all()


def test_dlite_draft_depends_only_on_last_row_anchor_and_position():
    m = make("dlite")
    rows = torch.randn(6, K * HT)
    draft = lambda state, f, a, p: m.draft(state, f, a, p, 1.0, torch.Generator().manual_seed(0))  # noqa: E731
    tokens, probs, state = draft(m.new_state(), rows, 5, 30)
    assert state is None and m.cache_bytes(state) == 0
    noise = torch.cat([torch.randn(9, K * HT), rows[-1:]])
    for other in (rows[-1:], noise):
        t2, p2, _ = draft("ignored", other, 5, 30)
        assert torch.equal(t2, tokens) and torch.equal(p2, probs)
    for args in ((torch.randn(1, K * HT), 5, 30), (rows, 6, 30), (rows, 5, 31)):
        assert not torch.equal(draft(None, *args)[1], probs)


def test_dspark_cache_grows_with_context_and_refuses_gaps():
    m = make("dspark")
    sizes = []
    for L in (300, 3000):
        state = m.draft(m.new_state(), torch.randn(L, K * HT), 1, L, 0.0)[2]
        sizes.append(m.cache_bytes(state))
        assert state.length == L
        state = m.draft(state, torch.randn(3, K * HT), 1, L + 3, 0.0)[2]
        assert state.length == L + 3
    assert sizes[1] > 5 * sizes[0] > 0
    with pytest.raises(ValueError, match="history cache holds"):
        m.draft(state, torch.randn(3, K * HT), 1, 5000, 0.0)


@pytest.mark.parametrize("injection,head", [("kv", "gru"), ("add", "attn"), ("slots", "rank")])
def test_init_student_from_teacher_copies_every_shared_weight(injection, head):
    teacher, student = make("teacher", 1, context_injection=injection, head=head), \
        make("dlite", 2, context_injection=injection, head=head)
    report = init_student_from_teacher(student, teacher)
    assert sorted(report["copied"]) == sorted(student.state_dict())
    assert report["skipped"] and all(k.startswith("hist_") for k in report["skipped"])
    t_state = teacher.state_dict()
    for k, v in student.state_dict().items():
        assert torch.equal(v, t_state[k])
    with pytest.raises(ValueError, match="no teacher counterpart"):
        init_student_from_teacher(make("dlite", head="attn" if head == "gru" else "gru"), teacher)


def test_construction_is_deterministic_and_validated():
    a, b = make("dlite", seed=3), make("dlite", seed=3)
    for (ka, va), (kb, vb) in zip(a.state_dict().items(), b.state_dict().items()):
        assert ka == kb and torch.equal(va, vb)
    batch = make_batch()
    torch.testing.assert_close(a.forward_train(batch), b.forward_train(batch), rtol=0, atol=0)
    with pytest.raises(ValueError, match="context_injection"):
        make("dlite", context_injection="cross")
    with pytest.raises(ValueError, match="draft_vocab_size: head 'rank'"):
        make("dlite", head="rank", vocab="learned_draft")
    with pytest.raises(ValueError, match="arch"):
        make("eagle")


def test_draft_cost_benchmark_on_a_toy_config():
    from dlite.bench.draft_cost import param_counts, run
    cfg = dataclasses.replace(CFG, gamma=3)
    out = run(cfg, HT, V, context_lengths=(16, 256), rounds=2, warmup=1, threads=1)
    assert set(out["draft_ms"]) == {"dlite", "dspark"} and "target_step_ms" not in out
    tcfg = Qwen3Config(vocab_size=V, hidden_size=HT, intermediate_size=32, num_hidden_layers=2,
                       num_attention_heads=2, num_key_value_heads=1, head_dim=12)
    small = run(cfg, HT, V, context_lengths=(16,), rounds=2, warmup=1, threads=1,
                draft_vocab_sizes=(16,), target_config=tcfg)
    assert set(small["draft_ms"]) == {"dlite", "dspark", "dlite@16", "dspark@16"}
    assert small["target_step_ms"]["16"] > 0 and set(small["draft_over_target"]["dlite@16"]) == {"16"}
    arith = small["traffic_arithmetic"]
    assert arith["kind"].startswith("arithmetic")
    q4 = arith["qwen3_4b"]["dlite_round_bytes"]
    assert q4["151936"] - q4["32768"] == 7 * (151936 - 32768) * 2560 * 2
    assert out["draft_cache_bytes"]["dlite"] == {"16": 0, "256": 0}
    assert out["draft_cache_bytes"]["dspark"]["256"] > out["draft_cache_bytes"]["dspark"]["16"]
    counts = param_counts()
    assert 0.5e9 < counts["dlite_qwen3_4b"]["trainable_params"] < 0.7e9
    assert 0.9e9 < counts["dlite_qwen3_8b"]["trainable_params"] < 1.2e9
    assert param_count(make("dlite")) < param_count(make("teacher"))
