"""Stages `teacher` / `align` / `dspark` on Ray Train (V2 TorchTrainer) + DeepSpeed.

The Ray-specific set-up lives here and only here; what a stage trains is
`dlite.train.plan`, the loop is `dlite.train.loop.train_loop`, the engine is
`pipelines.stages.engine.DeepSpeedEngine` -- none of them knows it runs under Ray.

  driver   checks the shards (fingerprint, `full` storage) and the teacher, splits off
           held-out rows, opens the stage's MLflow child run, runs the TorchTrainer,
           copies the best checkpoint's drafter to `<output>/drafter/`, writes
           `<output>/train.json` last (the completion marker: a rerun returns it)
  workers  one per GPU (NCCL) or CPU slot (gloo): the train shard through
           `get_dataset_shard` (equal split, so every rank draws the same number of
           batches and none waits forever in a collective); every rank validates on
           all held-out rows, read straight from Parquet (identical figures, no reduce)

Checkpoints: at every validation (`train.eval_every` steps and the end) every rank
saves its part of the DeepSpeed state into a temp dir and calls `ray.train.report`;
Ray merges the parts into `<storage>/<name>/step-NNNNNN/`, keeps the latest and the
best by `val_tau`. Rank 0 adds `drafter/` (the safetensors artifact at that step).
Resume: after a worker dies Ray restarts the group (`FailureConfig(max_failures)`) and
`ray.train.get_checkpoint()` hands every rank the latest checkpoint: weights, optimizer
partitions, step, data position and best score come back and the loop continues at
the next step; a rerun of the job with the same output resumes the same way.

Fault injection for tests: `DLITE_TRAIN_CRASH_AT_STEP=N` (read by the driver) makes
rank 1 (rank 0 alone) `os._exit(1)` after step N, once per output dir (marker file).
Tracking: rank 0 logs loss (total, per slot), lr, throughput and validation to the
stage's MLflow run, a child of the driver's `parent_run_id` when given, buffered and
sent every `FLUSH_S` seconds and at every checkpoint.

Per-worker speed (see `pipelines/benchmarks/train.py`): a small collection is replayed from
each worker's memory after the first epoch instead of a streaming split per epoch;
ranks run at normal CPU priority (`_renice`); rank 0 does not wait on a tracking write
per step. Shards: `full`, or `anchors` for the DLite student without the teacher
(`pipelines.stages.train_inputs.require_full`)."""

import hashlib
import json
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Optional

import ray
import ray.train
import ray.train.torch
import torch
from omegaconf import OmegaConf

from dlite.export import save_drafter
from dlite.train import plan as st
from dlite.train.data import BatchStream, training_row
from dlite.train.loop import train_loop
from dlite.train.step import validate
from pipelines.common import tracking
from pipelines.common.ray_cluster import init_ray
from pipelines.stages.collect import read_shards
from pipelines.stages.train_inputs import StageInputs, TrainError, check_inputs, keep_rows, shuffle_buffer, split_inputs

__all__ = ["TrainError", "train_stage"]

DONE = "train.json"
FLUSH_S = 10.0  # rank 0 sends its buffered metrics at least this often (and at checkpoints)


# ---------------------------------------------------------------- workers

class _ShardRows:
    """Raw rows of this rank's split, per epoch (decoded only when batched). A small
    collection (held in memory by the driver anyway) is read from the dataset shard
    once and replayed: a streaming split per epoch costs a Ray Data execution on the
    node's CPUs every few steps when an epoch is a handful of batches."""

    def __init__(self, it, cache: bool):
        self.it, self.cache, self.rows = it, cache, None

    def __call__(self, epoch: int):
        if self.rows is not None:
            return self.rows
        return self._read()

    def _read(self):
        rows = [] if self.cache else None
        for table in self.it.iter_batches(batch_size=64, batch_format="pyarrow", prefetch_batches=1):
            batch = table.to_pylist()
            if rows is not None:
                rows += batch
            yield from batch
        self.rows = rows


def _log_steps(uri: str, run_id: str, steps: list) -> None:
    """[(step, metrics)] in as few requests as the tracking API allows (1000 metrics
    each). Belongs in `pipelines.common.tracking` beside `log_metrics` (asked of its owner)."""
    from mlflow.entities import Metric
    now = int(time.time() * 1000)
    rows = [Metric(k, float(v), now, step) for step, m in steps for k, v in m.items()]
    for i in range(0, len(rows), 1000):
        tracking.client(uri).log_batch(run_id, metrics=rows[i:i + 1000])


