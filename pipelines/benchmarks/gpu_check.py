"""Benchmark `gpu_check` (`python -m jobs.benchmark gpu_check`, run by
`scripts/gpu_check.sh`): the first run on a GPU, prepared so that one short lease
answers "does the pipeline work there, and how fast is it".

One run = the pipeline DAG (collect -> teacher -> align, dspark -> evaluate; no
ablation, no publish) as a subprocess with the config it is given (the script passes a
GPU size: one worker, ZeRO-2, bf16; on a machine without a GPU a smoke size on CPU),
then the engine comparison of `pipelines.benchmarks.train.engine_overhead` on the
collection's own shards (without its 1-worker fp32 rerun), all in one JSON:
absolute tokens/s of plain and speculative decoding (greedy, speed worker), tau,
speedup, lossless, samples/s and peak GPU memory of every training stage (torch's
allocator high-water mark on the worker; CPU runs have none), the engine overhead,
and the seconds of each part. Stages finished earlier with the same settings in the
same `run.output_dir` are reused, as in every pipeline run (the seconds say so)."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch
from omegaconf import OmegaConf

STAGES = ["collect", "teacher", "align", "dspark", "evaluate"]
TRAIN_STAGES = ("teacher", "align", "dspark")
BUDGET_S = 480  # the 8 minutes a device check may take (issue 16)


def run_pipeline(config: str, overrides: list, log: Path) -> dict:
    """`python -m jobs.pipeline` on the DAG above; its summary.json (raises on failure,
    naming the log). The pipeline's own exit status 1 (not lossless) is reported, not raised."""
    root = Path(__file__).resolve().parents[2]
    cmd = [sys.executable, "-m", "jobs.pipeline", "--config", config, *overrides,
           f"run.stages=[{','.join(STAGES)}]"]
    with open(log, "w") as f:
        rc = subprocess.run(cmd, cwd=root, stdout=f, stderr=subprocess.STDOUT).returncode
    done = [ln for ln in log.read_text().splitlines() if ln.startswith("[pipeline] done in")]
    if rc not in (0, 1) or not done:
        raise RuntimeError(f"gpu_check: the pipeline failed (exit {rc}); see {log}")
    return json.loads(Path(done[-1].rsplit(": ", 1)[1]).read_text())


def _decoding(report: dict) -> dict:
    """Greedy figures of each learned drafter from the evaluation report."""
    out = {}
    for name, m in report["methods"].items():
        tps = m.get("tokens_per_s") or {}
        out[name] = {"tau": m["tau"], "speedup_vs_ar": m["speedup_vs_ar"], "lossless": m["lossless"],
                     "tokens_per_s_plain": tps.get("plain"), "tokens_per_s_spec": tps.get("spec"),
                     "speedup_vs_ar_by_bucket": m.get("speedup_vs_ar_by_bucket"),
                     "rounds": m.get("n_rounds"), "drafted": m.get("drafted")}
    return out


def _device() -> dict:
    if not torch.cuda.is_available():
        return {"device": "cpu", "gpu": None}
    p = torch.cuda.get_device_properties(0)
    return {"device": "cuda", "gpu": p.name, "gpu_memory_bytes": p.total_memory}


def run(cfg, args) -> dict:
    """The whole check; `args.config` / `args.overrides` go to the pipeline unchanged."""
    from dlite.envinfo import env_info
    from pipelines.benchmarks.train import engine_overhead
    work = Path(cfg.run.output_dir).resolve()
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    summary = run_pipeline(args.config, list(args.overrides), work / "gpu_check_pipeline.log")
    t_pipeline = time.time() - t0
    res = summary["results"]
    report = json.loads(Path(res["evaluate"]["report"]).read_text())
    engine = engine_overhead(cfg, res["collect"]["shards"], work / "engine", with_same_math=False)
    wall = time.time() - t0
    return {
        **_device(), "wall_s": wall, "pipeline_s": t_pipeline, "engine_overhead_s": wall - t_pipeline,
        "within_budget": wall <= BUDGET_S, "budget_s": BUDGET_S,
        "stage_seconds": {s: res[s].get("seconds") for s in STAGES if s in res},
        "stages_reused": [s["stage"] for s in summary["stages"] if s["status"] in ("done", "reuse")],
        "decoding": _decoding(report), "lossless": report["lossless"],
        "training": {s: {k: res[s].get(k) for k in ("samples_per_s", "peak_gpu_bytes", "best_val_tau", "steps")}
                     for s in TRAIN_STAGES if s in res},
        "engine": engine, "precision": cfg.train.precision, "zero_stage": cfg.train.zero_stage,
        "summary": summary["output_dir"], "mlflow_run": summary.get("mlflow_link"),
        "config": OmegaConf.to_container(cfg, resolve=True),
        "env": {**env_info(), "DS_ACCELERATOR": os.environ.get("DS_ACCELERATOR")},
    }
