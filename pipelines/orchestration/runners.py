"""What each DAG stage runs: thin calls into the stage modules, each returning the small
summary `pipelines.orchestration.dag.execute` writes as the stage's `stage.json`.

A runner gets (context, its output dir, its finished inputs' summaries). Training,
evaluation and publishing open their own MLflow child runs under the pipeline's parent;
collection's and regeneration's runs are opened here (those modules know nothing of
MLflow).
"""

from pathlib import Path

from omegaconf import OmegaConf

from pipelines.common import tracking
from pipelines.orchestration.dag import METHODS, child_run


def regenerate(ctx, out: Path, deps: dict) -> dict:
    from pipelines.stages.regenerate import regenerate as run_regenerate
    cfg = ctx.cfg
    with child_run(ctx, "regenerate", out) as run_id:
        m = run_regenerate(cfg, cfg.data.train_path or "builtin:train", str(out / "regenerated"))
        rates = {k: m[k] for k in ("prefill_tokens_per_s", "decode_tokens_per_s") if m[k] is not None}
        counts = {k: v for k, v in m["counts"].items() if isinstance(v, (int, float))}
        tracking.log_metrics(cfg.tracking.uri, run_id, 0, {**counts, **rates})
        tracking.set_tags(cfg.tracking.uri, run_id, {"dlite.target_fingerprint": m["target_fingerprint"]["id"]})
    return {"regenerated": str(out / "regenerated"), "run_id": run_id, "counts": m["counts"],
            "sampling": m["sampling"], **rates, "plan_id": m["plan_id"]}


def collect(ctx, out: Path, deps: dict) -> dict:
    from pipelines.stages.collect import collect as run_collect
    cfg = ctx.cfg
    source = deps["regenerate"]["regenerated"] if "regenerate" in deps else \
        cfg.data.train_path or "builtin:train"
    with child_run(ctx, "collect", out) as run_id:
        m = run_collect(cfg, source, str(out / "shards"))
        counts = {k: v for k, v in m["counts"].items() if isinstance(v, (int, float))}
        tracking.log_metrics(cfg.tracking.uri, run_id, 0, counts)
        tracking.set_tags(cfg.tracking.uri, run_id, {"dlite.target_fingerprint": m["target_fingerprint"]["id"],
                                                     "dlite.data_plan_id": m["plan_id"]})
    return {"shards": str(out / "shards"), "run_id": run_id, "counts": m["counts"],
            "target_fingerprint": m["target_fingerprint"]["id"], "plan_id": m["plan_id"]}


def _no_teacher(cfg) -> dict:
    """The ablation: DLite trained on the target alone, with the optimiser steps the
    teacher and align stages spend together (same budget, no teacher)."""
    t = cfg.train
    return {"train": {"skip_teacher": True, "steps_align": t.steps_teacher + t.steps_align}}


def _drafter(deps: dict, stage: str) -> str:
    """A finished input stage's drafter directory, re-checked before use (sha256 and size
    against its config.json, `dlite.export.check_artifact`): the DAG reuses stages that
    finished in earlier runs, whose files may have been truncated or altered since, and
    a bad file should fail here, naming it, not inside a Ray task. The target needs no
    comparison: the collection's hash already pins it for every stage downstream."""
    from dlite.export import check_artifact
    d = deps[stage]["drafter"]
    check_artifact(d)
    return d


def _train(stage: str, label: str, overrides=None):
    def run(ctx, out: Path, deps: dict) -> dict:
        from pipelines.stages.train import train_stage
        cfg = OmegaConf.merge(ctx.cfg, overrides(ctx.cfg)) if overrides else ctx.cfg
        teacher = _drafter(deps, "teacher") if "teacher" in deps else None
        s = train_stage(cfg, stage, deps["collect"]["shards"], str(out), teacher=teacher,
                        parent_run_id=ctx.parent_run_id, label=label)
        f = s["final"]
        return {"drafter": s["drafter"], "run_id": s["run_id"], "steps": s["steps"],
                "best_val_tau": s["best"].get("val_tau"),
                "best_val_tau_greedy": s["best"].get("val_tau_greedy"),
                "best_val_tau_replay": s["best"].get("val_tau_replay"), "final_loss": f.get("loss"),
                "samples_per_s": f.get("samples_per_s_avg"), "peak_gpu_bytes": f.get("peak_gpu_bytes")}
    return run


def evaluate(ctx, out: Path, deps: dict) -> dict:
    from pipelines.stages.evaluate import evaluate_stage
    drafters = {METHODS[s]: _drafter(deps, s) for s in deps if s in METHODS}
    report = evaluate_stage(ctx.cfg, drafters, out, ctx.parent_run_id)
    # `lossless` stays strict; jobs.pipeline decides with `lossless_verdict` on these keys.
    return {"report": str(out / "report.json"), "lossless": report["lossless"],
            "lossless_up_to_ties": report.get("lossless_up_to_ties"),
            "lossless_rule": report.get("lossless_rule"),
            "methods": {n: _headline(m) for n, m in report["methods"].items()}}


def _headline(m: dict) -> dict:
    t1 = next((r for t, r in m["by_temperature"].items() if float(t) > 0), None)
    return {"tau": m["tau"], "speedup_vs_ar": m["speedup_vs_ar"], "lossless": m["lossless"],
            "speedup_vs_ar_lower": m.get("speedup_vs_ar_lower"),
            "lossless_up_to_ties": m.get("lossless_up_to_ties"),
            "tau_t1": t1 and t1["tau"], "speedup_vs_ar_t1": t1 and t1["speedup_vs_ar"],
            "tau_by_bucket": m["tau_by_bucket"]}


def publish(ctx, out: Path, deps: dict) -> dict:
    import json
    from pipelines.stages.publish import publish as run_publish
    report = json.loads(Path(deps["evaluate"]["report"]).read_text())
    return run_publish(ctx.cfg, _drafter(deps, "align"), report, parent_run_id=ctx.parent_run_id,
                       method="dlite", output=str(out))


RUNNERS = {
    "regenerate": regenerate,
    "collect": collect,
    "teacher": _train("teacher", "teacher"),
    "align": _train("align", "align"),
    "align_no_teacher": _train("align", "align_no_teacher", _no_teacher),
    "dspark": _train("dspark", "dspark"),
    "evaluate": evaluate,
    "publish": publish,
}
