"""The main job: the whole pipeline as a DAG (see `pipelines/orchestration/dag.py`).

    python -m jobs.pipeline --config FILE [--dry-run] [--only S1,S2 | --from S] [key=value ...]

collect -> teacher -> align (+ align_no_teacher ablation, + dspark baseline) ->
evaluate -> publish, as listed in `run.stages`. Finished stages (same settings, same
inputs) are skipped, unfinished ones resume. `--dry-run` prints the plan (stages, output
dirs, what would be skipped) and the resolved config without starting Ray. At the end:
the results table, the MLflow link, and `<run.output_dir>/<run.name>-<hash>/summary.json`.
Exit status: 0 done, 1 a stage failed or greedy decoding was not lossless (strictly for an
fp32 target, up to the target's ties for a bf16 one: `dlite.decoding.ties.lossless_rule`),
2 bad config, an unwritable `run.output_dir`, or a tracking store that is down or refuses
this user (checked before any stage: `tracking.preflight`).
"""

import sys
import time

from jobs.cli import parse_args, require_tracking, require_writable


def _flags(p) -> None:
    p.add_argument("--only", default=None, help="comma-separated stages to run (inputs must be finished)")
    p.add_argument("--from", dest="start", default=None, help="run this stage and every later one")


def main(argv=None) -> int:
    args, cfg = parse_args(argv, _flags)
    from dlite.config import ConfigError, config_hash, to_yaml, validate
    from pipelines.orchestration.dag import PipelineError, home_dir, plan
    from pipelines.common.target_fetch import TargetFetchError, is_remote, localize
    source = cfg.target.path
    if not args.dry_run:  # before fetching a target or starting Ray: seconds, one line, exit 2
        require_writable(cfg)
        require_tracking(cfg, registry="publish" in cfg.run.stages)
    if is_remote(source) and not args.dry_run:  # copied once; a dry run only names it
        try:
            cfg = localize(cfg)
            validate(cfg)  # layer ids against the copy's config.json
        except (TargetFetchError, ConfigError) as e:
            print(f"target error: {e}", file=sys.stderr)
            return 2
    try:
        stages = plan(cfg, args.only.split(",") if args.only else None, args.start)
    except PipelineError as e:
        print(f"pipeline error: {e}", file=sys.stderr)
        return 2
    home = home_dir(cfg)
    print(f"[pipeline] config {args.config} (hash {config_hash(cfg)}) -> {home}", flush=True)
    for s in stages:
        print(f"[pipeline]   {s.name:<16} {s.status:<7} {s.dir}", flush=True)
    if args.dry_run:
        print(to_yaml(cfg), end="")
        return 0
    return _run(cfg, stages, source)


def _run(cfg, stages, source: str) -> int:
    from dlite.config import config_hash
    from dlite.decoding.ties import lossless_rule, lossless_verdict
    from pipelines.orchestration import results
    from pipelines.common import tracking
    from pipelines.orchestration.dag import Context, execute, open_home
    from pipelines.orchestration.runners import RUNNERS
    t0 = time.time()
    home, parent = open_home(cfg, {"dlite.config_hash": config_hash(cfg), "dlite.target_source": source})
    print(f"[pipeline] MLflow: {tracking.run_link(cfg.tracking.uri, parent)}", flush=True)
    try:
        done = execute(Context(cfg, parent, lambda line: print(line, flush=True)), stages, RUNNERS)
    except BaseException:
        tracking.finish(cfg.tracking.uri, parent, "FAILED")
        raise
    summary = results.finish(cfg, home, parent, stages, done, time.time() - t0)
    print(results.results_table(done))
    print(f"[pipeline] MLflow run: {summary['mlflow_link']}")
    print(f"[pipeline] done in {summary['seconds']:.0f}s: {home / 'summary.json'}")
    ev = done.get("evaluate")
    if ev is None:  # evaluation not among this run's stages: nothing to judge
        return 0
    lossless = lossless_verdict(ev, cfg.target.dtype)
    print(f"[pipeline] lossless ({lossless_rule(cfg.target.dtype)}): {lossless}")
    return 0 if lossless is not False else 1


if __name__ == "__main__":
    sys.exit(main())
