"""A learned MASK embedding (targets with no spare embedding row, e.g. SmolLM2) and a
draft vocabulary (the drafter projects onto N of the target's V tokens): a tiny target
of that kind trains a step with every architecture, exports, reloads and drafts
identically; the teacher hands both to the student; the loss leaves unlearnable tokens
out of CE and counts them; the vocabulary builder and the training-side plumbing
(`dlite.train.plan`) are deterministic and validated."""

import dataclasses
import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from safetensors import safe_open

from dlite.data import draft_vocab as dv
from dlite.export import load_drafter, save_drafter
from dlite.models import LEARNED_MASK, DrafterConfig, build_drafter, init_student_from_teacher
from dlite.train.optim import PlainEngine
from dlite.train.step import compute_loss, validate

V, HT, K = 48, 24, 2                     # every one of the 48 rows is a real token
IDS = torch.arange(0, V, 2)              # the draft vocabulary: the even ids (N = 24)
CFG = DrafterConfig(gamma=4, target_layer_ids=[0, 1], hidden_size=32, num_layers=1, num_heads=4,
                    num_kv_heads=2, head_dim=8, intermediate_size=64, head_hidden=32, markov_rank=8,
                    draft_vocab_size=len(IDS))
ARCHS = ("dlite", "teacher", "dspark")


@pytest.fixture(scope="module")
def vocab():
    g = torch.Generator().manual_seed(0)
    return torch.randn(V, HT, generator=g), torch.randn(V, HT, generator=g)


def make(vocab, arch="dlite", seed=0, ids=IDS, **kw):
    torch.manual_seed(seed)
    cfg = dataclasses.replace(CFG, arch=arch, draft_vocab_size=None if ids is None else len(ids), **kw)
    return build_drafter(cfg, *vocab, LEARNED_MASK, ids)


def batch(seed=1, B=2, L=24):
    g = torch.Generator().manual_seed(seed)
    return {"features": torch.randn(B, L, K * HT, generator=g),
            "input_ids": torch.randint(0, V, (B, L), generator=g),
            "ref_hidden": torch.randn(B, L, HT, generator=g),
            "anchors": torch.tensor([[3, 9, 15]] * B), "loss_mask": torch.ones(B, L, dtype=torch.bool)}


@pytest.mark.parametrize("arch", ARCHS)
def test_trains_exports_reloads_and_drafts_identically(tmp_path, vocab, arch):
    model = make(vocab, arch).train()
    assert model.vocab.out_weight.shape == (len(IDS), HT)           # sliced once
    assert torch.equal(model.vocab.mask_embed.detach(), vocab[0].mean(0))
    engine = PlainEngine(model, lr=1e-2, weight_decay=0.0, grad_clip=1.0)
    before = model.vocab.mask_embed.detach().clone()
    loss, m = compute_loss(model, batch())
    engine.backward(loss)
    assert model.vocab.mask_embed.grad.abs().sum() > 0                # MASK slots really use it
    engine.step()
    assert not torch.equal(model.vocab.mask_embed.detach(), before)
    assert 0 < m["oov_slots"] < m["valid_slots"] and m["oov_share"] == m["oov_slots"] / m["valid_slots"]

    model.eval()
    save_drafter(model, tmp_path, {"target_layer_ids": [0, 1]})
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["mask_embedding"] == "learned" and config["mask_token_id"] == LEARNED_MASK
    assert config["draft_vocab_size"] == len(IDS) and config["vocab_size"] == V
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        assert torch.equal(f.get_tensor("vocab.draft_ids"), IDS)
        assert "vocab.mask_embed" in f.keys() and "vocab.embed_weight" not in f.keys()
    assert "24 of the target's 48 tokens" in (tmp_path / "README.md").read_text()
    loaded = load_drafter(tmp_path, *vocab)
    b = batch(seed=2)
    assert torch.equal(model.forward_train(b), loaded.forward_train(b))
    feats = torch.randn(9, K * HT)
    for t in (0.0, 1.0):
        a = model.draft(model.new_state(), feats, 3, 9, t, torch.Generator().manual_seed(4))
        c = loaded.draft(loaded.new_state(), feats, 3, 9, t, torch.Generator().manual_seed(4))
        assert torch.equal(a[0], c[0]) and torch.isin(a[0], IDS).all()
        assert (a[1] is None and c[1] is None) if t == 0 else torch.equal(a[1], c[1])


