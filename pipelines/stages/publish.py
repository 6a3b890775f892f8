"""Publish stage: turn an evaluated drafter into a registered model version
(ARCHITECTURE.md §3, §5).

  card      `README.md` written into the drafter dir (`dlite.card`: use, training,
            the evaluation table against every method in the report, loading)
  run       a `publish` run under the pipeline's parent, one per set of weights: the
            drafter directory (`drafter/`), `report.json`, the PNG plots (`plots/`)
  version   a version of `tracking.registered_model` whose source is the run's logged
            `drafter/`, tagged with lineage (target / data fingerprints, config hash,
            git commit, drafter sha256) and the method's metrics. The same weights
            (sha256 of model.safetensors) never get a second version: a rerun reuses it
  aliases   `candidate` -> this version always; `production` -> this version only when
            the release gate passes (`release_gate`, a pure function), else it stays
            where it was and the failing checks are tagged on the version and the run;
            its lossless check follows `lossless_rule(target.dtype)`: strict for an
            fp32 target, up to the target's ties for a bf16 one (`dlite.decoding.ties`)
  audit     each production move the gate makes is recorded (who, when, which version:
            `registry_audit`); a production moved since by anyone else is reported as a
            warning, tagged `dlite.gate.production_audit` on the run

Versions are never overwritten or deleted; only aliases and the `dlite.gate*` tags move.
"""

import hashlib
import json
import os
import subprocess
from pathlib import Path
from typing import Optional

from dlite.card import (TRAIN_STAGES, by_temperature, card_sections, fingerprint_id, finite,
                        primary_method, report_methods)
from dlite.config import REPO_ROOT, config_hash
from dlite.decoding.ties import lossless_rule, lossless_verdict
from dlite.export import model_card
from pipelines.common import plots, tracking
from pipelines.stages import registry_audit
TAG = "dlite."
METRIC_TAG = "dlite.metric."
GATED = ("tau", "speedup_vs_ar")  # greedy metrics the release gate reads


# ---------------------------------------------------------------- release gate (pure)

def release_gate(metrics: dict, production: Optional[dict], min_tau: float, min_speedup: float,
                 tolerance: float) -> dict:
    """{passed, reasons, checks}: floors on tau and speedup_vs_ar, no regression beyond
    `tolerance` (relative) against `production`'s metrics (None: no production yet), and
    greedy output identical to the target's. Each reason names the check and its numbers."""
    checks = []

    def check(name: str, value, threshold, ok: Optional[bool] = None, why: str = "") -> None:
        v = finite(value)
        passed = (v is not None and v >= threshold) if ok is None else ok
        checks.append({"check": name, "value": v if ok is None else value, "threshold": threshold,
                       "passed": passed,
                       "reason": "" if passed else why or f"{name}: {_fmt(v)} < {_fmt(threshold)}"})

    check("tau >= gate.min_tau", metrics.get("tau"), min_tau)
    # The floor is judged on the speedup's lower bound over its timing pairs, so noise on
    # one machine does not promote a drafter; versions registered before the spread was
    # measured have only the point figure, which is then what is judged (named so).
    if metrics.get("speedup_vs_ar_lower") is not None:
        check("speedup_vs_ar_lower >= gate.min_speedup", metrics["speedup_vs_ar_lower"], min_speedup)
    else:
        check("speedup_vs_ar >= gate.min_speedup", metrics.get("speedup_vs_ar"), min_speedup)
    check("lossless", metrics.get("lossless"), True, ok=metrics.get("lossless") is not False,
          why="lossless: greedy speculative output differed from the target's plain decoding")
    for key in GATED if production else ():
        ref = finite(production.get(key))
        if ref is None:
            continue  # a production version without this metric cannot be regressed against
        floor = ref * (1 - tolerance)
        check(f"{key} vs production", metrics.get(key), floor,
              why=f"{key} vs production: {_fmt(finite(metrics.get(key)))} < {_fmt(floor)} "
                  f"(production v{production.get('version')} {_fmt(ref)} - {tolerance:.0%} tolerance)")
    reasons = [c["reason"] for c in checks if not c["passed"]]
    return {"passed": not reasons, "reasons": reasons, "checks": checks}


