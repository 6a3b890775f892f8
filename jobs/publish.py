"""Publish an evaluated drafter to the MLflow model registry:

    python -m jobs.publish --config FILE --drafter DIR --report REPORT.json --out SUMMARY.json
        [--method dlite] [--parent-run-id ID] [--output DIR] [key=value ...]

Writes the model card into DIR, logs DIR, the report and the plots to a `publish` run
(a child of `--parent-run-id` when given), registers a version of
`tracking.registered_model` (the same weights are never registered twice), points
alias `candidate` at it, and `production` only when the release gate (`gate.*`)
passes. Exit 0 whether or not the gate passed (the summary says which); 1 on bad input;
2 on a bad config or a drafter directory that is incomplete, corrupted (checksums in its
config.json) or made for another target (`artifact error: <file>: ...`).
"""

import json
import sys
from pathlib import Path

from jobs.cli import parse_args, require_artifacts, require_tracking


def _flags(parser) -> None:
    parser.add_argument("--drafter", required=True, help="exported drafter directory")
    parser.add_argument("--report", required=True, help="evaluation report JSON")
    parser.add_argument("--out", required=True, help="summary JSON path")
    parser.add_argument("--method", default=None, help="the report's method DIR is (default: its primary)")
    parser.add_argument("--parent-run-id", default=None, help="MLflow parent run (the pipeline's)")
    parser.add_argument("--output", default=None,
                        help="root of <method>-<sha12>/ with plots + run id (default <run.output_dir>/publish)")


def main(argv=None) -> int:
    args, cfg = parse_args(argv, extra=_flags)
    # Publishing never loads the target: one not reachable from here is not compared.
    require_artifacts(cfg, [args.drafter], "publish", need_target=False)
    from dlite.card import primary_method
    from pipelines.stages.publish import drafter_sha256, publish, read_drafter
    try:
        report = json.loads(Path(args.report).read_text())
        drafter, method = read_drafter(Path(args.drafter)), primary_method(report, args.method)
    except (OSError, ValueError) as e:
        print(f"publish error: {e}", file=sys.stderr)
        return 1
    name, gate = cfg.tracking.registered_model, cfg.gate
    print(f"[publish] {method} ({drafter.get('architecture')}, {args.drafter}) -> {name} at "
          f"{cfg.tracking.uri}; production if tau >= {gate.min_tau}, speedup >= {gate.min_speedup}, "
          f"within {gate.tolerance:.0%} of production", flush=True)
    if args.dry_run:
        sha = drafter_sha256(Path(args.drafter))[:12]
        print(f"[publish] dry run: weights sha256 {sha}; nothing logged or registered")
        return 0
    require_tracking(cfg, registry=True)
    try:
        summary = publish(cfg, args.drafter, report, args.parent_run_id, method, args.output)
    except (OSError, ValueError) as e:
        print(f"publish error: {e}", file=sys.stderr)
        return 1
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(summary, indent=2, default=str) + "\n")
    keys = ("model_uri", "aliases", "reused_version", "run_link")
    print(json.dumps({**{k: summary[k] for k in keys}, "gate_passed": summary["gate"]["passed"],
                      "gate_reasons": summary["gate"]["reasons"]}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
