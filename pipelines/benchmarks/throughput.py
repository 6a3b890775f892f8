"""Throughput at concurrency 1..16 (issue 30): closed-loop batched decoding of held-out
agent turns with their real histories, every method beside plain decoding batched the
same way (`dlite.bench.throughput`).

    python -m jobs.benchmark throughput --config configs/experiments/smollm2.yaml --out F
        --concurrency 1,2,4,8,16 [--drafter NAME=DIR ...] [--requests N]
        [--min-context 1024] [--max-context 8192] [key=value ...]

Methods: the learned drafters (--drafter NAME=DIR, repeatable; default: this config's
finished align stage, and its dspark stage when finished), then `eval.baselines` and the
choose hybrids of `eval.hybrids` (tree hybrids are not batched: listed as skipped). The
hybrids score proposals with the default calibration (the evaluation stage fits one on
validation turns; this benchmark does not, and says so). Requests: `--requests` turns
(default twice the largest concurrency, so the loop refills rows at every concurrency)
spread over the held-out set's turns whose history is --min-context..--max-context
tokens, more held-out trajectories read when the evaluation's own hold too few; each
prefilled once, shared by every run. Output: the JSON, `<out>-speedup.png` (speedup vs
concurrency, a line per method) and `<out>-drafter_memory.png`, logged to an MLflow run
of this config's experiment (`dlite.kind=benchmark`)."""

import time
from pathlib import Path

from omegaconf import OmegaConf

MAX_READ = (8, 16, 32, 64)  # held-out trajectories to read until enough turns are found


def _drafters(cfg, specs) -> dict:
    """{name: dir}: --drafter NAME=DIR, else the finished align (and dspark) stages."""
    if specs:
        return dict(spec.split("=", 1) if "=" in spec else ("dlite", spec) for spec in specs)
    from pipelines.orchestration.dag import plan
    done = {s.name: Path(s.dir) for s in plan(cfg) if s.status in ("done", "reuse")}
    if "align" not in done:
        raise SystemExit("throughput: no finished align stage for this config: run the pipeline "
                         "first or pass --drafter NAME=DIR")
    out = {"dlite": str(done["align"] / "drafter")}
    if "dspark" in done:
        out["dspark"] = str(done["dspark"] / "drafter")
    return out


def pick_prompts(cfg, tok, n: int, lo: int, hi: int) -> list:
    """n turns' prompt ids with histories of lo..hi tokens, spread over the held-out turns."""
    from dlite.decoding.replay import iter_tasks, pick_turns
    from pipelines.stages.evaluate import heldout_records
    prompts = []
    for k in (cfg.eval.n_trajectories, *MAX_READ):
        more = OmegaConf.merge(cfg, {"eval": {"n_trajectories": max(k, cfg.eval.n_trajectories)}})
        prompts = [t["prompt_ids"] for r in heldout_records(more)
                   for t in iter_tasks(tok, r, None, "context", (lo, hi))]
        if len(prompts) >= n:
            break
    if not prompts:
        raise SystemExit(f"throughput: no held-out turn has a history of {lo}..{hi} tokens")
    return [prompts[k] for k in pick_turns(len(prompts), n, "spread")]


def _methods(cfg, learned: dict, vocab: int) -> tuple:
    """({name: build}, skipped names): learned, baselines, choose hybrids; the tree
    hybrids and the per-request vocabulary are not batched."""
    from dlite.decoding.methods import hybrid_rule, method_builders
    ev = OmegaConf.merge(cfg.eval, {"context_vocab": False,
                                    "hybrids": [h for h in cfg.eval.hybrids if hybrid_rule(h) != "tree"]})
    skipped = [h for h in cfg.eval.hybrids if hybrid_rule(h) == "tree"] + (["context_vocab"] if cfg.eval.context_vocab else [])
    return method_builders(ev, learned, vocab), skipped


