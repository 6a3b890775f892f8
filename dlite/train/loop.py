"""The training loop, readable top to bottom (nanoGPT style): schedule → micro-batches
→ loss → backward → step, with validation, logging and checkpointing as visible `if`
blocks. It knows nothing about Ray or DeepSpeed: the engine (plain torch or DeepSpeed)
and the callbacks (log / checkpoint / validate) are passed in."""

import time
from dataclasses import dataclass
from typing import Callable, Iterator, Optional

import torch

from dlite.train.optim import lr_at
from dlite.train.step import compute_loss


@dataclass
class LoopConfig:
    steps: int
    lr: float
    warmup_frac: float = 0.04
    grad_accum: int = 1
    distill_steps: int = 0  # the first N steps use the teacher as reference (align stage)
    eval_every: int = 0     # 0: validate only at the end
    log_every: int = 1


def _tokens(batch: dict) -> int:
    return int(batch["input_ids"].numel())


def train_loop(engine, batches: Iterator[dict], cfg: LoopConfig, start_step: int = 0,
               teacher=None, validate: Optional[Callable] = None,
               log: Callable = lambda step, m: None,
               checkpoint: Callable = lambda step, metrics, is_best: None) -> dict:
    """Run optimiser steps start_step..cfg.steps-1; returns the last metrics."""
    model, best, last = engine.module, None, {}
    t0, samples, tokens = time.perf_counter(), 0, 0
    for step in range(start_step, cfg.steps):
        model.train()
        engine.set_lr(lr_at(step, cfg.steps, cfg.lr, cfg.warmup_frac))
        ref = teacher if step < cfg.distill_steps else None
        for _ in range(cfg.grad_accum):
            batch = next(batches)
            loss, m = compute_loss(model, batch, teacher=ref)
            engine.backward(loss)
            samples, tokens = samples + batch["input_ids"].shape[0], tokens + _tokens(batch)
        engine.step()
        dt = time.perf_counter() - t0
        last = {"loss": loss.item(), "lr": lr_at(step, cfg.steps, cfg.lr, cfg.warmup_frac),
                "samples_per_s": samples / dt, "tokens_per_s": tokens / dt,
                "reference": "teacher" if ref is not None else "target",
                **{k: v for k, v in m.items() if not torch.is_tensor(v) or v.numel() == 1}}
        last = {k: (v.item() if torch.is_tensor(v) else v) for k, v in last.items()}
        for k, v in m.items():
            if torch.is_tensor(v) and v.numel() > 1:
                last.update({f"{k}_{i + 1}": float(x) for i, x in enumerate(v.tolist())})
        if cfg.log_every and step % cfg.log_every == 0:
            log(step, last)
        is_eval = validate is not None and (
            step == cfg.steps - 1 or (cfg.eval_every and (step + 1) % cfg.eval_every == 0))
        if is_eval:
            val = validate(model)
            is_best = best is None or val["val_tau"] > best
            best = max(best or val["val_tau"], val["val_tau"])
            last.update(val)
            log(step, val)
            checkpoint(step, last, is_best)
    return last