def test_full_vocabulary_with_a_learned_mask_round_trips(tmp_path, vocab):
    model = make(vocab, ids=None).eval()
    assert model.vocab.size == V and model.vocab.draft_ids is None
    save_drafter(model, tmp_path, {})
    assert json.loads((tmp_path / "config.json").read_text())["draft_vocab_size"] is None
    loaded = load_drafter(tmp_path, *vocab)
    feats = torch.randn(5, K * HT)
    assert torch.equal(model.draft(None, feats, 1, 5, 0.0)[0], loaded.draft(None, feats, 1, 5, 0.0)[0])


def test_teacher_hands_mask_and_vocabulary_to_the_student(vocab):
    teacher, student = make(vocab, "teacher", seed=1), make(vocab, "dlite", seed=2)
    with torch.no_grad():
        teacher.vocab.mask_embed.add_(1.0)
    init_student_from_teacher(student, teacher)
    assert torch.equal(student.vocab.mask_embed, teacher.vocab.mask_embed)
    b = batch()
    # Same vocabulary space: the teacher's softmax over the N draft ids is the reference
    # as is (all its mass inside N, unlike the target's), with CE only on learnable slots.
    from dlite.losses import block_targets, dlite_loss
    loss, m = compute_loss(student, b, teacher=teacher)
    with torch.no_grad():
        p_teacher = torch.softmax(teacher.forward_train(b), -1)
        data, valid = block_targets(b["input_ids"], b["anchors"], CFG.gamma, b["loss_mask"])
        data = student.vocab.to_draft(data)
        want, _ = dlite_loss(student.forward_train(b), data, valid, p_teacher, ce_valid=data >= 0)
    assert p_teacher.shape[-1] == len(IDS) and loss.item() == pytest.approx(want.item(), rel=1e-5)
    assert m["oov_slots"] == int((valid & (data < 0)).sum()) > 0
    _, own = compute_loss(teacher, b, teacher=teacher)  # nothing lost outside N: all accepted
    assert own["l1"] < 1e-5 and own["tau_est"] == pytest.approx(CFG.gamma + 1, abs=1e-4)
    with pytest.raises(ValueError, match="draft vocabularies"):
        init_student_from_teacher(make(vocab, "dlite", ids=torch.arange(1, V, 2)), teacher)
    with pytest.raises(ValueError, match="draft vocabularies"):
        init_student_from_teacher(make(vocab, "dlite", ids=None), teacher)


def test_loss_restricts_to_the_draft_vocabulary_without_renormalising(vocab):
    from dlite.losses import block_targets, gather_block_rows
    from dlite.train.step import reference_probs
    model = make(vocab).eval()
    b = batch()
    b["input_ids"][:, 1::2] = 1                                       # every other token is odd
    with torch.no_grad():
        loss, m = compute_loss(model, b)
        p_ref = reference_probs(b, b["anchors"], CFG.gamma, model.vocab)
        full = torch.softmax(gather_block_rows(b["ref_hidden"], b["anchors"], CFG.gamma) @ vocab[1].T, -1)
    # the target's own probabilities of the N ids: mass outside N is lost, not spread
    torch.testing.assert_close(p_ref, full[..., IDS])
    assert (p_ref.sum(-1) < 1).all()
    data, valid = block_targets(b["input_ids"], b["anchors"], CFG.gamma, b["loss_mask"])
    odd = int(((data % 2 == 1) & valid).sum())
    assert m["oov_slots"] == odd > 0 and m["oov_share"] == pytest.approx(odd / int(valid.sum()))
    assert m["ce"] > 0 and all(0 <= a <= 1 for a in m["accept_est_at_k"])
    val = validate(model, [b])
    assert val["val_oov_share"] == pytest.approx(m["oov_share"])


