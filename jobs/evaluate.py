"""Evaluate drafters against their target on Ray and log the result to MLflow:

    python -m jobs.evaluate --config FILE --drafter DIR [--drafter NAME=DIR ...] --out report.json
                            [--parent-run-id ID] [key=value ...]

Every drafter replays the same held-out agent trajectories (built-in split, or
`data.heldout_path` JSONL) turn by turn: acceptance spread over `eval.num_workers` Ray
tasks, then speed on one worker, plain and speculative interleaved (see
`pipelines/stages/evaluate.py`). A drafter's name defaults to its kind (`dlite`,
`dlite_no_teacher`, `dspark`, `dlite_v1`) read from its config.json. Drafters from other
trainers are judged the same way: a directory in the DLite authors' published layout
(`DLiteDraftModel`) or a SpecForge DFlash export (`specforge export --to hf`, named
`specforge_dflash`); any other layout ends the job with one line listing the known ones. Writes the report of
ARCHITECTURE.md §3 to `--out`, plots beside it, and an `evaluate` MLflow run (a child of
`--parent-run-id` when given) with the metrics, report and plots. A drafter directory
that is incomplete, corrupted (checksums in config.json) or trained for another target
ends the job before Ray starts: exit 2, `artifact error: <file>: ...`.
"""

import json
import shutil
import sys
from pathlib import Path

from jobs.cli import parse_args, require_artifacts, require_tracking


def _drafters(cfg, specs: list) -> dict:
    pairs = [spec.rpartition("=")[::2] if "=" in spec else ("", spec) for spec in specs]
    # Checksums and target fingerprint here, not in a Ray task's traceback.
    require_artifacts(cfg, [path for _, path in pairs], "evaluate")
    from pipelines.stages.evaluate import method_name
    out = {}
    for name, path in pairs:
        name = name or method_name(path)
        if name in out:
            raise SystemExit(f"evaluate: two drafters named {name!r}: name them with NAME=DIR")
        out[name] = path
    return out


def main(argv=None) -> int:
    def extra(p):
        p.add_argument("--drafter", action="append", required=True, help="DIR or NAME=DIR (repeatable)")
        p.add_argument("--out", required=True, help="report JSON path (plots are written beside it)")
        p.add_argument("--parent-run-id", default=None, help="MLflow run to nest the evaluate run under")

    args, cfg = parse_args(argv, extra)
    drafters = _drafters(cfg, args.drafter)
    out = Path(args.out).resolve()
    work = out.parent / f".{out.stem}-evaluate"
    print(f"[evaluate] {', '.join(f'{k}={v}' for k, v in drafters.items())} -> {out}", flush=True)
    if args.dry_run:
        return 0
    require_tracking(cfg)
    from pipelines.stages.evaluate import REPORT, evaluate_stage
    shutil.rmtree(work, ignore_errors=True)  # a fresh evaluation each time this job runs
    report = evaluate_stage(cfg, drafters, work, args.parent_run_id)
    out.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy(work / REPORT, out)
    for png in work.glob("*.png"):
        shutil.copy(png, out.parent / f"{out.stem}-{png.name}")
    from dlite.decoding.ties import lossless_verdict
    keys = ("tau", "speedup_vs_ar", "lossless", "lossless_up_to_ties")
    rows = {n: {k: m.get(k) for k in keys} for n, m in report["methods"].items()}
    print(json.dumps({"methods": rows, "accept_at_k": report["accept_at_k"],
                      "tau_by_bucket": report["tau_by_bucket"]}, indent=2))
    # Exact equality for an fp32 target; up to bf16/fp16 ties otherwise (dlite/decoding/ties.py).
    return 0 if lossless_verdict(report, cfg.target.dtype) else 1


if __name__ == "__main__":
    sys.exit(main())
