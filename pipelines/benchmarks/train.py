"""Benchmark `train` (`python -m jobs.benchmark train`): what the distributed engine
costs, proof that it computes the same thing, and what the teacher stage buys. One run
collects its own shards from the built-in corpus (`data.n_train` train records, the
held-out split's `data.n_heldout` for validation), then measures:

- `engine_overhead`: plain single-process samples/s over Ray Train + DeepSpeed samples/s
  per worker (`cluster.num_workers`, 2 on the embedded default; ZeRO stage from the
  config), `dspark` stage for `train.steps_dspark` steps, on the same shards. Both rates
  skip the first (warm-up) step and exclude validation/checkpoints. The plain loop runs
  before AND after the engine run and its mean is the reference, so load that comes
  and goes on a shared machine hits both sides alike. The plain loop gets as many torch
  threads as a worker (1 on CPU). 1.0 = free; 1.25 = a worker is 25% slower. On a
  machine with as many cores as workers this also holds what N busy processes cost
  each other, so two more figures split it: `parallel_plain_share` (N plain loops at
  once in N processes against one alone: the machine's part) and
  `engine_overhead_vs_parallel_plain` (the engine's own part: gradient all-reduce,
  ZeRO, Ray Data ingest, Ray's daemons, waiting for the slowest rank); and
  `engine_overhead_cpu` compares CPU seconds per sample, which load does not inflate.
- `same_math`: the DeepSpeed path on 1 worker (ZeRO-1, fp32, same seed, same rows in
  the same order) against the plain loop: training loss of the last step and
  validation loss after N steps, relative difference within `SAME_MATH_RTOL`.
- `teacher_ablation`: teacher-forced validation tau (`val_tau`, best checkpoint and
  last step) of the DLite student trained through the real stages (Ray Train +
  DeepSpeed) after teacher -> align, against align with `train.skip_teacher=true`.
  Budget accounting, both reported: `no_teacher_same_student_steps` gets
  `train.steps_align` steps (the teacher's steps are extra compute for the other arm);
  `no_teacher_same_total_steps` gets `steps_teacher + steps_align` steps.

Every path is built from `dlite.train.plan` and reads rows via `pipelines.stages.train_inputs`; the
plain and engine paths differ only in the engine and where the rows come from."""

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

import torch
from omegaconf import OmegaConf

from dlite.envinfo import env_info
from dlite.train import plan as st
from dlite.train.data import BatchStream, training_row
from dlite.train.loop import train_loop
from dlite.train.optim import PlainEngine
from dlite.train.step import validate
from pipelines.stages.train_inputs import TrainError, check_inputs, shuffle_buffer, split_inputs

# fp32 on CPU: DeepSpeed's flat ZeRO buffers and norm reductions sum in another order
# than per-tensor torch, so bitwise equality is not expected; 1e-4 relative is orders of
# magnitude below what a wrong scale, a missed step or a data mix-up would give.
SAME_MATH_RTOL = 1e-4
ENGINE_STAGE = "dspark"  # sized by train.steps_dspark, which the ablation leaves alone


def plain_stage(cfg, stage: str, input_uri: str, teacher: Optional[str] = None,
                heldout: Optional[str] = None, threads: int = 1, barrier=None) -> dict:
    """The stage in this process with the plain engine: the rows of one DeepSpeed
    worker of a 1-worker run, in the same order. Returns the last step's metrics.
    `barrier.wait()` is called just before the loop (copies of a parallel run meet
    there, so their timed steps overlap)."""
    plan = st.plan_stage(cfg, stage)
    manifest = check_inputs(cfg, plan, input_uri, teacher, heldout)
    inputs = split_inputs(cfg, input_uri, heldout, manifest)
    if inputs.table is None:
        raise TrainError(f"{input_uri}: larger than data.cache_bytes; the plain loop holds its rows")
    rows = inputs.table.to_pylist()
    vocab, device = st.load_vocab(cfg.target), _device(cfg)
    teacher_model = st.load_teacher(teacher, vocab, device) if plan.needs_teacher else None
    t = cfg.train
    draft_ids, _ = st.draft_vocab_from_shards(cfg, input_uri, held_ids=inputs.held)
    engine = PlainEngine(st.build_model(cfg, plan, vocab, teacher_model, device, draft_ids), t.lr,
                         t.weight_decay, t.grad_clip, t.grad_accum)
    stream = BatchStream(lambda epoch: rows, t.batch_size, cfg.data.anchors_per_seq, cfg.run.seed,
                         shuffle_buffer(cfg), lambda r: training_row(r, manifest, t.supervise))
    val = st.val_batches(st.heldout_rows(**inputs.val), t.batch_size, device)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    if barrier is not None:
        barrier.wait()
    try:
        return train_loop(engine, stream, st.loop_config(cfg, plan), teacher=teacher_model,
                          validate=lambda model: validate(model, val))
    finally:
        torch.set_num_threads(before)


