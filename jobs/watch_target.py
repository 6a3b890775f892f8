"""Scheduled retraining: watch a target source and submit the pipeline once per new
checkpoint fingerprint (the rules are in pipelines/retraining/checkpoints.py):

    python -m jobs.watch_target --config FILE --source SRC [--address URL] [--once]
        [--interval SECONDS] [--dry-run] [--pipeline-args="..."] [key=value ...]

SRC is a directory of HF checkpoints, one checkpoint directory, an s3:// (any pyarrow
URI) prefix, or models:/<name>@<alias> | models:/<name>/<version>. Each new fingerprint
becomes `ray job submit` of `python -m jobs.pipeline --config FILE key=value ...
target.path=<checkpoint> target.name=<target.name> tracking.uri=<tracking.uri>` to
--address (default $RAY_ADDRESS; a cluster with token auth also needs RAY_AUTH_MODE=token
and its token), uploading --working-dir (default the repo). `--once` checks once and
exits (cron); otherwise it checks every --interval seconds. `--dry-run` says what it
would submit: it reads Ray and MLflow and writes to neither. One `[watch] ...` line
per decision: submitted / already submitted / nothing new.
"""

import sys

from jobs.cli import parse_args, require_tracking


def _flags(parser) -> None:
    from pipelines.retraining.watch import REPO_ROOT
    parser.add_argument("--source", default=None, help="what to watch (see above); required")
    parser.add_argument("--address", default=None, help="Ray job API, e.g. http://head:8265")
    parser.add_argument("--once", action="store_true", help="check once and exit (cron)")
    parser.add_argument("--interval", type=float, default=300.0, help="seconds between checks")
    parser.add_argument("--min-age", type=float, default=60.0,
                        help="a checkpoint whose newest file is younger is still being written")
    parser.add_argument("--pipeline-args", default="",
                        help="extra pipeline flags, as --pipeline-args=--dry-run")
    parser.add_argument("--working-dir", default=str(REPO_ROOT), help="uploaded with the job")


def main(argv=None) -> int:
    args, cfg = parse_args(argv, extra=_flags)
    if not args.source or args.interval <= 0 or args.min_age < 0:
        print("watch_target: --source is required; --interval > 0; --min-age >= 0", file=sys.stderr)
        return 2
    if not args.dry_run:  # a dry run only reads MLflow
        require_tracking(cfg)
    from pathlib import Path
    from pipelines.retraining.watch import Options, watch
    # One spelling per local source: its MLflow record is found by it.
    source = args.source if ":/" in args.source else str(Path(args.source).resolve())
    opts = Options(source=source, config_path=args.config, overrides=list(args.overrides),
                   pipeline_args=args.pipeline_args, address=args.address,
                   working_dir=args.working_dir, min_age=args.min_age, dry_run=args.dry_run)
    print(f"[watch] {source} -> pipeline {args.config} on {args.address or '$RAY_ADDRESS'}, "
          f"record in {cfg.tracking.uri} ({cfg.tracking.experiment})", flush=True)
    return watch(cfg, opts, once=args.once, interval=args.interval,
                 say=lambda line: print(line, flush=True))


if __name__ == "__main__":
    sys.exit(main())
