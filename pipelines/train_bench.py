"""Benchmark `train` (for `python -m jobs.benchmark train`): what the distributed engine
costs, and proof that it computes the same thing.

- `engine_overhead`: plain single-process samples/s over Ray Train + DeepSpeed samples/s
  per worker (2 CPU workers, ZeRO stage from the config), on the same shards, both after
  their first (warm-up) step; the plain loop gets as many torch threads as a worker (1 on
  CPU), so the figure is the price of the engine -- gradient all-reduce, ZeRO, Ray Data
  ingest -- not of the core count. 1.0 = free; 1.25 = a worker is 25% slower.
- `same_math`: the DeepSpeed path on 1 worker (ZeRO-1, fp32, same seed, same rows in
  the same order) against the plain loop: training loss of the last step and validation
  loss after N steps, relative difference within `SAME_MATH_RTOL`.

Both paths are built from `dlite.train.stage` and read rows via `pipelines.stages`;
the only differences are the engine and where the rows come from."""

import time
from pathlib import Path
from typing import Optional

import torch
from omegaconf import OmegaConf

from dlite.data import shards
from dlite.envinfo import env_info
from dlite.train import stage as st
from dlite.train.data import BatchStream
from dlite.train.loop import train_loop
from dlite.train.optim import PlainEngine
from dlite.train.step import validate
from pipelines.stages import TrainError, check_inputs, shuffle_buffer, split_inputs

# fp32 on CPU: DeepSpeed's flat ZeRO buffers and norm reductions sum in another order
# than per-tensor torch, so bitwise equality is not expected; 1e-4 relative is orders of
# magnitude below what a wrong scale, a missed step or a data mix-up would give.
SAME_MATH_RTOL = 1e-4


def plain_stage(cfg, stage: str, input_uri: str, teacher: Optional[str] = None,
                heldout: Optional[str] = None, threads: int = 1) -> dict:
    """The stage in this process with the plain engine: the rows of one DeepSpeed
    worker of a 1-worker run, in the same order. Returns the last step's metrics."""
    plan = st.plan_stage(cfg, stage)
    manifest = check_inputs(cfg, plan, input_uri, teacher)
    inputs = split_inputs(cfg, input_uri, heldout, manifest)
    if inputs.table is None:
        raise TrainError(f"{input_uri}: larger than data.cache_bytes; the plain loop holds its rows")
    rows = inputs.table.to_pylist()
    vocab = st.load_vocab(cfg.target)
    teacher_model = st.load_teacher(teacher, vocab) if plan.needs_teacher else None
    t = cfg.train
    engine = PlainEngine(st.build_model(cfg, plan, vocab, teacher_model), t.lr, t.weight_decay,
                         t.grad_clip, t.grad_accum)
    stream = BatchStream(lambda epoch: rows, t.batch_size, cfg.data.anchors_per_seq, cfg.run.seed,
                         shuffle_buffer(cfg), lambda r: shards.decode_row(r, manifest))
    val = st.val_batches(st.heldout_rows(**inputs.val), t.batch_size)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return train_loop(engine, stream, st.loop_config(cfg, plan), teacher=teacher_model,
                          validate=lambda model: validate(model, val))
    finally:
        torch.set_num_threads(before)


def _engine_stage(cfg, stage, input_uri, out: Path, teacher, heldout, workers: int, zero: int) -> dict:
    from pipelines.train import train_stage
    over = OmegaConf.merge(cfg, {"cluster": {"num_workers": workers}, "train": {"zero_stage": zero}})
    return train_stage(over, stage, input_uri, str(out), teacher=teacher, heldout=heldout)["final"]


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(a), abs(b), 1e-12)


def same_math(plain: dict, engine: dict) -> dict:
    keys = ("loss", "val_loss")
    diffs = {k: _rel(plain[k], engine[k]) for k in keys}
    return {**{f"{k}_plain": plain[k] for k in keys}, **{f"{k}_engine": engine[k] for k in keys},
            **{f"{k}_rel_diff": d for k, d in diffs.items()}, "rtol": SAME_MATH_RTOL,
            "ok": all(d <= SAME_MATH_RTOL for d in diffs.values())}


def run(cfg, input_uri: str, work_dir: str, stage: str = "teacher", teacher: Optional[str] = None,
        heldout: Optional[str] = None, workers: int = 2) -> dict:
    """Both measurements; `work_dir` holds the two engine runs' outputs (fresh dirs)."""
    work = Path(work_dir) / f"train-bench-{int(time.time())}"
    steps = st.plan_stage(cfg, stage).steps
    plain = plain_stage(cfg, stage, input_uri, teacher, heldout)
    one = _engine_stage(cfg, stage, input_uri, work / "ds1", teacher, heldout, 1, 1)
    many = _engine_stage(cfg, stage, input_uri, work / f"ds{workers}", teacher, heldout, workers,
                         cfg.train.zero_stage)
    per_worker = many["samples_per_s_avg"]
    return {"engine_overhead": plain["samples_per_s_avg"] / per_worker,
            "engine_overhead_1worker": plain["samples_per_s_avg"] / one["samples_per_s_avg"],
            "samples_per_s_plain": plain["samples_per_s_avg"],
            "samples_per_s_per_worker": per_worker, "samples_per_s_total": per_worker * workers,
            "workers": workers, "steps": steps, "stage": stage, "same_math": same_math(plain, one),
            "config": OmegaConf.to_container(cfg, resolve=True), "env": _env()}


def _env() -> dict:
    import deepspeed
    import ray
    return {**env_info(), "ray": ray.__version__, "deepspeed": deepspeed.__version__}