def test_construction_refuses_inconsistent_vocabularies(vocab):
    with pytest.raises(ValueError, match="draft_vocab_size=24 but no draft"):
        build_drafter(CFG, *vocab, LEARNED_MASK)
    with pytest.raises(ValueError, match="sorted"):
        make(vocab, ids=torch.tensor([4, 2] + list(range(6, 28))))
    with pytest.raises(ValueError, match="outside vocab"):
        build_drafter(dataclasses.replace(CFG, draft_vocab_size=None), *vocab, V)


# ---------------------------------------------------------------- choosing the vocabulary

def test_build_draft_vocab_orders_specials_then_counts_then_prior():
    counts = np.zeros(100, dtype=np.int64)
    counts[[90, 50, 70]] = [5, 9, 5]
    ids = dv.build_draft_vocab(counts, 6, always=[99])
    assert ids.tolist() == [0, 1, 50, 70, 90, 99]                      # sorted; ties by lower id
    assert dv.build_draft_vocab(counts, 3, always=[99]).tolist() == [50, 70, 99]
    assert dv.build_draft_vocab(counts, 5, prior=[7]).tolist() == [0, 7, 50, 70, 90]  # short prior: low ids
    with pytest.raises(ValueError, match="draft_vocab_size"):
        dv.build_draft_vocab(counts, 101)
    with pytest.raises(ValueError, match="special"):
        dv.build_draft_vocab(counts, 1, always=[3, 4])
    rows = [{"input_ids": [5, 6, 7, 5], "loss_mask": [0, 1, 1, 1]}]
    assert dv.supervised_counts(rows, 10)[[5, 6, 7]].tolist() == [1, 1, 1]
    assert dv.coverage(torch.tensor([5, 6]), dv.supervised_tokens(rows)) == pytest.approx(2 / 3)


def _shards(tmp_path, recs):
    from dlite.data import shards
    store = shards.Store(str(tmp_path / "c"))
    side = shards.write_shard(store, 0, recs, "last_hidden", {"plan": "p"})
    shards.write_manifest(store, {"schema_version": shards.SCHEMA_VERSION, "target_fingerprint": {"id": "x"},
                                  "storage_mode": "full", "reference": "last_hidden", "files": [
                                      {"path": side["file"], "bytes": side["bytes"], "rows": side["rows"]}]})
    return str(tmp_path / "c")


def test_plan_builds_the_vocabulary_from_shards_and_the_models_share_it(tmp_path):
    from dlite.config import load_config
    from dlite.train import plan as st
    cfg = load_config(None, ["drafter.draft_vocab_size=64", "drafter.num_layers=1"])
    rec = lambda i, toks: {"id": f"r{i}", "part": 0, "index": i, "input_ids": np.array(toks),  # noqa: E731
                           "loss_mask": np.ones(len(toks)), "anchors": np.array([1]),
                           "features": np.zeros((len(toks), 2), np.float16),
                           "ref_hidden": np.zeros((len(toks), 2), np.float16)}
    uri = _shards(tmp_path, [rec(0, [3000, 3001, 3000]), rec(1, [4000, 4001])])
    ids, report = st.draft_vocab_from_shards(cfg, uri, 4096, held_ids=["r1"])
    again, _ = st.draft_vocab_from_shards(cfg, uri, 4096, held_ids=["r1"])
    assert torch.equal(ids, again) and len(ids) == 64
    assert {3000, 3001} <= set(ids.tolist()) and not {4000, 4001} & set(ids.tolist())
    assert set(st.special_ids(cfg.target)) <= set(ids.tolist())
    assert report["train_coverage"] == 1.0 and report["heldout_coverage"] == 0.0
    assert st.draft_vocab_from_shards(load_config(None, []), uri, 4096) == (None, {})

    vocab = st.load_vocab(cfg.target)
    teacher = st.build_model(cfg, st.plan_stage(cfg, "teacher"), vocab, draft_ids=ids)
    student = st.build_model(cfg, st.plan_stage(cfg, "align"), vocab, teacher)  # takes the teacher's
    assert torch.equal(student.vocab.draft_ids, ids)
    with pytest.raises(ValueError, match="drafter.draft_vocab_size=64"):
        st.build_model(cfg, st.plan_stage(cfg, "dspark"), vocab)


