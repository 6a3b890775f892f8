"""The published training recipe as configuration of our two stages (issue 29; the
authors' FlashMTP `train_dlite_two_stage.py` / `specforge/core/dlite.py`): each loss term
against a hand computation, the cosine blend's endpoints, the sliding-window teacher
seeing only its window, the copied head really frozen through stage 1 and trained after,
the dlite_v1 teacher, and the recipe's config keys refused by name."""

import math

import pytest
import torch
from omegaconf import OmegaConf

from dlite import target as tgt
from dlite.config import ConfigError, load_config
from dlite.losses import dlite_loss, position_weights
from dlite.models import build_drafter
from dlite.models.history import HistoryCache, packed_block_mask
from dlite.models.teacher import copy_head, head_parameters
from dlite.train import plan as st
from dlite.train.loop import LoopConfig, teacher_share, train_loop
from dlite.train.optim import PlainEngine, separate_head
from dlite.train.step import LossSpec, compute_loss

TINY = "configs/experiments/tiny.yaml"
SMALL = ["drafter.num_layers=1", "drafter.head_hidden=32", "drafter.intermediate_size=128"]
V1 = ["drafter.arch=dlite_v1", "drafter.num_layers=1", "drafter.sequential_rank=16",
      "drafter.intermediate_size=128"]


@pytest.fixture(scope="module")
def tiny():
    cfg = load_config(TINY, SMALL)
    model, tok = tgt.load(cfg.target)
    return cfg, tgt.shared_vocab(model, tok), model.model.norm.weight.detach()


def _model(cfg, vocab, norm, seed=0, **over):
    torch.manual_seed(seed)
    d = OmegaConf.to_object(OmegaConf.merge(cfg.drafter, over))
    parts = {"final_norm_weight": norm} if d.arch == "dlite_v1" else {}
    return build_drafter(d, *vocab, **parts)


def _batch(seed=1, L=40, A=4):
    g = torch.Generator().manual_seed(seed)
    return {"features": torch.randn(2, L, 2 * 128, generator=g),
            "input_ids": torch.randint(0, 4000, (2, L), generator=g),
            "ref_hidden": torch.randn(2, L, 128, generator=g),
            "anchors": torch.sort(torch.randint(2, L - 8, (2, A), generator=g)).values}


# ---------------------------------------------------------------- loss terms

def _rows(seed=0, n=3, g=2, V=5):
    gen = torch.Generator().manual_seed(seed)
    z = torch.randn(n, g, V, generator=gen)
    p_ref = torch.softmax(torch.randn(n, g, V, generator=gen), -1)
    return z, p_ref, torch.randint(0, V, (n, g), generator=gen), torch.ones(n, g, dtype=torch.bool)


def test_kl_term_is_forward_kl_to_the_reference():
    z, p_ref, t, valid = _rows()
    loss, m = dlite_loss(z, t, valid, p_ref, 0.0, 0.0, None, kl_weight=2.0)
    q = torch.softmax(z, -1)
    hand = (p_ref * (p_ref.log() - q.log())).sum(-1).mean()  # KL(teacher || student), every slot alike
    assert loss.item() == pytest.approx(2.0 * hand.item(), rel=1e-5)
    assert m["kl"] == pytest.approx(hand.item(), rel=1e-5)


def test_stage2_ce_plus_tv_with_decay_by_hand():
    z, p_ref, t, valid = _rows(seed=3)
    loss, _ = dlite_loss(z, t, valid, p_ref, 1.0, 1.0, 4.0)
    q = torch.softmax(z, -1)
    ce = -q.log().gather(-1, t[..., None])[..., 0]
    tv = (q - p_ref).abs().sum(-1)  # the authors' "TV": sum |p - q|, no 1/2
    w = torch.tensor([1.0, math.exp(-1 / 4)])
    hand = ((ce + tv) * w).sum() / (w.sum() * 3)
    assert loss.item() == pytest.approx(hand.item(), rel=1e-5)
    assert position_weights(3, None).tolist() == [1.0, 1.0, 1.0]


def test_ce_on_the_reference_argmax():
    """`ref_labels`: CE's label is the target's greedy token, not the data token."""
    z, p_ref, t, valid = _rows(seed=5)
    loss, m = dlite_loss(z, t, valid, p_ref, 1.0, 0.0, None, ref_labels=True)
    hand = -torch.log_softmax(z, -1).gather(-1, p_ref.argmax(-1)[..., None]).mean()
    assert loss.item() == pytest.approx(hand.item(), rel=1e-5)
    data = dlite_loss(z, t, valid, p_ref, 1.0, 0.0, None)[0]
    assert data.item() != pytest.approx(hand.item(), rel=1e-3)