class _Hooks:
    """The loop's callbacks on one rank: MLflow from rank 0, checkpoints from all."""

    def __init__(self, conf: dict, engine, stream: BatchStream, plan: st.StagePlan, resumed: bool):
        ctx = ray.train.get_context()
        self.rank, self.world = ctx.get_world_rank(), ctx.get_world_size()
        # After a restart the steps between the last checkpoint and the crash are
        # trained again; MLflow already has them, so rank 0 logs only newer steps.
        self.logged = (tracking.last_step(conf["mlflow_uri"], conf["run_id"], "loss")
                       if resumed and self.rank == 0 else -1)
        self.conf, self.engine, self.stream, self.plan = conf, engine, stream, plan
        self.cfg = OmegaConf.create(conf["cfg"])
        self.pending, self.flushed = [], time.monotonic()

    def flush(self) -> None:
        """Send the buffered steps in one request. Rank 0 buffers because a tracking
        write per step stalls it, and every other rank waits for it in the next
        all-reduce; steps lost in a crash are retrained and logged after the resume."""
        if self.pending:
            _log_steps(self.conf["mlflow_uri"], self.conf["run_id"], self.pending)
        self.pending, self.flushed = [], time.monotonic()

    def log(self, step: int, m: dict) -> None:
        if self.rank == 0 and step > self.logged:
            extra = {"samples_per_s_total": m["samples_per_s"] * self.world} if "samples_per_s" in m else {}
            self.pending.append((step, {**m, **extra}))
            if time.monotonic() - self.flushed > FLUSH_S:
                self.flush()
        crash = self.conf.get("crash_at_step")
        if crash is not None and step == crash and self.rank == min(1, self.world - 1):
            self._crash_once(step)

    def _crash_once(self, step: int) -> None:
        marker = Path(self.conf["crash_marker"])
        if marker.exists():
            return
        # Die only once the controller has registered the checkpoints reported so far:
        # a report still in flight when a worker dies is dropped by Ray, and the test
        # is about resuming from the last checkpoint, not about that race.
        ray.train.get_all_reported_checkpoints(
            consistency_mode=ray.train.CheckpointConsistencyMode.COMMITTED, timeout_s=120)
        marker.write_text(f"rank {self.rank} exited after step {step}\n")
        os._exit(1)

    def checkpoint(self, step: int, metrics: dict, is_best: bool) -> None:
        if self.rank == 0:
            self.flush()  # a checkpoint never runs ahead of the metrics logged before it
        state = {"step": step + 1, "stream": self.stream.state(), "best": metrics.get("best_val_tau")}
        with tempfile.TemporaryDirectory(prefix="dlite-ckpt-") as d:
            self.engine.save(d, {"dlite": state})
            with self.engine.gathered():
                if self.rank == 0:
                    fields = st.artifact_fields(self.cfg, self.plan, self.conf["manifest"], step + 1, metrics)
                    save_drafter(self.engine.module, Path(d) / "drafter", fields,
                                 st.card_sections(self.plan, step + 1, metrics))
            ray.train.report({**metrics, "step": step + 1, "global_steps": self.engine.global_steps},
                             checkpoint=ray.train.Checkpoint.from_directory(d),
                             checkpoint_dir_name=f"step-{step + 1:06d}")


def _resume(engine) -> dict:
    ckpt = ray.train.get_checkpoint()
    if ckpt is None:
        return {"step": 0, "stream": None, "best": None}
    with ckpt.as_directory() as d:
        return engine.load(d)["dlite"]


def _renice() -> None:
    """Back to normal CPU priority where allowed. Ray starts worker processes at nice
    15 so its own daemons stay responsive; a training rank is the job itself, and on a
    node shared with other work (CI, a laptop) it would otherwise lose every scheduling
    contest and run far slower than the same loop in a plain process. Linux niceness
    is per thread: this covers the calling (training) thread and threads it starts."""
    try:
        os.setpriority(os.PRIO_PROCESS, 0, 0)
    except (PermissionError, OSError):
        pass  # lowering niceness needs CAP_SYS_NICE; keep Ray's


