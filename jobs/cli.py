"""The one command line every job shares: `--config FILE`, `--print-config`,
`--dry-run` and `key=value` overrides. A bad config ends the process with exit code 2
and `config error: <key>: ...` on stderr before the job does anything else."""

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
