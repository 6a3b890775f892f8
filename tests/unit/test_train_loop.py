"""The single-process training path: rows from the real tiny target, the plain engine
and the shared loop. Training lowers the loss and raises teacher-forced acceptance, a
teacher can stand in as the reference (distillation), and the TRAINED drafter still
decodes losslessly (greedy output identical to plain decoding)."""

import pytest
import torch
from omegaconf import OmegaConf

from dlite import target as tgt
from dlite.config import load_config
from dlite.models import build_drafter
from dlite.spec.decode import plain_generate, speculative_generate
from dlite.tiny import corpus
from dlite.train.data import collate, epoch_batches, inprocess_rows
from dlite.train.loop import LoopConfig, train_loop
from dlite.train.optim import PlainEngine, lr_at
from dlite.train.step import compute_loss


@pytest.fixture(scope="module")
def setup():
    torch.manual_seed(0)
    cfg = load_config("configs/experiments/tiny.yaml")
    model, tok = tgt.load(cfg.target)
    recs = list(corpus.generate("train", 6, 0, 3000, 6000))
    rows = inprocess_rows(model, tok, recs, list(cfg.drafter.target_layer_ids), 512, "truncate", 16, 0)
    return cfg, model, tok, rows


def _drafter(cfg, model, tok, arch="dlite"):
    dcfg = OmegaConf.to_object(cfg.drafter)
    dcfg.arch = arch
    return build_drafter(dcfg, *tgt.shared_vocab(model, tok))


def test_lr_schedule_warms_up_then_decays():
    lrs = [lr_at(s, 100, 1e-3, 0.1) for s in range(100)]
    assert lrs[0] < lrs[9] == pytest.approx(1e-3) and lrs[-1] < 0.2e-3


def test_collate_pads_and_masks(setup):
    _, _, _, rows = setup
    b = collate(rows[:3])
    assert b["features"].shape[:2] == b["input_ids"].shape and b["features"].dtype == torch.float32
    assert b["anchor_mask"].sum() == sum(len(r["anchors"]) for r in rows[:3])


def test_training_learns_and_stays_lossless(setup):
    cfg, model, tok, rows = setup
    drafter = _drafter(cfg, model, tok)
    batches = epoch_batches(rows, 2, 16, seed=0)
    fixed = collate(rows[:2])
    with torch.no_grad():
        before = compute_loss(drafter, fixed)[1]
    engine = PlainEngine(drafter, lr=3e-3, weight_decay=0.0, grad_clip=1.0)
    train_loop(engine, batches, LoopConfig(steps=40, lr=3e-3, warmup_frac=0.05))
    with torch.no_grad():
        after = compute_loss(drafter, fixed)[1]
    assert after["loss"] < 0.8 * before["loss"]
    assert after["tau_est"] > before["tau_est"]
    prompt = rows[0]["input_ids"][:300]
    plain, _ = plain_generate(model, prompt, 40)
    spec, rounds = speculative_generate(model, drafter.eval(), prompt, 40)
    assert spec == plain and rounds


def test_teacher_reference_distils(setup):
    cfg, model, tok, rows = setup
    teacher, student = _drafter(cfg, model, tok, "teacher"), _drafter(cfg, model, tok)
    batch = collate(rows[:2])
    loss_t, _ = compute_loss(student, batch, teacher=teacher)
    loss_r, _ = compute_loss(student, batch)
    assert torch.isfinite(loss_t) and loss_t.item() != pytest.approx(loss_r.item())