def _device(cfg) -> torch.device:
    """Where a worker of `cluster` would train: the plain loop must compete on the same
    device as the engine it is compared with (fp32 there: PlainEngine has no bf16)."""
    gpu = cfg.cluster.use_gpu and torch.cuda.is_available()
    return torch.device("cuda" if gpu else "cpu")


class _FileBarrier:
    """n processes meet here: each drops a file in `d` and waits for all n."""

    def __init__(self, d: str, i: int, n: int):
        self.d, self.i, self.n = Path(d), i, n

    def wait(self, timeout: float = 900.0) -> None:
        (self.d / f"ready-{self.i}").touch()
        deadline = time.time() + timeout
        while len(list(self.d.glob("ready-*"))) < self.n:
            if time.time() > deadline:
                raise TimeoutError(f"parallel plain loops: {self.n} did not all start in {timeout:.0f}s")
            time.sleep(0.05)


def _plain_copy(d: str, i: int) -> None:
    """One copy of `parallel_plain`, in its own interpreter."""
    job = json.loads((Path(d) / "job.json").read_text())
    m = plain_stage(OmegaConf.create(job["cfg"]), job["stage"], job["input"], heldout=job["heldout"],
                    barrier=_FileBarrier(d, i, job["n"]))
    (Path(d) / f"result-{i}.json").write_text(json.dumps(m))