def _fmt(v) -> str:
    return "missing" if v is None else f"{v:.4g}"


# ---------------------------------------------------------------- lineage

def drafter_sha256(drafter_dir: Path) -> str:
    h = hashlib.sha256()
    with open(drafter_dir / "model.safetensors", "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def git_commit() -> str:
    """HEAD of the checkout; `DLITE_GIT_COMMIT` where the code came without .git (Ray
    job working dirs); else "unknown"."""
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO_ROOT, capture_output=True,
                             text=True, timeout=10, check=False)
        if out.returncode == 0 and out.stdout.strip():
            return out.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        pass
    return os.environ.get("DLITE_GIT_COMMIT") or "unknown"


def metric_tags(r: dict) -> dict:
    """The method's metrics as version tags: greedy at `dlite.metric.<key>`, each sampled
    temperature at `dlite.metric.<key>_T<t>` (tag keys allow no '@' or '=')."""
    tags = {}
    for t, m in by_temperature(r):
        sfx = "" if t == 0 else f"_T{t:g}"
        for key in ("tau", "speedup_vs_ar", "speedup_vs_ar_lower", "speedup_vs_ar_spread", "lossless",
                    "lossless_up_to_ties", "accept_at_k", "tau_by_bucket"):
            if m.get(key) is not None:
                tags[f"{METRIC_TAG}{key}{sfx}"] = json.dumps(m[key])
    return tags


def tagged_metrics(tags: dict) -> dict:
    """The greedy metrics back from a version's tags (None when absent: a version
    registered before ties were classified has no `lossless_up_to_ties`, judged strictly)."""
    out = {}
    for key in ("tau", "speedup_vs_ar", "speedup_vs_ar_lower", "lossless", "lossless_up_to_ties"):
        raw = tags.get(METRIC_TAG + key)
        out[key] = json.loads(raw) if raw is not None else None
    return out


def version_tags(cfg, drafter: dict, r: dict, sha: str, method: str) -> dict:
    return {f"{TAG}target_fingerprint": drafter.get("target_fingerprint") or "unknown",
            f"{TAG}data_fingerprint": drafter.get("data_plan_id") or "unknown",
            f"{TAG}config_hash": config_hash(cfg), f"{TAG}git_commit": git_commit(),
            f"{TAG}drafter_sha256": sha, f"{TAG}method": method,
            f"{TAG}architecture": drafter.get("architecture") or "unknown",
            f"{TAG}stage": drafter.get("stage") or "unknown",
            **metric_tags(r)}


# ---------------------------------------------------------------- registry

def find_version(c, name: str, sha: str):
    """The version already holding these exact weights, if any (oldest first)."""
    found = c.search_model_versions(f"name = '{name}' and tags.`{TAG}drafter_sha256` = '{sha}'")
    return min(found, key=lambda v: int(v.version)) if found else None


def registered_model(c, name: str):
    """The registered model, created on first publish (its aliases map alias -> version)."""
    from mlflow.exceptions import MlflowException
    try:
        return c.get_registered_model(name)
    except MlflowException as e:
        if e.error_code != "RESOURCE_DOES_NOT_EXIST":
            raise
    try:
        c.create_registered_model(name, description="DLite drafters for one target; "
                                                    "aliases `candidate` and `production`.")
    except MlflowException as e:
        if e.error_code != "RESOURCE_ALREADY_EXISTS":  # another publish created it meanwhile
            raise
    return c.get_registered_model(name)


def _production(c, name: str) -> Optional[dict]:
    """The current production version's number and tagged metrics (None: no production)."""
    version = c.get_registered_model(name).aliases.get("production")
    if version is None:
        return None
    return {"version": str(version), **tagged_metrics(c.get_model_version(name, str(version)).tags)}


# ---------------------------------------------------------------- artifacts

