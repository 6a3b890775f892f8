"""Collect target features from agent trajectories into feature shards:

    python -m jobs.collect --config FILE --input PATH --output DIR [key=value ...]

`--input` is a JSONL / Parquet file, a directory of them or of `.traj.json` files, an
HF datasets directory, or `builtin:train` / `builtin:heldout` (the embedded corpus);
it defaults to `data.train_path`, else `builtin:train`. `--output` defaults to
`<run.output_dir>/features-<config hash>`. Rerunning the same command resumes an
interrupted collection; a finished one is returned as is. Prints the manifest's counts.
"""

import json
import sys
from pathlib import Path

from jobs.cli import parse_args


def _flags(parser) -> None:
    parser.add_argument("--input", default=None, help="trajectories (see module docstring)")
    parser.add_argument("--output", default=None, help="feature shard directory or URI")


def main(argv=None) -> int:
    args, cfg = parse_args(argv, extra=_flags)
    from dlite.config import config_hash
    src = args.input or cfg.data.train_path or "builtin:train"
    out = args.output or str(Path(cfg.run.output_dir) /
                             f"features-{config_hash(cfg, ['target', 'drafter', 'data', 'run'])}")
    print(f"[collect] {src} -> {out}", flush=True)
    if args.dry_run:
        return 0
    from dlite.data.shards import ShardError
    from pipelines.stages.collect import CollectError, collect
    try:
        manifest = collect(cfg, src, out)
    except (CollectError, ShardError) as e:
        print(f"collect error: {e}", file=sys.stderr)
        return 1
    print(json.dumps({"output": out, "target": manifest["target_fingerprint"]["id"],
                      **manifest["counts"]}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