def test_gradient_of_the_kl_term():
    """d KL(p || softmax z) / dz = softmax(z) - p (per row, before the mean)."""
    z, p_ref, t, valid = _rows(seed=7, n=1, g=1)
    z.requires_grad_(True)
    dlite_loss(z, t, valid, p_ref, 0.0, 0.0, None, kl_weight=1.0)[0].backward()
    torch.testing.assert_close(z.grad, torch.softmax(z.detach(), -1) - p_ref, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------- schedule

def test_blend_schedule_endpoints():
    assert [teacher_share(s, 3, 0) for s in (0, 2, 3, 9)] == [1.0, 1.0, 0.0, 0.0]
    blend = [teacher_share(s, 3, 5) for s in range(3, 8)]
    assert blend[0] == 1.0 and blend[-1] == pytest.approx(0.0, abs=1e-12)
    assert blend[2] == pytest.approx(0.5) and blend == sorted(blend, reverse=True)
    assert teacher_share(8, 3, 5) == 0.0 and teacher_share(3, 3, 1) == 0.5


def test_blended_loss_mixes_both_stages(tiny):
    cfg, vocab, _ = tiny
    student, teacher = _model(cfg, vocab, None), _model(cfg, vocab, None, seed=1, arch="teacher")
    b, spec = _batch(), LossSpec(distill_kl=True)
    with torch.no_grad():
        l1 = compute_loss(student, b, teacher, spec, 1.0)[0].item()
        l2 = compute_loss(student, b, None, spec)[0].item()
        mix, m = compute_loss(student, b, teacher, spec, 0.25)
    assert mix.item() == pytest.approx(0.25 * l1 + 0.75 * l2, rel=1e-5)
    assert m["stage1_loss"] == pytest.approx(l1, rel=1e-5) and m["teacher_share"] == 0.25


# ---------------------------------------------------------------- sliding window

def test_window_mask_keeps_the_last_w_positions():
    b = {"anchors": torch.tensor([[10, 20]]), "input_ids": torch.zeros(1, 30, dtype=torch.long)}
    m = packed_block_mask(b, gamma=2, n_ctx=1, window=4)[0, 0]
    hist = m[:, :30]
    assert hist[0].nonzero().flatten().tolist() == [6, 7, 8, 9]
    assert hist[2].nonzero().flatten().tolist() == [16, 17, 18, 19]
    assert packed_block_mask(b, 2, 1)[0, 0, 2, :30].sum() == 20  # no window: all before 20


@pytest.mark.parametrize("arch", ["teacher", "dlite_v1"])
def test_windowed_teacher_sees_only_its_window(tiny, arch):
    cfg, vocab, norm = tiny
    over = dict(arch=arch, history_window=6)
    if arch == "dlite_v1":
        cfg = load_config(TINY, V1)
        over["v1_teacher"] = True
    t = _model(cfg, vocab, norm, **over).eval()
    b = {**_batch(L=40, A=1), "anchors": torch.tensor([[30], [30]])}
    with torch.no_grad():
        base = t.forward_train(b)
        far, near = dict(b), dict(b)
        far["features"] = b["features"].clone()
        far["features"][:, :24] += 5.0       # positions < 30 - 6: outside the window
        near["features"] = b["features"].clone()
        near["features"][:, 25] += 5.0       # inside it
        torch.testing.assert_close(t.forward_train(far), base)
        assert not torch.allclose(t.forward_train(near), base)


def test_history_cache_window_crops_what_attention_sees(tiny):
    cfg, vocab, _ = tiny
    t = _model(cfg, vocab, None, arch="teacher", history_window=5)
    cache = t.new_state()
    h, d = cache.kv_shape
    hk = [(torch.randn(1, h, 12, d), torch.randn(1, h, 12, d)) for _ in t.backbone.layers]
    cache.extend(hk)
    k, _ = cache.join(0, torch.zeros(1, h, 3, d), torch.zeros(1, h, 3, d))
    assert k.shape[2] == 5 + 3 and torch.equal(k[:, :, :5], hk[0][0][:, :, 7:])
    assert isinstance(cache, HistoryCache) and cache.length == 12


# ---------------------------------------------------------------- frozen copied head

@pytest.mark.parametrize("arch", ["dlite", "dlite_v1"])
def test_copied_head_frozen_in_stage1_then_trained(tiny, arch):
    cfg, vocab, norm = tiny
    if arch == "dlite_v1":
        cfg = load_config(TINY, V1)
        teacher = _model(cfg, vocab, norm, seed=1, v1_teacher=True)
    else:
        teacher = _model(cfg, vocab, None, seed=1, arch="teacher")
    student = _model(cfg, vocab, norm)
    names = copy_head(student, teacher)
    s, t = student.state_dict(), teacher.state_dict()
    assert names and all(torch.equal(s[n], t[n]) for n in names)
    head = head_parameters(student)
    rest = {n: p.detach().clone() for n, p in student.named_parameters() if not any(p is h for h in head)}
    separate_head(student)  # as `build_model` does for the published recipe
    engine = PlainEngine(student, 1e-2, 0.01, 1.0)
    teacher.requires_grad_(False)
    batches = iter([_batch(seed=i) for i in range(4)])
    loop = LoopConfig(steps=2, lr=1e-2, warmup_frac=0.0, distill_steps=2, spec=LossSpec(distill_kl=True),
                      freeze_head=True)
    train_loop(engine, batches, loop, teacher=teacher)
    s = student.state_dict()
    assert all(torch.equal(s[n], t[n]) for n in names)          # untouched by 2 stage-1 steps
    assert all(p.grad is None for p in head)
    assert any(not torch.equal(p, rest[n]) for n, p in student.named_parameters() if n in rest)
    train_loop(engine, batches, LoopConfig(steps=4, lr=1e-2, warmup_frac=0.0, distill_steps=2,
                                           spec=LossSpec(distill_kl=True), freeze_head=True), start_step=2,
               teacher=teacher)
    s = student.state_dict()
    assert any(not torch.equal(s[n], t[n]) for n in names)      # stage 2 trains it again


def test_copy_head_refuses_a_different_head(tiny):
    cfg, vocab, _ = tiny
    teacher = _model(cfg, vocab, None, arch="teacher", head_hidden=16)
    with pytest.raises(ValueError, match="sequential head"):
        copy_head(_model(cfg, vocab, None), teacher)


# ---------------------------------------------------------------- plans and config

def test_published_recipe_plan():
    cfg = load_config(TINY, ["train.recipe=published", "train.distill_frac=0.25", "train.blend_frac=0.25",
                             "train.steps_align=40"])
    p = st.plan_stage(cfg, "align")
    assert (p.distill_steps, p.blend_steps, p.recipe, p.from_teacher) == (10, 10, "published", True)
    v1 = load_config(TINY, V1 + ["train.recipe=published"])
    assert st.plan_stage(v1, "teacher").arch == "dlite_v1_teacher"
    d = st.drafter_config(v1, "dlite_v1_teacher")
    assert (d.arch, d.v1_teacher) == ("dlite_v1", True)


@pytest.mark.parametrize("over,key", [
    (["train.recipe=theirs"], "train.recipe"),
    (["train.distill_frac=0.8", "train.blend_frac=0.3"], "train.blend_frac"),
    (["train.loss_decay=0"], "train.loss_decay"),
    (["train.ce_labels=greedy"], "train.ce_labels"),
    (["train.ce_weight=0", "train.tv_weight=0"], "train.ce_weight"),
    (["drafter.history_window=0"], "drafter.history_window"),
    (["drafter.v1_teacher=true"], "drafter.v1_teacher"),
    (["train.recipe=published", "drafter.head=none"], "train.recipe"),
])
def test_recipe_keys_checked_by_name(over, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config(TINY, over)


def test_frozen_head_group_does_not_move_even_with_zero_grads(tiny):
    """What DeepSpeed's ZeRO optimizer does with a frozen parameter (steps it with a zero
    gradient): lr 0 on the head's own group keeps it exact, weight decay included."""
    from dlite.train.loop import freeze_head
    cfg, vocab, _ = tiny
    model = _model(cfg, vocab, None)
    separate_head(model)
    engine = PlainEngine(model, 1e-2, 0.5, 0.0)
    assert [g["name"] for g in engine.optimizer.param_groups] == ["body", "head"]
    freeze_head(engine, True, 1e-2)
    head = head_parameters(model)
    before = [p.detach().clone() for p in model.parameters()]
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    engine.optimizer.step()
    moved = {id(p) for p, b in zip(model.parameters(), before) if not torch.equal(p, b)}
    assert not moved & {id(p) for p in head} and moved  # the body decayed, the head did not
    freeze_head(engine, False, 1e-2)
    assert all(p.requires_grad for p in head) and engine.optimizer.param_groups[1]["lr"] == 1e-2


def test_freeze_head_refuses_an_optimizer_without_a_head_group(tiny):
    """Only a model marked by `separate_head` has the group: freezing without it would
    leave the head to DeepSpeed's zero-gradient steps and weight decay."""
    from dlite.train.loop import freeze_head
    cfg, vocab, _ = tiny
    engine = PlainEngine(_model(cfg, vocab, None), 1e-2, 0.5, 0.0)
    assert [g["name"] for g in engine.optimizer.param_groups] == ["body"]
    with pytest.raises(ValueError, match="no 'head' group"):
        freeze_head(engine, True, 1e-2)
