"""Train one drafter stage on Ray Train + DeepSpeed:

    python -m jobs.train --config FILE --stage teacher|align|dspark --input SHARDS
        --output DIR [--teacher DIR] [--heldout SHARDS] [--parent-run-id ID] [key=value ...]

`--input` is a finished collection (`python -m jobs.collect`) of this target, `full`
storage (`anchors` only for `align` with `train.skip_teacher=true`). `align` needs
`--teacher` (the teacher stage's `--output`) unless `train.skip_teacher=true`.
`--heldout` validates on another collection (default: a hash-chosen tenth of the
input's records, kept out of training). The best drafter by validation tau lands in
`DIR/drafter/`, resume state in `DIR/resume/` (or under
`cluster.storage_uri`), the summary in `DIR/train.json`. Rerunning the same command
resumes an interrupted stage from its latest checkpoint; a finished one is returned.
A `--teacher` that is incomplete, corrupted or made for another target ends the job
before Ray starts: exit 2, `artifact error: <file>: ...`.
"""

import json
import sys

from dlite.config_schema import TRAIN_STAGES as STAGES
from jobs.cli import parse_args, require_artifacts, require_tracking


def _flags(parser) -> None:
    parser.add_argument("--stage", required=True, choices=STAGES)
    parser.add_argument("--input", required=True, help="feature shard directory or URI")
    parser.add_argument("--output", required=True, help="stage output directory")
    parser.add_argument("--teacher", default=None, help="teacher stage output (align)")
    parser.add_argument("--heldout", default=None, help="held-out feature shards")
    parser.add_argument("--parent-run-id", default=None, help="MLflow parent run (the pipeline's)")


def main(argv=None) -> int:
    args, cfg = parse_args(argv, extra=_flags)
    print(f"[train] {args.stage}: {args.input} -> {args.output}", flush=True)
    if args.teacher:
        from dlite.train.plan import teacher_dir  # the stage output dir or its drafter/
        require_artifacts(cfg, [str(teacher_dir(args.teacher))], "train")
    if args.dry_run:
        return 0
    require_tracking(cfg)
    from dlite.data.shards import ShardError
    from pipelines.stages.train import TrainError, train_stage
    try:
        summary = train_stage(cfg, args.stage, args.input, args.output, teacher=args.teacher,
                              heldout=args.heldout, parent_run_id=args.parent_run_id)
    except (TrainError, ShardError, ValueError) as e:
        print(f"train error: {e}", file=sys.stderr)
        return 1
    best = summary["best"]
    print(json.dumps({"stage": args.stage, "steps": summary["steps"], "drafter": summary["drafter"],
                      "val_tau": best.get("val_tau"), "run_id": summary["run_id"]}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
