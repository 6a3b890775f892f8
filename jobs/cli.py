"""The one command line every job shares: `--config FILE`, `--print-config`,
`--dry-run` and `key=value` overrides. A bad config ends the process with exit code 2
and `config error: <key>: ...` on stderr before the job does anything else; so does a
bad drafter / teacher directory (`require_artifacts`: `artifact error: <file>: ...`)
or a tracking store the job cannot write (`require_tracking`: `tracking error: ...`)."""

import argparse
import sys
from typing import Callable, List, Optional, Tuple

from omegaconf import DictConfig

from dlite.config import ConfigError, load_config, to_yaml

# The real small target (SmolLM2-135M-Instruct); tests and smoke runs pass tiny.yaml.
DEFAULT_CONFIG = "configs/experiments/smollm2.yaml"


def parse_args(
    argv: Optional[List[str]] = None,
    extra: Optional[Callable[[argparse.ArgumentParser], None]] = None,
) -> Tuple[argparse.Namespace, DictConfig]:
    """Parse `argv` (default sys.argv[1:]) and load the config. `extra(parser)` adds a
    job's own flags. Exits 0 after `--print-config`, 2 on a config error."""
    parser = argparse.ArgumentParser(description=sys.modules["__main__"].__doc__)
    parser.add_argument("--config", default=DEFAULT_CONFIG, help="experiment YAML")
    parser.add_argument("--print-config", action="store_true",
                        help="print the resolved config as YAML and exit")
    parser.add_argument("--dry-run", action="store_true",
                        help="validate and plan, but start no work")
    parser.add_argument("overrides", nargs="*", metavar="key=value",
                        help="config overrides, e.g. train.lr=1e-4")
    if extra is not None:
        extra(parser)
    # Intermixed so `key=value` may come before or after flags.
    args = parser.parse_intermixed_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        sys.exit(2)
    if args.print_config:
        print(to_yaml(cfg), end="")
        sys.exit(0)
    return args, cfg


def require_artifacts(cfg, dirs: List[str], tag: str, need_target: bool = True) -> None:
    """Check each drafter directory (`dlite.export.check_artifact`) against the configured
    target before any Ray work; exit 2 with one line on stderr if one is unusable.
    The target's fingerprint is the one every stage uses (no Ray needed). A job that does
    not load the target (`need_target=False`: publish) skips the comparison when the
    target is not reachable from here instead of failing."""
    from dlite import target
    from dlite.export import ArtifactError, check_artifact
    try:
        want = target.fingerprint(cfg.target)
    except (OSError, ValueError) as e:
        if need_target:
            _exit("config error", e)
        want = None
        print(f"[{tag}] target fingerprint not compared: {e}", flush=True)
    for d in dirs:
        try:
            print(f"[{tag}] {d}: {check_artifact(d, want)}", flush=True)
        except (ArtifactError, OSError) as e:
            _exit("artifact error", e)


def require_tracking(cfg, registry: bool = False) -> None:
    """`tracking.preflight` before any work: a tracking server that is down, refuses these
    credentials or this user's writes (or a local store that cannot be written) ends the
    job here, exit 2 with one line on stderr, instead of after minutes of retries."""
    from pipelines.common.tracking import TrackingError, preflight
    try:
        preflight(cfg, registry=registry)
    except TrackingError as e:
        _exit("tracking error", e)


def require_writable(cfg) -> None:
    """`run.output_dir` (and `cluster.storage_uri`) take a file, before any work; else
    exit 2 with one line (`dag.check_writable`)."""
    from pipelines.orchestration.dag import PipelineError, check_writable
    try:
        check_writable(cfg)
    except PipelineError as e:
        _exit("pipeline error", e)


def _exit(kind: str, error: Exception) -> None:
    print(f"{kind}: {' '.join(str(error).split())}", file=sys.stderr)  # one line, always
    sys.exit(2)
