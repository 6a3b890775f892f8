"""The DeepSpeed engine behind one object (OpenRLHF style), with the same surface as
`dlite.train.optim.PlainEngine`, so `dlite.train.loop.train_loop` drives either unchanged:
`module`, `device`, `dtype`, `backward`, `step`, `set_lr`, `global_steps`, `gathered`,
plus `save` / `load` of the full resume state (weights, optimizer partitions, counters).

Settings come from our config, never from a DeepSpeed JSON: `train.zero_stage`,
`train.precision`, `train.batch_size` per worker, `train.grad_accum`, `train.grad_clip`.
`resolve` reads a null stage / precision (the schema's default) as the accelerator's
default: ZeRO-2 + bf16 on GPU, ZeRO-0 + fp32 on CPU. The optimiser is ours
(`dlite.train.optim.adamw`), so a DeepSpeed run and a plain run do the same math
(`pipelines/benchmarks/train.py` checks it).
Needs torch.distributed already initialised (Ray Train's TorchConfig does it)."""

import contextlib
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import deepspeed
import torch

from dlite.train.optim import adamw

TAG = "state"  # one DeepSpeed tag per checkpoint directory: the directory is the version


@dataclass
class EngineSettings:
    zero_stage: int
    precision: str  # "fp32" | "bf16"

    @property
    def dtype(self) -> torch.dtype:
        return torch.bfloat16 if self.precision == "bf16" else torch.float32


def resolve(train_cfg, on_gpu: bool) -> EngineSettings:
    """Config values, with null meaning the accelerator's default."""
    zero = train_cfg.get("zero_stage")
    precision = train_cfg.get("precision")
    return EngineSettings(zero_stage=(2 if on_gpu else 0) if zero is None else int(zero),
                          precision=precision or ("bf16" if on_gpu else "fp32"))


def ds_config(train_cfg, settings: EngineSettings, world_size: int) -> dict:
    """The DeepSpeed config dict, built from ours."""
    b, ga = train_cfg.batch_size, train_cfg.grad_accum
    return {
        "train_micro_batch_size_per_gpu": b, "gradient_accumulation_steps": ga,
        "train_batch_size": b * ga * world_size, "gradient_clipping": train_cfg.grad_clip,
        "zero_optimization": {"stage": settings.zero_stage},
        "bf16": {"enabled": settings.precision == "bf16"},
        # our AdamW is a plain torch optimiser: ZeRO 1/2 partition it like any other
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 1 << 30, "wall_clock_breakdown": False,
    }


def _own_extension_dir() -> None:
    """JIT-built DeepSpeed ops (any DeepSpeed builds at `initialize`; on CPU the
    shared-memory comm op is skipped, `_skip_shm_comm_build`) go under this
    environment's prefix, not the per-user ~/.cache/torch_extensions: two virtualenvs
    (a checkout and a CI clone) sharing that dir rebuild it over each other, and a
    worker killed mid-build leaves a lock that every later run waits on forever.
    TORCH_EXTENSIONS_DIR, when set, wins."""
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(Path(sys.prefix) / "torch_extensions"))


def _skip_shm_comm_build() -> None:
    """On CPU, DeepSpeed's communication backend JIT-builds its shared-memory kernel the
    first time a venv initialises (measured ~50 s of the main job's first training
    stage on 2 cores). Only `inference_all_reduce` (DeepSpeed's tensor-parallel
    inference) calls it; training all-reduces through torch.distributed (gloo here).
    Marking the op incompatible in DeepSpeed's per-process table (kept in the module,
    so the edit holds) makes the backend skip it, as it does where the op cannot build."""
    ops = getattr(deepspeed.ops, "__compatible_ops__", None)
    if isinstance(ops, dict):
        ops["deepspeed_shm_comm"] = False


class DeepSpeedEngine:
    """A drafter wrapped by `deepspeed.initialize` with our AdamW."""

    def __init__(self, model: torch.nn.Module, train_cfg, world_size: int,
                 settings: Optional[EngineSettings] = None):
        _own_extension_dir()
        on_gpu = next(model.parameters()).device.type == "cuda"
        if not on_gpu:
            _skip_shm_comm_build()
        self.settings = settings or resolve(train_cfg, on_gpu)
        optimizer = adamw(model, train_cfg.lr, train_cfg.weight_decay)
        self.ds, self.optimizer, _, _ = deepspeed.initialize(
            model=model, optimizer=optimizer,
            config=ds_config(train_cfg, self.settings, world_size))
        self.module, self.device, self.dtype = self.ds.module, self.ds.device, self.settings.dtype

    def backward(self, loss: torch.Tensor) -> None:
        # DeepSpeed counts micro-batches in step(): it must follow every backward, and
        # only applies the update (all-reduce, clip, AdamW) on the accumulation boundary.
        self.ds.backward(loss)
        self.ds.step()

    def step(self) -> bool:
        """The update already happened in the last backward's micro-step."""
        return self.ds.was_step_applied()

    def set_lr(self, lr: float) -> None:
        for g in self.ds.optimizer.param_groups:
            g["lr"] = lr

    @property
    def global_steps(self) -> int:
        return self.ds.global_steps

    def gathered(self):
        """Full weights on every rank for the block (ZeRO-3 partitions them)."""
        if self.settings.zero_stage < 3:
            return contextlib.nullcontext()
        return deepspeed.zero.GatheredParameters(list(self.module.parameters()), modifier_rank=None)

    def save(self, directory: str, client_state: dict) -> None:
        """Collective: every rank writes its part (rank 0 the weights, each rank its
        optimizer partition) under `directory`."""
        self.ds.save_checkpoint(directory, tag=TAG, client_state=client_state)

    def load(self, directory: str) -> dict:
        """Restore weights, optimizer and step counters; returns the client state."""
        path, client_state = self.ds.load_checkpoint(directory, tag=TAG)
        if path is None:
            raise FileNotFoundError(f"no DeepSpeed checkpoint '{TAG}' under {directory}")
        return client_state
