"""Optimiser pieces every engine shares: AdamW over the trainable parameters only (the
frozen target embedding/lm_head are buffers and never reach it), linear warm-up then
cosine decay, and the plain single-process engine used for debugging and tests."""

import contextlib
import math

import torch

from dlite.models.teacher import head_parameters


def lr_at(step: int, total: int, lr: float, warmup_frac: float, floor: float = 0.1) -> float:
    """Warm-up over `warmup_frac` of the steps, then cosine from lr down to floor*lr."""
    warm = max(1, round(total * warmup_frac))
    if step < warm:
        return lr * (step + 1) / warm
    prog = min(1.0, (step - warm) / max(1, total - warm))
    return lr * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * prog)))


def separate_head(model) -> None:
    """Mark `model` for a "head" parameter group of its own (`adamw`): the published
    recipe's align stage freezes the copied sequential head by that group's lr
    (`dlite.train.loop.freeze_head`). Marked where the model is built
    (`dlite.train.plan.build_model`), because every engine builds its optimizer from the
    bare model and DeepSpeed's calls `adamw` with nothing else to go on."""
    model.separate_head_group = True


def adamw(model, lr: float, weight_decay: float) -> torch.optim.AdamW:
    """AdamW over the trainable parameters, in one group named "body"; a model marked by
    `separate_head` also gets its sequential head (`head_parameters`) as a group named
    "head". Only that model: an optimizer's state loads only into the same group layout,
    and every checkpoint saved before the published recipe has one group."""
    params = [p for p in model.parameters() if p.requires_grad]
    apart = getattr(model, "separate_head_group", False)
    head = {id(p) for p in head_parameters(model)} if apart else set()
    groups = [{"params": [p for p in params if id(p) not in head], "name": "body"},
              {"params": [p for p in params if id(p) in head], "name": "head"}]
    return torch.optim.AdamW([g for g in groups if g["params"]], lr=lr, betas=(0.9, 0.95),
                             weight_decay=weight_decay)


class PlainEngine:
    """Single-process torch: accumulate `grad_accum` micro-batches, clip, step. The
    engine surface every engine offers (`pipelines.stages.engine.DeepSpeedEngine` too):
    `module`, `device`, `dtype`, `backward`, `step`, `set_lr`, `global_steps`,
    `gathered`; resume state here is `state_dict` / `load_state_dict`."""

    def __init__(self, model, lr: float, weight_decay: float, grad_clip: float, grad_accum: int = 1):
        self.module, self.grad_clip, self.grad_accum = model, grad_clip, grad_accum
        self.optimizer = adamw(model, lr, weight_decay)
        first = next(model.parameters())
        self.device, self.dtype = first.device, first.dtype
        self._micro, self.global_steps = 0, 0

    def backward(self, loss: torch.Tensor) -> None:
        (loss / self.grad_accum).backward()
        self._micro += 1

    def step(self) -> bool:
        """Apply the update once `grad_accum` micro-batches are in; True when it did."""
        if self._micro < self.grad_accum:
            return False
        if self.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_([p for p in self.module.parameters() if p.requires_grad],
                                           self.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self._micro, self.global_steps = 0, self.global_steps + 1
        return True

    def set_lr(self, lr: float) -> None:
        for g in self.optimizer.param_groups:
            g["lr"] = lr

    def gathered(self):
        """Full weights are always local here (ZeRO-3 engines gather them)."""
        return contextlib.nullcontext()

    def state_dict(self) -> dict:
        return {"model": self.module.state_dict(), "optimizer": self.optimizer.state_dict(),
                "global_steps": self.global_steps}

    def load_state_dict(self, sd: dict) -> None:
        self.module.load_state_dict(sd["model"])
        self.optimizer.load_state_dict(sd["optimizer"])
        self.global_steps = sd.get("global_steps", 0)
