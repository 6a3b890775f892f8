"""Who moved `production`: the release gate's own record, and a check against it.

Only the release gate should move a registered model's `production` alias (the publish
stage, run as the pipeline's service user). A person with EDIT or MANAGE on the model
can still move it by hand (MLflow keeps no history of alias moves), so the gate writes
down each move it makes and every later publish compares the alias with that record:

  on the version       `dlite.gate.alias_set_by`, `dlite.gate.set_at` (who, when, UTC)
  on the model         `dlite.gate.production_version` (+ `_set_by`, `_set_at`): the
                       version the gate last pointed `production` at
  by hand, recorded    `set_production_by_hand` moves the alias and tags the version and
                       the model `dlite.manual.*` (who, when, why); the audit then names
                       that person instead of reporting an unexplained move

`audit_production` returns one warning per finding (empty: production is where the gate
put it); the publish stage prints them, tags them on its run and puts them in its summary.
"""

import getpass
import os
import sys
import time
from typing import List, Optional

GATE = "dlite.gate"
MANUAL = "dlite.manual"


def actor() -> str:
    """The MLflow user this process writes as (basic auth: the env vars or
    ~/.mlflow/credentials, as every MLflow client reads them), else the OS user."""
    from mlflow.utils.credentials import read_mlflow_creds
    user = read_mlflow_creds().username
    if user:
        return user
    try:
        return f"{getpass.getuser()} (local)"
    except (KeyError, OSError):  # no passwd entry in some containers
        return "unknown"


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def record_gate_move(c, name: str, version: str) -> dict:
    """Called right after the gate points `production` at `version`: tag who and when on
    the version, and the version itself on the model (what later audits compare with)."""
    who, at = actor(), _now()
    c.set_model_version_tag(name, str(version), f"{GATE}.alias_set_by", who)
    c.set_model_version_tag(name, str(version), f"{GATE}.set_at", at)
    model_tags = {f"{GATE}.production_version": str(version),
                  f"{GATE}.production_set_by": who, f"{GATE}.production_set_at": at}
    for k, v in model_tags.items():
        c.set_registered_model_tag(name, k, v)
    return model_tags


def set_production_by_hand(c, name: str, version: str, reason: str) -> None:
    """A person's deliberate move (needs EDIT or MANAGE on the model), recorded as one:
    the alias, then `dlite.manual.*` on the version and the model."""
    if not reason.strip():
        raise ValueError("a manual production move needs a reason")
    c.set_registered_model_alias(name, "production", str(version))
    tags = {f"{MANUAL}.production_set_by": actor(), f"{MANUAL}.production_set_at": _now(),
            f"{MANUAL}.reason": reason.strip()[:4000]}
    for k, v in tags.items():
        c.set_model_version_tag(name, str(version), k, v)
    c.set_registered_model_tag(name, f"{MANUAL}.production_version", str(version))


def audit_production(c, name: str) -> List[str]:
    """Warnings when `production` points at a version the gate did not pass, or not at
    the version the gate last set (moved since by someone else). A move recorded with
    `set_production_by_hand` is named with its author and reason, still as a warning:
    the gate's rules did not decide it."""
    from mlflow.exceptions import MlflowException
    try:
        rm = c.get_registered_model(name)
    except MlflowException as e:
        if e.error_code == "RESOURCE_DOES_NOT_EXIST":
            return []
        raise
    prod = rm.aliases.get("production")
    if prod is None:
        return []
    prod, tags = str(prod), c.get_model_version(name, str(prod)).tags
    manual = _manual_note(rm.tags, tags, prod)
    out = []
    if tags.get(GATE) != "passed":
        out.append(f"{name}: production -> v{prod}, which the release gate did not pass "
                   f"({GATE}={tags.get(GATE, 'missing')}){manual}")
    set_by_gate = rm.tags.get(f"{GATE}.production_version")
    # A registry whose gate set production before moves were recorded has no record:
    # a passed version there is the gate's, not someone else's.
    unrecorded = set_by_gate is None and tags.get(GATE) == "passed" and f"{GATE}.alias_set_by" not in tags
    if set_by_gate != prod and not unrecorded:
        last = (f"the gate last set v{set_by_gate} ({rm.tags.get(f'{GATE}.production_set_by')} at "
                f"{rm.tags.get(f'{GATE}.production_set_at')})" if set_by_gate else
                "the gate never set production")
        out.append(f"{name}: production -> v{prod}, but {last}: moved by someone other than "
                   f"the gate{manual}")
    return out


def _manual_note(model_tags: dict, version_tags: dict, prod: str) -> str:
    if model_tags.get(f"{MANUAL}.production_version") != prod:
        return " (not recorded as a manual move)"
    return (f" (set by hand by {version_tags.get(f'{MANUAL}.production_set_by')} at "
            f"{version_tags.get(f'{MANUAL}.production_set_at')}: "
            f"{version_tags.get(f'{MANUAL}.reason')})")


def warn(warnings: List[str], tag: str = "publish") -> None:
    for w in warnings:
        print(f"[{tag}] warning: {w}", file=sys.stderr, flush=True)


def main(argv: Optional[List[str]] = None) -> int:
    """`python -m pipelines.stages.registry_audit --uri URI --model NAME
    [--set-production VERSION --reason TEXT]`: print the audit; with --set-production,
    move the alias by hand first, recorded (the caller's MLflow credentials decide
    whether the server allows it)."""
    import argparse
    from mlflow import MlflowClient
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--uri", default=os.environ.get("MLFLOW_TRACKING_URI"), required=False)
    p.add_argument("--model", required=True)
    p.add_argument("--set-production", default=None, metavar="VERSION")
    p.add_argument("--reason", default="")
    a = p.parse_args(argv)
    c = MlflowClient(tracking_uri=a.uri)
    if a.set_production:
        set_production_by_hand(c, a.model, a.set_production, a.reason)
    findings = audit_production(c, a.model)
    warn(findings, "audit")
    print(f"[audit] {a.model}: {len(findings)} finding(s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