def parallel_plain(cfg, stage: str, input_uri: str, heldout: Optional[str], n: int) -> list:
    """n plain loops at once, one fresh interpreter each (not multiprocessing: its
    spawn re-runs the caller's main module), timed steps aligned by a barrier: what n
    single-thread processes get from this machine with no engine at all."""
    root = str(Path(__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    with tempfile.TemporaryDirectory(prefix="dlite-plain-") as d:
        (Path(d) / "job.json").write_text(json.dumps(
            {"cfg": OmegaConf.to_container(cfg, resolve=True), "stage": stage, "input": input_uri,
             "heldout": heldout, "n": n}))
        code = "import sys; from pipelines.benchmarks.train import _plain_copy; _plain_copy(sys.argv[1], int(sys.argv[2]))"
        procs = [subprocess.Popen([sys.executable, "-c", code, d, str(i)], env=env) for i in range(n)]
        if any(p.wait() != 0 for p in procs):
            raise RuntimeError(f"parallel plain loops failed: exit codes {[p.returncode for p in procs]}")
        return [json.loads((Path(d) / f"result-{i}.json").read_text()) for i in range(n)]


def _engine_stage(cfg, stage, input_uri, out: Path, teacher=None, heldout=None, **train) -> dict:
    """The real stage (Ray Train + DeepSpeed) with `train.*` / `cluster.*` overrides."""
    from pipelines.stages.train import train_stage
    workers = train.pop("workers", cfg.cluster.num_workers)
    over = OmegaConf.merge(cfg, {"cluster": {"num_workers": workers}, "train": train})
    t0 = time.time()
    summary = train_stage(over, stage, input_uri, str(out), teacher=teacher, heldout=heldout)
    return {**summary, "wall_s": time.time() - t0}


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(a), abs(b), 1e-12)


def same_math(plain: dict, engine: dict) -> dict:
    keys = ("loss", "val_loss")
    diffs = {k: _rel(plain[k], engine[k]) for k in keys}
    return {**{f"{k}_plain": plain[k] for k in keys}, **{f"{k}_engine": engine[k] for k in keys},
            **{f"{k}_rel_diff": d for k, d in diffs.items()}, "rtol": SAME_MATH_RTOL,
            "ok": all(d <= SAME_MATH_RTOL for d in diffs.values())}


def _mean(runs: list, key: str) -> float:
    return sum(r[key] for r in runs) / len(runs)


def engine_overhead(cfg, input_uri: str, work: Path, heldout: Optional[str] = None,
                    stage: str = ENGINE_STAGE, with_same_math: bool = True) -> dict:
    """Plain loop, N-worker engine, N plain loops at once, plain loop again, then the
    1-worker same-math run. Besides the goal figure (solo plain loop over a worker):
    `parallel_plain_share` = what the machine alone takes from N concurrent processes,
    `engine_overhead_vs_parallel_plain` = the engine's own price on top of it, and
    `engine_overhead_cpu` = CPU seconds per sample, worker over plain (robust to load).
    `with_same_math=False` skips the 1-worker fp32 run (and the fields it feeds)."""
    workers, rate = cfg.cluster.num_workers, "samples_per_s_avg"
    plain = [plain_stage(cfg, stage, input_uri, heldout=heldout)]
    many = _engine_stage(cfg, stage, input_uri, work / f"ds{workers}", heldout=heldout)["final"]
    parallel = parallel_plain(cfg, stage, input_uri, heldout, workers) if workers > 1 else plain
    plain.append(plain_stage(cfg, stage, input_uri, heldout=heldout))
    solo, per_worker = _mean(plain, rate), many[rate]
    out = {"engine_overhead": solo / per_worker, "peak_gpu_bytes_engine": many.get("peak_gpu_bytes"),
            "engine_overhead_vs_parallel_plain": _mean(parallel, rate) / per_worker,
            "parallel_plain_share": solo / _mean(parallel, rate),
            "engine_overhead_cpu": many["cpu_s_per_sample_avg"] / _mean(plain, "cpu_s_per_sample_avg"),
            "samples_per_s_plain": solo, "samples_per_s_plain_runs": [p[rate] for p in plain],
            "samples_per_s_parallel_plain": [p[rate] for p in parallel],
            "samples_per_s_per_worker": per_worker, "samples_per_s_total": per_worker * workers,
            "load_avg_1min": os.getloadavg()[0],
            "workers": workers, "steps": st.plan_stage(cfg, stage).steps, "stage": stage}
    if not with_same_math:
        return out
    one = _engine_stage(cfg, stage, input_uri, work / "ds1", heldout=heldout, workers=1,
                        zero_stage=1, precision="fp32")["final"]
    return {**out, "engine_overhead_1worker": solo / one[rate], "samples_per_s_1worker": one[rate],
            "same_math": same_math(plain[0], one)}


def _arm(summary: dict) -> dict:
    best, final = summary["best"], summary["final"]
    return {"steps": summary["steps"], "val_tau_best": best.get("val_tau"),
            "val_tau_last": final.get("val_tau"), "val_loss_last": final.get("val_loss"),
            "samples_per_s_per_worker": final.get("samples_per_s_avg"), "wall_s": summary["wall_s"]}


def teacher_ablation(cfg, input_uri: str, work: Path, heldout: str) -> dict:
    """teacher -> align against align without the teacher, at both step budgets."""
    t = cfg.train
    teacher = _engine_stage(cfg, "teacher", input_uri, work / "teacher", heldout=heldout)
    arms = {"with_teacher": _engine_stage(cfg, "align", input_uri, work / "align", heldout=heldout,
                                          teacher=str(work / "teacher")),
            "no_teacher_same_student_steps": _engine_stage(
                cfg, "align", input_uri, work / "align_nt", heldout=heldout, skip_teacher=True),
            "no_teacher_same_total_steps": _engine_stage(
                cfg, "align", input_uri, work / "align_nt_total", heldout=heldout, skip_teacher=True,
                steps_align=t.steps_teacher + t.steps_align)}
    out = {"teacher": _arm(teacher), **{k: _arm(v) for k, v in arms.items()}}
    tau = {k: out[k]["val_tau_best"] for k in arms}
    out["delta_val_tau_vs_same_student_steps"] = tau["with_teacher"] - tau["no_teacher_same_student_steps"]
    out["delta_val_tau_vs_same_total_steps"] = tau["with_teacher"] - tau["no_teacher_same_total_steps"]
    out["budget"] = (f"with_teacher: {t.steps_teacher} teacher + {t.steps_align} student steps "
                     f"({round(t.distill_frac * t.steps_align)} distilling); no_teacher_same_student_steps: "
                     f"{t.steps_align}; no_teacher_same_total_steps: {t.steps_teacher + t.steps_align}; "
                     f"global batch {t.batch_size * t.grad_accum * cfg.cluster.num_workers} sequences/step")
    return out


def collect_inputs(cfg, work: Path) -> tuple:
    """(train shards, held-out shards) of the built-in corpus, `full` storage."""
    from pipelines.stages.collect import collect
    full = OmegaConf.merge(cfg, {"data": {"storage_mode": "full"}})
    collect(full, "builtin:train", str(work / "shards"))
    collect(full, "builtin:heldout", str(work / "heldout"))
    return str(work / "shards"), str(work / "heldout")


def benchmark(cfg, work_dir: Optional[str] = None) -> dict:
    """The whole report. Stage outputs and their MLflow runs (a SQLite store) go to
    `work_dir`, or to a temporary directory removed afterwards."""
    work = Path(work_dir or tempfile.mkdtemp(prefix="dlite-train-bench-"))
    cfg = OmegaConf.merge(cfg, {"tracking": {"uri": f"sqlite:///{work.resolve() / 'mlflow.db'}"}})
    t0 = time.time()
    try:
        train_uri, heldout = collect_inputs(cfg, work)
        report = engine_overhead(cfg, train_uri, work / "engine", heldout)
        report["teacher_ablation"] = teacher_ablation(cfg, train_uri, work / "ablation", heldout)
    finally:
        if work_dir is None:
            shutil.rmtree(work, ignore_errors=True)
    return {**report, "wall_s": time.time() - t0,
            "config": OmegaConf.to_container(cfg, resolve=True), "env": _env()}


def _env() -> dict:
    import deepspeed
    import ray
    return {**env_info(), "ray": ray.__version__, "deepspeed": deepspeed.__version__}