def _validation_part(engine, rank: int, world: int) -> tuple:
    """(part, reduce) for `validate`: the ranks share each validation, each scoring its
    part, the totals all-reduced (on the engine's device, as NCCL needs) -- except under
    ZeRO-3, where every forward gathers parameters from all ranks in lockstep, so every
    rank scores everything."""
    if world < 2 or engine.settings.zero_stage >= 3:
        return (0, 1), None

    def total(x: torch.Tensor) -> torch.Tensor:
        x = x.to(engine.device)
        torch.distributed.all_reduce(x)
        return x.cpu()
    return (rank, world), total


def _worker(conf: dict) -> None:
    """One rank of the stage: build, resume, loop. Same code on 1 or N workers."""
    from pipelines.stages.engine import DeepSpeedEngine
    t0 = time.time()
    _renice()
    cfg, plan = OmegaConf.create(conf["cfg"]), st.StagePlan(**conf["plan"])
    device, world = ray.train.torch.get_device(), ray.train.get_context().get_world_size()
    vocab = st.load_vocab(cfg.target)
    teacher = st.load_teacher(conf["teacher"], vocab, device) if plan.needs_teacher else None
    draft_ids = torch.tensor(conf["draft_ids"]) if conf.get("draft_ids") else None
    engine = DeepSpeedEngine(st.build_model(cfg, plan, vocab, teacher, device, draft_ids), cfg.train, world)
    teacher = teacher.to(engine.dtype) if teacher is not None else None
    start = _resume(engine)
    decode = lambda row: training_row(row, conf["manifest"], cfg.train.supervise)  # noqa: E731
    rows = _ShardRows(ray.train.get_dataset_shard("train"), conf["cached"])
    stream = BatchStream(rows, cfg.train.batch_size,
                         cfg.data.anchors_per_seq, cfg.run.seed, conf["shuffle_buffer"], decode,
                         start=start["stream"])
    val_rows = st.heldout_rows(**conf["val"])
    val = st.val_batches(val_rows, cfg.train.batch_size, engine.device)
    # The replay walk (~30 s a validation in the main job on one rank) predicts the
    # evaluated drafter's tau; the history-aware teacher is never evaluated: no walk.
    walk_rows = None if plan.stage == "teacher" else val_rows
    hooks = _Hooks(conf, engine, stream, plan, resumed=start["step"] > 0)
    part, reduce = _validation_part(engine, hooks.rank, world)
    print(f"[train] rank {hooks.rank}/{world}: {plan.stage} ready in {time.time() - t0:.1f}s, "
          f"from step {start['step']} of {plan.steps} ({torch.get_num_threads()} threads)", flush=True)
    train_loop(engine, stream, st.loop_config(cfg, plan), start["step"], teacher,
               validate=lambda model: validate(model, val, cfg.eval.draft_stop_prob, walk_rows, part, reduce),
               log=hooks.log,
               checkpoint=hooks.checkpoint, best=start["best"])


# ---------------------------------------------------------------- driver

def _dataset(input_uri: str, inputs: StageInputs, fingerprint: dict):
    """The training rows as a Ray Dataset: cached from the table read by `split_inputs`
    (no read tasks, no Parquet reads per epoch), or streamed from storage when large."""
    if inputs.table is not None:
        return ray.data.from_arrow(inputs.table)
    ds = read_shards(input_uri, fingerprint)
    if inputs.held is None:
        return ds
    return ds.map_batches(keep_rows, fn_kwargs={"ids": inputs.held, "keep": False},
                          batch_format="pyarrow")


def _scaling(c) -> ray.train.ScalingConfig:
    """Workers as configured, except that on a CPU-only cluster they leave one CPU
    free: Ray Data's read tasks need a CPU slot, and a cluster fully booked by
    training actors would stall the ingest forever (2 workers on a 2-CPU machine)."""
    cpus = float(c.cpus_per_worker)
    total = ray.cluster_resources().get("CPU", 0)
    if not c.use_gpu and c.num_workers * cpus > total - 1:
        cpus = max(0.1, (total - 1) / c.num_workers)
    per = {"CPU": cpus, **({"GPU": c.gpus_per_worker} if c.use_gpu else {})}
    return ray.train.ScalingConfig(num_workers=c.num_workers, use_gpu=c.use_gpu, resources_per_worker=per)


def _storage(cfg, stage: str, output: Path) -> tuple:
    """(storage_path, run name): under the output dir, or a shared `cluster.storage_uri`."""
    if cfg.cluster.storage_uri:
        return cfg.cluster.storage_uri, f"{stage}-{hashlib.sha256(str(output).encode()).hexdigest()[:12]}"
    return str(output), "resume"