def run(cfg, args) -> dict:
    import torch
    from dlite.bench import throughput as tp
    from dlite.decoding.batch import Request
    from dlite.decoding.decode import prefill
    from dlite.envinfo import env_info
    from dlite.target import eos_ids
    from pipelines.stages.evaluate import _load
    t0 = time.time()
    conc = sorted({int(c) for c in str(args.concurrency).split(",") if c.strip()})
    if not conc or conc[0] < 1:
        raise SystemExit(f"throughput: --concurrency needs positive integers, got {args.concurrency!r}")
    drafters = _drafters(cfg, args.drafter)
    model, tok, learned, vocab = _load(cfg, drafters, int(cfg.eval.threads))
    builders, skipped = _methods(cfg, learned, vocab)
    prompts = pick_prompts(cfg, tok, args.requests or 2 * conc[-1], args.min_context, args.max_context)
    layers = sorted({i for d in learned.values() for i in d.target_layer_ids})
    history = any(d.needs_history for d in learned.values())
    requests = [Request(i, p, prefill(model, p, layers, history)) for i, p in enumerate(prompts)]
    eos, max_new = eos_ids(model, tok), int(cfg.eval.max_new_tokens)
    print(f"[throughput] {len(requests)} requests, {min(map(len, prompts))}-{max(map(len, prompts))} "
          f"tokens of history, {max_new} new tokens each; methods {['plain', *builders]}", flush=True)
    reference = tp.reference_outputs(model, requests, max_new, eos)
    t_measure = time.time()
    rows = tp.measure(model, builders, requests, conc, max_new, eos, reference, lambda s: print(s, flush=True))
    primary = next(iter(drafters))
    hist = next((n for n, d in learned.items() if d.needs_history), None)
    report = {
        "methods": rows, "concurrency": conc, "primary": primary, "history_drafter": hist,
        "goals": tp.goals(rows, primary, hist), "skipped_methods": skipped, "drafters": drafters,
        "requests": {"n": len(requests), "context_lens": [len(p) for p in prompts],
                     "prefill_ms": [round(r.prefill.ms, 1) for r in requests], "max_new_tokens": max_new},
        "calibration": "defaults (not fitted on validation turns)",
        "kv_bytes_per_token": tp.kv_bytes_per_token(model.config, next(model.parameters()).element_size()),
        "threads": torch.get_num_threads(), "seconds_measuring": round(time.time() - t_measure, 1),
        "seconds": round(time.time() - t0, 1),
        "config": OmegaConf.to_container(cfg, resolve=True), "env": env_info()}
    _publish(cfg, report, Path(args.out))
    return report


def _publish(cfg, report: dict, out: Path) -> None:
    """The plots beside `out`, and the JSON, plots and figures logged to an MLflow run."""
    import json
    from pipelines.common import plots, tracking
    out = out.resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2, default=str) + "\n")
    pngs = [plots.by_concurrency_plot(report["methods"], "speedup_vs_plain", "speedup vs plain (same concurrency)",
                                      out.with_name(f"{out.stem}-speedup.png")),
            plots.by_concurrency_plot(report["methods"], "drafter_bytes_per_request", "drafter state bytes / request",
                                      out.with_name(f"{out.stem}-drafter_memory.png"))]
    uri = cfg.tracking.uri
    run_id = tracking.client(uri).create_run(tracking.experiment_id(cfg), run_name="throughput",
                                             tags={"dlite.kind": "benchmark", "dlite.benchmark": "throughput"}).info.run_id
    with tracking.closing(uri, run_id):
        tracking.log_metrics(uri, run_id, 0, metric_items(report))
        for f in [out, *pngs]:
            tracking.log_artifact(uri, run_id, f, "benchmark")
    report["mlflow_run"] = run_id


def metric_items(report: dict) -> dict:
    """MLflow metrics: `<method>.c<N>.<figure>` for the headline figures (None skipped)."""
    keys = ("output_tokens_per_s", "request_tokens_per_s", "speedup_vs_plain", "speedup_vs_plain_request",
            "tau", "tpot_ms_p50", "tpot_ms_p99", "drafter_bytes_per_request", "kv_bytes_per_request")
    return {f"{m}.c{c}.{k}": float(v) for m, by in report["methods"].items() for c, r in by.items()
            for k in keys if isinstance((v := r.get(k)), (int, float)) and not isinstance(v, bool)}
