"""The end of a pipeline run: the results table printed to the user, `summary.json`,
and what the parent MLflow run shows (headline metrics per method, training loss
curves of every stage, the summary, the stage directories as tags)."""

import json
from pathlib import Path
from typing import Dict, List, Optional

from dlite.card import lossless_label
from pipelines.common import tracking


def _fmt(v, spec: str = ".2f") -> str:
    return "-" if v is None else format(v, spec)


def results_table(results: Dict[str, dict]) -> str:
    """Methods x (tau, speedup) at greedy and T=1, plus plain decoding, as text."""
    ev = results.get("evaluate")
    if not ev:
        return "(no evaluation in this run)"
    # `lower`: the speedup's lower bound over its timing pairs, what the release gate reads.
    rows = [f"{'method':<21} {'tau':>6} {'speedup':>8} {'lower':>6} {'tau T=1':>8} {'speedup T=1':>11} lossless",
            f"{'plain decoding':<21} {'1.00':>6} {'1.00':>8} {'-':>6} {'1.00':>8} {'1.00':>11} -"]
    for name, m in ev["methods"].items():
        rows.append(f"{name:<21} {_fmt(m['tau']):>6} {_fmt(m['speedup_vs_ar']):>8} "
                    f"{_fmt(m.get('speedup_vs_ar_lower')):>6} {_fmt(m['tau_t1']):>8} "
                    f"{_fmt(m['speedup_vs_ar_t1']):>11} {lossless_label(m, ev.get('lossless_rule'))}")
    return "\n".join(rows)


def _parent_metrics(results: Dict[str, dict]) -> dict:
    out = {}
    for name, m in (results.get("evaluate") or {}).get("methods", {}).items():
        for k in ("tau", "speedup_vs_ar", "speedup_vs_ar_lower", "tau_t1", "speedup_vs_ar_t1"):
            if m.get(k) is not None:
                out[f"{name}.{k}"] = m[k]
    for stage, s in results.items():
        if s.get("best_val_tau") is not None:
            out[f"{stage}.best_val_tau"] = s["best_val_tau"]
        out[f"{stage}.seconds"] = s.get("seconds", 0.0)
    return out


def _loss_plot(cfg, home: Path, results: Dict[str, dict]):
    from pipelines.common import plots
    runs = {s: r["run_id"] for s, r in results.items() if "drafter" in r and r.get("run_id")}
    if not runs:
        return None
    curves = plots.loss_curves_from_mlflow(cfg.tracking.uri, runs)
    return plots.loss_curves_plot(curves, home / "loss_curves.png")


def val_vs_heldout(best_val_tau: Dict[str, Optional[float]], heldout_tau: Dict[str, Optional[float]],
                   best_val_tau_greedy: Optional[Dict[str, Optional[float]]] = None,
                   best_val_tau_replay: Optional[Dict[str, Optional[float]]] = None) -> dict:
    """Per learned method: the in-training estimate (best teacher-forced `val_tau` on the
    validation rows, by stage) next to the held-out greedy tau (by method), their ratio,
    and whether they agree within 10% -- the number users early-stop on must predict
    the real one. With `best_val_tau_greedy` (the same checkpoint's greedy replay of the
    validation blocks under the evaluation's stop rule, `dlite.train.step.validate`) its
    ratio too, where the stage recorded one; likewise `best_val_tau_replay` (the replay
    walked over the validation answers, `dlite.train.step.replay_walk`: tokens per round
    as the evaluation counts them)."""
    from pipelines.orchestration.dag import METHODS
    out = {}
    for stage, name in METHODS.items():
        val, tau = best_val_tau.get(stage), heldout_tau.get(name)
        if val is None or tau is None:
            continue
        out[name] = {"val_tau": val, "heldout_tau": tau, **_ratio("val", val, tau)}
        for what, by_stage in (("greedy", best_val_tau_greedy), ("replay", best_val_tau_replay)):
            v = (by_stage or {}).get(stage)
            if v is not None:
                out[name].update({f"val_tau_{what}": v, **_ratio(what, v, tau)})
    return out


def _ratio(what: str, val: float, tau: float) -> dict:
    r = round(val / tau, 4) if tau else None
    key = "within_10pct" if what == "val" else f"{what}_within_10pct"
    return {f"{what}_over_heldout": r, key: None if r is None else abs(r - 1) <= 0.10}


def finish(cfg, home: Path, parent_run_id: str, stages: List, results: Dict[str, dict], seconds: float) -> dict:
    """Write summary.json, fill the parent run, close it; returns the summary."""
    uri = cfg.tracking.uri
    summary = {"output_dir": str(home), "seconds": round(seconds, 1), "mlflow_run": parent_run_id,
               "mlflow_link": tracking.run_link(uri, parent_run_id),
               "stages": [{"stage": s.name, "status": s.status, "dir": s.dir} for s in stages],
               "results": results,
               "val_vs_heldout": val_vs_heldout({s: r.get("best_val_tau") for s, r in results.items()},
                                                {n: m.get("tau") for n, m in
                                                 (results.get("evaluate") or {}).get("methods", {}).items()},
                                                {s: r.get("best_val_tau_greedy") for s, r in results.items()},
                                                {s: r.get("best_val_tau_replay") for s, r in results.items()})}
    (home / "summary.json").write_text(json.dumps(summary, indent=2, default=str) + "\n")
    tracking.log_metrics(uri, parent_run_id, 0, {**_parent_metrics(results), "pipeline.seconds": seconds})
    tracking.set_tags(uri, parent_run_id, {f"dlite.stage_dir.{s.name}": s.dir for s in stages})
    png = _loss_plot(cfg, home, results)
    for f in [home / "summary.json", home / "config.yaml", png]:
        if f is not None:
            tracking.log_artifact(uri, parent_run_id, f, "pipeline")
    tracking.finish(uri, parent_run_id)
    return summary
