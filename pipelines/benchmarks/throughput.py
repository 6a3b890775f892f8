"""Throughput at concurrency 1..16 (issue 30): closed-loop batched decoding of held-out
agent turns with their real histories, every method beside plain decoding batched the
same way (`pipelines.stages.evaluate_throughput`, measured by `dlite.bench.throughput`).

    python -m jobs.benchmark throughput --config configs/experiments/smollm2.yaml --out F
        --concurrency 1,2,4,8,16 [--drafter NAME=DIR ...] [--requests N]
        [--min-context 1024] [--max-context 8192] [--repeats 1] [key=value ...]

Drafters: --drafter NAME=DIR (repeatable; default: this config's finished align stage,
and its dspark stage when finished). Methods: those, `eval.baselines` and
`eval.hybrids` (choose and tree), scored as the evaluation stage scores them: a
calibration fitted on validation turns first (never the measured ones; with the
verify-cost curve measured here; `eval.calibration_trajectories` 0: the defaults),
saved in the JSON as `calibration`. Requests:
--requests turns (default twice the largest concurrency, so rows are refilled at every
concurrency) with --min-context..--max-context tokens of history, more held-out
trajectories read when the evaluation's own hold too few. Output: the JSON,
`<out>-speedup.png` and `<out>-drafter_memory.png`, logged to an MLflow run of this
config's experiment (tag `dlite.benchmark=throughput`)."""

import json
import time
from pathlib import Path

from omegaconf import OmegaConf


def _drafters(cfg, specs) -> dict:
    """{name: dir}: --drafter NAME=DIR, else the finished align (and dspark) stages."""
    if specs:
        return dict(spec.split("=", 1) if "=" in spec else ("dlite", spec) for spec in specs)
    from pipelines.orchestration.dag import plan
    done = {s.name: Path(s.dir) for s in plan(cfg) if s.status in ("done", "reuse")}
    if "align" not in done:
        raise SystemExit("throughput: no finished align stage for this config: run the pipeline "
                         "first or pass --drafter NAME=DIR")
    return {"dlite": str(done["align"] / "drafter"),
            **({"dspark": str(done["dspark"] / "drafter")} if "dspark" in done else {})}


def pick_prompts(cfg, tok, n: int, lo: int, hi: int) -> list:
    """n turns with lo..hi tokens of history, reading more held-out trajectories if needed."""
    from pipelines.stages.evaluate_throughput import heldout_turns
    prompts = heldout_turns(cfg, tok, n, lo, hi)
    if not prompts:
        raise SystemExit(f"throughput: no held-out turn has a history of {lo}..{hi} tokens")
    return prompts


def run(cfg, args) -> dict:
    from dlite.envinfo import env_info
    from pipelines.stages.evaluate import _load
    from pipelines.stages.evaluate_throughput import throughput_report
    t0 = time.time()
    conc = sorted({int(c) for c in str(args.concurrency).split(",") if c.strip()})
    if not conc or conc[0] < 1:
        raise SystemExit(f"throughput: --concurrency needs positive integers, got {args.concurrency!r}")
    if args.repeats < 1:
        raise SystemExit(f"throughput: --repeats needs a positive integer, got {args.repeats}")
    drafters = _drafters(cfg, args.drafter)
    model, tok, learned, vocab = _load(cfg, drafters, int(cfg.eval.threads))
    prompts = pick_prompts(cfg, tok, args.requests or 2 * conc[-1], args.min_context, args.max_context)
    calibration = _calibration(cfg, model, tok, learned, vocab)
    report = {**throughput_report(cfg, model, tok, learned, vocab, prompts, conc, calibration, repeats=args.repeats),
              "drafters": drafters, "calibration": calibration,
              "seconds": round(time.time() - t0, 1),
              "config": OmegaConf.to_container(cfg, resolve=True), "env": env_info()}
    report["mlflow_run"] = _publish(cfg, report, Path(args.out))
    return report


def _calibration(cfg, model, tok, learned: dict, vocab: int):
    """The hybrids' calibration, fitted as the evaluation stage fits it (None: no choose
    or tree hybrid)."""
    from pipelines.stages.evaluate_calibration import calibration_set, default_or_none, fit_here
    done, cal = default_or_none(cfg)
    if done or not learned:
        return cal
    print(f"[throughput] calibrating {list(cfg.eval.hybrids)} on validation turns", flush=True)
    return fit_here(cfg, model, tok, learned, vocab, calibration_set(cfg))


def _publish(cfg, report: dict, out: Path) -> str:
    """The JSON and plots beside `out`, logged with the figures to a new MLflow run."""
    from pipelines.common import tracking
    from pipelines.stages.evaluate_throughput import metric_items, plots
    out = out.resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2, default=str) + "\n")
    pngs = plots(report, out.with_suffix(""))
    uri = cfg.tracking.uri
    run_id = tracking.client(uri).create_run(tracking.experiment_id(cfg), run_name="throughput",
                                             tags={"dlite.kind": "benchmark", "dlite.benchmark": "throughput"}).info.run_id
    with tracking.closing(uri, run_id):
        tracking.log_metrics(uri, run_id, 0, metric_items(report))
        for f in [out, *pngs]:
            tracking.log_artifact(uri, run_id, f, "benchmark")
    return run_id