def read_drafter(d: Path) -> dict:
    """The artifact's config.json, after checking the directory is a complete drafter."""
    for f in ("config.json", "model.safetensors"):
        if not (d / f).is_file():
            raise FileNotFoundError(f"drafter: no {f} in {d} (not an exported drafter directory)")
    return json.loads((d / "config.json").read_text())


def _check_target(drafter: dict, r: dict, method: str, d: Path) -> None:
    ours, theirs = drafter.get("target_fingerprint"), fingerprint_id(r.get("target_fingerprint"))
    if ours and theirs and ours != theirs:
        raise ValueError(f"report.methods.{method}.target_fingerprint {theirs!r} is not the drafter's "
                         f"{ours!r} ({d / 'config.json'}): the report evaluated another target")


def training_runs(cfg, parent_run_id: Optional[str], drafter_dir: Path, stage: Optional[str]) -> dict:
    """{stage: run id} whose loss curves are plotted: the parent's training children,
    else the drafter's own stage run (recorded beside it by `tracking.open_child`)."""
    uri, runs = cfg.tracking.uri, {}
    if parent_run_id:
        c = tracking.client(uri)
        exp = c.get_run(parent_run_id).info.experiment_id
        for run in c.search_runs([exp], f"tags.mlflow.parentRunId = '{parent_run_id}'"):
            if run.data.tags.get("dlite.stage") in TRAIN_STAGES:
                runs.setdefault(run.data.tags["dlite.stage"], run.info.run_id)
    saved = drafter_dir.parent / tracking.RUN_FILE
    if not runs and saved.is_file():
        info = json.loads(saved.read_text())
        if info.get("uri") == uri:
            runs[stage or "train"] = info["run_id"]
    return runs


def make_plots(cfg, out: Path, methods: dict, runs: dict) -> list:
    """The comparison PNGs, plus the loss curves when the training runs logged any."""
    paths = [plots.accept_at_k_plot(methods, out / "accept_at_k.png"),
             plots.tau_by_bucket_plot(methods, out / "tau_by_bucket.png")]
    curves = plots.loss_curves_from_mlflow(cfg.tracking.uri, runs) if runs else {}
    if any(curves.values()):
        paths.append(plots.loss_curves_plot(curves, out / "loss_curves.png"))
    return paths


# ---------------------------------------------------------------- publish

def open_run(cfg, out: Path, parent_run_id: Optional[str], sha: str) -> str:
    """One publish run per set of weights, nested under the parent. Not the parent's
    existing `publish` child (what `open_child` would reuse): that run's `drafter/` is
    the source of an earlier version, and logging other weights there would change it."""
    run_id = tracking.open_child(cfg, "publish", out, None)  # `out` is per weights: reopened on rerun
    tags = {f"{TAG}drafter_sha256": sha, **({"mlflow.parentRunId": parent_run_id} if parent_run_id else {})}
    tracking.set_tags(cfg.tracking.uri, run_id, tags)
    return run_id