def _export_best(result, output: Path) -> dict:
    """Copy the best checkpoint's drafter (by val_tau) to <output>/drafter atomically."""
    best = result.get_best_checkpoint("val_tau", "max") or result.checkpoint
    metrics = next((m for c, m in result.best_checkpoints or [] if c.path == best.path), result.metrics)
    tmp = output / f"drafter.tmp-{os.getpid()}"
    with best.as_directory() as d:
        shutil.copytree(Path(d) / "drafter", tmp)
    shutil.rmtree(output / "drafter", ignore_errors=True)
    tmp.rename(output / "drafter")
    return metrics


def train_stage(cfg, stage: str, input_uri: str, output: str, teacher: Optional[str] = None,
                heldout: Optional[str] = None, parent_run_id: Optional[str] = None,
                label: Optional[str] = None) -> dict:
    """Run (or resume, or find finished) one training stage; returns its summary.
    `label` names its MLflow child run when it differs from the stage (the pipeline's
    `align_no_teacher` ablation is an `align` stage with `train.skip_teacher`)."""
    out, plan = Path(output).resolve(), st.plan_stage(cfg, stage)
    done = st.read_json(out / DONE)
    if done:
        return done
    manifest = check_inputs(cfg, plan, input_uri, teacher, heldout)
    inputs = split_inputs(cfg, input_uri, heldout, manifest)
    init_ray(cfg)
    train_ds = _dataset(input_uri, inputs, manifest["target_fingerprint"])
    with tracking.child_run(cfg, label or stage, out, parent_run_id) as run_id:
        # Chosen once on the driver from this collection's training rows (every rank builds
        # the same model); a student from a teacher keeps the teacher's.
        draft_ids, vocab_report = st.draft_vocab_from_shards(cfg, input_uri, held_ids=inputs.held)
        if vocab_report:
            tracking.log_metrics(cfg.tracking.uri, run_id, 0, {f"draft_vocab.{k}": v for k, v in vocab_report.items()})
        result = _fit(cfg, plan, stage, out, manifest, run_id, teacher, train_ds, inputs,
                      None if draft_ids is None else draft_ids.tolist())
        best = _export_best(result, out)
        summary = {"stage": stage, "plan": plan.__dict__, "run_id": run_id, "steps": result.metrics["step"],
                   "final": result.metrics, "best": best, "drafter": str(out / "drafter"),
                   "checkpoints": str(result.path)}
        tracking.log_metrics(cfg.tracking.uri, run_id, plan.steps, {"best_val_tau": best.get("val_tau", 0.0)})
    (out / DONE).write_text(json.dumps(summary, indent=2, default=str))
    return summary


def _fit(cfg, plan, stage, out: Path, manifest, run_id, teacher, train_ds, inputs: StageInputs, draft_ids=None):
    crash = os.environ.get("DLITE_TRAIN_CRASH_AT_STEP")
    conf = {"cfg": OmegaConf.to_container(cfg, resolve=True), "plan": plan.__dict__,
            "manifest": manifest, "teacher": teacher and str(st.teacher_dir(teacher)),
            "val": inputs.val, "run_id": run_id, "mlflow_uri": cfg.tracking.uri, "draft_ids": draft_ids,
            "shuffle_buffer": shuffle_buffer(cfg), "cached": inputs.table is not None,
            "crash_at_step": int(crash) if crash else None, "crash_marker": str(out / ".crash-marker")}
    # Ray Train gives a worker group 60 s to start; on busy or cold nodes that is slow,
    # not broken (the controller reads this from the driver's environment).
    os.environ.setdefault("RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S", "300")
    opts = ray.train.DataConfig.default_ingest_options()
    opts.preserve_order = True  # same data order on every run with the same split
    storage, name = _storage(cfg, stage, out)
    trainer = ray.train.torch.TorchTrainer(
        _worker, train_loop_config=conf, scaling_config=_scaling(cfg.cluster),
        torch_config=ray.train.torch.TorchConfig(backend=cfg.cluster.backend),
        run_config=ray.train.RunConfig(
            name=name, storage_path=storage,
            failure_config=ray.train.FailureConfig(max_failures=cfg.train.max_failures),
            checkpoint_config=ray.train.CheckpointConfig(
                num_to_keep=2, checkpoint_score_attribute="val_tau", checkpoint_score_order="max")),
        datasets={"train": train_ds},
        dataset_config=ray.train.DataConfig(execution_options=opts))
    return trainer.fit()