def test_mask_id_falls_back_to_a_learned_embedding_without_a_spare_row():
    from dlite.target import mask_token_id as mask_id
    full = SimpleNamespace(config=SimpleNamespace(vocab_size=8))

    class Tok:  # 8 tokens, no <|mask|>
        unk_token_id = 0

        def convert_tokens_to_ids(self, t):
            return 0

        def __len__(self):
            return 8
    assert mask_id(full, Tok()) == LEARNED_MASK
    assert mask_id(SimpleNamespace(config=SimpleNamespace(vocab_size=9)), Tok()) == 8


def test_prior_fills_the_vocabulary_by_frequency_in_its_text(tmp_path):
    """drafter.draft_vocab_prior: after the training data's tokens, a text prior ranks ids
    by their count in that text (the file read in a fixed order), so the vocabulary
    takes the text's most frequent pieces before rare low ids; 'low_ids' keeps 0, 1, ..."""
    from dlite.config import load_config
    from dlite.target import load_tokenizer
    from dlite.train import plan as st
    tok = load_tokenizer(load_config(None, []).target)
    text = tmp_path / "code.py"
    text.write_text("def frobnicate(widget):\n    return widget.frobnicate()\n" * 50)
    order = dv.prior_order(str(text), tok, len(tok))
    common = set(tok(text.read_text(), add_special_tokens=False)["input_ids"])
    assert dv.prior_order("low_ids", tok, len(tok)) is None
    assert sorted(order.tolist()) == list(range(len(tok))) and set(order[: len(common)].tolist()) == common
    ids = dv.build_draft_vocab(np.zeros(len(tok), np.int64), len(common) + 2, [0, 1], order)
    assert common <= set(ids.tolist())
    assert np.array_equal(order, dv.prior_order(str(tmp_path), tok, len(tok)))  # a directory of it
    stdlib = dv.prior_order("python_stdlib", tok, len(tok))
    assert len(stdlib) == len(tok) and stdlib[0] != 0  # real code text, not the lowest id
    with pytest.raises(ValueError, match="draft_vocab_prior"):
        dv.prior_order(str(tmp_path / "nope"), tok, len(tok))
    with pytest.raises(ValueError, match="drafter.draft_vocab_prior"):
        load_config(None, ["drafter.draft_vocab_prior=/no/such/text"])  # before any work
    cfg = load_config(None, ["drafter.draft_vocab_size=64", f"drafter.draft_vocab_prior={text}"])
    (tmp_path / "s").mkdir()
    uri = _shards(tmp_path / "s", [{"id": "r0", "part": 0, "index": 0, "input_ids": np.array([3000]),
                                    "loss_mask": np.ones(1), "anchors": np.array([0]),
                                    "features": np.zeros((1, 2), np.float16),
                                    "ref_hidden": np.zeros((1, 2), np.float16)}])
    ids, report = st.draft_vocab_from_shards(cfg, uri, len(tok))
    assert {3000} | common <= set(ids.tolist())
    assert all(isinstance(v, (int, float)) for v in report.values())  # logged as MLflow metrics


def test_a_default_prior_leaves_finished_stages_reusable():
    """A setting added later hashes as before at its neutral value; otherwise it counts."""
    from omegaconf import OmegaConf
    from dlite.config import load_config
    from pipelines.orchestration import dag
    cfg = load_config(None, ["drafter.draft_vocab_size=64"])
    d = dag.BY_NAME["teacher"]
    before = OmegaConf.to_container(cfg, resolve=True)
    del before["drafter"]["draft_vocab_prior"]  # a config from before the setting existed
    old = dag._stage_hash(OmegaConf.create(before), d, {}, "t")
    assert dag._stage_hash(cfg, d, {}, "t") == old
    code = OmegaConf.merge(cfg, {"drafter": {"draft_vocab_prior": "python_stdlib"}})
    assert dag._stage_hash(code, d, {}, "t") != old