def publish(cfg, drafter_dir, report: dict, parent_run_id: Optional[str] = None,
            method: Optional[str] = None, output: Optional[str] = None) -> dict:
    """Card, run, version, aliases (see the module docstring); returns the summary.
    `<output>/<method>-<sha12>/` (output default `<run.output_dir>/publish`) keeps the
    plots, the report and the run id, so a rerun for the same weights reopens its run."""
    d = Path(drafter_dir).resolve()
    drafter, methods = read_drafter(d), report_methods(report)
    method = primary_method(report, method)
    _check_target(drafter, methods[method], method, d)
    sha, name = drafter_sha256(d), cfg.tracking.registered_model
    out = Path(output or Path(cfg.run.output_dir) / "publish").resolve() / f"{method}-{sha[:12]}"
    out.mkdir(parents=True, exist_ok=True)
    (d / "README.md").write_text(model_card(drafter, card_sections(report, drafter, method, name)))
    (out / "report.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
    pngs = make_plots(cfg, out, methods, training_runs(cfg, parent_run_id, d, drafter.get("stage")))
    with tracking.closing(cfg.tracking.uri, open_run(cfg, out, parent_run_id, sha)) as run_id:
        summary = _register(cfg, run_id, d, drafter, methods[method], sha, method, out, pngs)
    (out / "publish.json").write_text(json.dumps(summary, indent=2, default=str) + "\n")
    return summary


def _gate_and_alias(c, cfg, name: str, mv) -> tuple:
    """Gate `mv` against the current production; move the aliases; tag the decision.
    Production moved by anyone but the gate since its last move is reported first
    (`registry_audit`), before this publish moves it again."""
    audit = registry_audit.audit_production(c, name)
    registry_audit.warn(audit)
    before = _production(c, name)
    # The version's own tags, not this report: a reused version is gated on what it was
    # registered with, so a rerun decides the same way unless production moved.
    metrics = tagged_metrics(mv.tags)
    # A bf16 target's own ties may part its outputs: the gate's lossless check reads the
    # verdict of the target dtype's rule, the version keeps the strict tag.
    metrics["lossless"] = lossless_verdict(metrics, cfg.target.dtype)
    gate = release_gate(metrics, before, cfg.gate.min_tau, cfg.gate.min_speedup, cfg.gate.tolerance)
    gate["lossless_rule"] = lossless_rule(cfg.target.dtype)
    gate["production_audit"] = audit
    c.set_registered_model_alias(name, "candidate", mv.version)
    if gate["passed"]:
        c.set_registered_model_alias(name, "production", mv.version)
        registry_audit.record_gate_move(c, name, mv.version)  # what later audits compare with
    gate_tags = {f"{TAG}gate": "passed" if gate["passed"] else "failed",
                 f"{TAG}gate.reasons": "; ".join(gate["reasons"])[:4900] or "none"}
    for k, v in gate_tags.items():
        c.set_model_version_tag(name, mv.version, k, v)
    return before, gate, gate_tags


def _register(cfg, run_id: str, d: Path, drafter: dict, r: dict, sha: str, method: str,
              out: Path, pngs: list) -> dict:
    uri, name = cfg.tracking.uri, cfg.tracking.registered_model
    c = tracking.client(uri)
    registered_model(c, name)
    tracking.log_artifact(uri, run_id, out / "report.json")
    for p in pngs:
        tracking.log_artifact(uri, run_id, p, "plots")
    mv = reused = find_version(c, name, sha)
    if mv is None:  # new weights: log them, then point a new version at what was logged
        tracking.log_artifact(uri, run_id, d, "drafter")
        source = f"{c.get_run(run_id).info.artifact_uri}/drafter"
        link = tracking.run_link(uri, run_id) if uri.startswith(("http://", "https://")) else None
        mv = c.create_model_version(name, source, run_id=run_id, run_link=link,
                                    tags=version_tags(cfg, drafter, r, sha, method),
                                    description=f"{method}: {drafter.get('architecture')} drafter, "
                                                f"stage {drafter.get('stage')} step {drafter.get('step')}")
    before, gate, gate_tags = _gate_and_alias(c, cfg, name, mv)
    aliases = sorted(a for a, v in c.get_registered_model(name).aliases.items() if str(v) == str(mv.version))
    model_uri = f"models:/{name}/{mv.version}"
    audit = "; ".join(gate["production_audit"])[:4900] or "none"
    tracking.set_tags(uri, run_id, {**gate_tags, f"{TAG}gate.production_audit": audit,
                                    f"{TAG}registered_model": name,
                                    f"{TAG}model_version": mv.version, f"{TAG}model_uri": model_uri,
                                    f"{TAG}reused_version": reused is not None})
    tracking.log_metrics(uri, run_id, 0, {"gate_passed": float(gate["passed"]),
                                          **{k: v for k in GATED if (v := finite(r.get(k))) is not None}})
    return {"registered_model": name, "version": str(mv.version), "model_uri": model_uri,
            "aliases": aliases, "reused_version": reused is not None, "gate": gate,
            "production_before": before and before["version"], "source": mv.source, "method": method,
            "drafter_sha256": sha, "run_id": run_id, "run_link": tracking.run_link(uri, run_id),
            "output": str(out)}
