"""The training loop, readable top to bottom (nanoGPT style): schedule → micro-batches
→ loss → backward → step, with validation, logging and checkpointing as visible `if`
blocks. It knows nothing about Ray or DeepSpeed: the engine (plain torch or DeepSpeed,
see `dlite.train.optim.PlainEngine` for the surface) and the callbacks (log /
checkpoint / validate) are passed in, so the same function runs a debug session on a
laptop and a resumed rank of a multi-node job."""

import math
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator, Optional

import torch

from dlite.models.teacher import head_parameters
from dlite.train.optim import lr_at
from dlite.train.step import LossSpec, compute_loss


@dataclass
class LoopConfig:
    steps: int
    lr: float
    warmup_frac: float = 0.04
    grad_accum: int = 1
    distill_steps: int = 0  # the first N steps use the teacher as reference (align stage)
    blend_steps: int = 0    # then N steps blending the teacher's loss into the target's
    eval_every: int = 0     # 0: validate only at the end
    log_every: int = 1
    spec: LossSpec = field(default_factory=LossSpec)
    # Recipe "published": the sequential head (copied from the teacher) frozen during the
    # distill steps; it trains again from the blend on, as in the authors' recipe.
    freeze_head: bool = False


def teacher_share(step: int, distill_steps: int, blend_steps: int) -> float:
    """The stage-1 (teacher) weight of a step: 1 while distilling, then a cosine from 1
    to 0 over the blend steps (stage 2 = 1 - it: 0.5 * (1 - cos(pi * i / (n - 1))), as the
    authors' transition epoch; 0.5 for a blend of one step), then 0."""
    i = step - distill_steps
    if i < 0:
        return 1.0
    if i >= blend_steps:
        return 0.0
    stage2 = 0.5 if blend_steps == 1 else 0.5 * (1 - math.cos(math.pi * i / (blend_steps - 1)))
    return 1.0 - stage2


def freeze_head(engine, frozen: bool, lr: float) -> None:
    """Freeze (or thaw) the model's sequential head: no gradients (as the authors), and
    learning rate 0 for its parameter group (`dlite.train.optim.adamw`), so no engine
    moves it -- DeepSpeed's ZeRO optimizer steps every parameter with a zero gradient
    where it has none, and decoupled weight decay would still shrink it. That group exists
    only for a model marked by `dlite.train.optim.separate_head`: without it, refuse."""
    groups = [g for g in engine.optimizer.param_groups if g.get("name") == "head"]
    if not groups:
        raise ValueError("freeze_head: the optimizer has no 'head' group (build the model with "
                         "dlite.train.optim.separate_head, as dlite.train.plan.build_model does)")
    for p in head_parameters(engine.module):
        p.requires_grad_(not frozen)
    for g in groups:
        g["lr"] = 0.0 if frozen else lr


def to_device(batch: dict, device) -> dict:
    if device is None or torch.device(device).type == "cpu":
        return batch
    return {k: (v.to(device, non_blocking=True) if torch.is_tensor(v) else v) for k, v in batch.items()}


def flat_metrics(m: dict) -> dict:
    """Scalars as floats; per-slot lists / tensors as `name_1..name_g` (1-based slots)."""
    out = {}
    for k, v in m.items():
        if torch.is_tensor(v):
            v = v.item() if v.numel() == 1 else v.tolist()
        if isinstance(v, (list, tuple)):
            out.update({f"{k}_{i + 1}": float(x) for i, x in enumerate(v)})
        elif isinstance(v, (int, float, bool)):
            out[k] = float(v)
    return out


def _throughput(dt: float, cpu: float, samples: int, tokens: int, run: list) -> dict:
    """This step's rates, and the means since the first (warm-up) step. `cpu_s` is the
    process's CPU time: unlike wall time it does not grow when other work shares the
    cores, so it shows an engine's extra work even on a busy machine."""
    n, s, c = run
    return {"step_s": dt, "cpu_s": cpu, "samples_per_s": samples / dt, "tokens_per_s": tokens / dt,
            "samples_per_s_avg": n / s if s else samples / dt,
            "cpu_s_per_sample_avg": c / n if n else cpu / samples}


def peak_memory(device) -> dict:
    """`peak_gpu_bytes` (torch's allocator high-water mark on this worker's GPU) on CUDA;
    nothing on CPU, where the allocator keeps no such count."""
    if torch.device(device).type != "cuda":
        return {}
    return {"peak_gpu_bytes": float(torch.cuda.max_memory_allocated(device))}


def is_eval_step(step: int, cfg: LoopConfig) -> bool:
    return step == cfg.steps - 1 or bool(cfg.eval_every and (step + 1) % cfg.eval_every == 0)


def train_loop(engine, batches: Iterator[dict], cfg: LoopConfig, start_step: int = 0,
               teacher=None, validate: Optional[Callable] = None,
               log: Callable = lambda step, m: None,
               checkpoint: Callable = lambda step, metrics, is_best: None,
               best: Optional[float] = None) -> dict:
    """Run optimiser steps start_step..cfg.steps-1; returns the last metrics. Validation
    and the checkpoint call happen every `eval_every` steps and at the end, so a
    checkpoint always carries the validation it is ranked by; `best` is the best
    `val_tau` so far (a resumed run passes its checkpoint's)."""
    model, last = engine.module, {}
    run = [0, 0.0, 0.0]  # samples, wall s, CPU s of the steps after the first (warm-up)
    for step in range(start_step, cfg.steps):
        t0, c0 = time.perf_counter(), time.process_time()
        samples, tokens, loss_sum, data_s = 0, 0, 0.0, 0.0
        model.train()
        lr = lr_at(step, cfg.steps, cfg.lr, cfg.warmup_frac)
        engine.set_lr(lr)
        share = teacher_share(step, cfg.distill_steps, cfg.blend_steps) if teacher is not None else 0.0
        ref = teacher if share > 0 else None
        if cfg.freeze_head:
            freeze_head(engine, step < cfg.distill_steps, lr)
        for _ in range(cfg.grad_accum):
            t_data = time.perf_counter()
            batch = to_device(next(batches), engine.device)
            data_s += time.perf_counter() - t_data  # waiting for input: ingest, decode, collate
            loss, m = compute_loss(model, batch, teacher=ref, spec=cfg.spec, teacher_share=share)
            engine.backward(loss)
            loss_sum += loss.item()
            samples += batch["input_ids"].shape[0]
            tokens += int(batch["seq_lens"].sum()) if "seq_lens" in batch else batch["input_ids"].numel()
        engine.step()
        dt, cpu = time.perf_counter() - t0, time.process_time() - c0
        if step > start_step:
            run = [run[0] + samples, run[1] + dt, run[2] + cpu]
        # Per-slot figures are the last micro-batch's; the loss is the step's mean.
        last = {**flat_metrics(m), "loss": loss_sum / cfg.grad_accum, "lr": lr,
                **_throughput(dt, cpu, samples, tokens, run), "data_s": data_s,
                "distilling": float(ref is not None), "teacher_share": share, **peak_memory(engine.device)}
        if cfg.log_every and (step % cfg.log_every == 0 or step == cfg.steps - 1):
            log(step, last)
        if is_eval_step(step, cfg):
            val = validate(model) if validate is not None else {}
            is_best = "val_tau" in val and (best is None or val["val_tau"] > best)
            best = val["val_tau"] if is_best else best
            val = {**val, **({"best_val_tau": best} if best is not None else {})}
            last = {**last, **val}
            if val:
                log(step, val)
            checkpoint(step, last, is_best)
    return last
