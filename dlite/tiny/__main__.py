"""`python -m dlite.tiny info|build|corpus`: inspect, rebuild, or dump the embedded default."""

import argparse
import json
import sys
from dataclasses import fields
from pathlib import Path

from dlite import tiny


def main(argv=None) -> int:
    from dlite.tiny.build import TargetSpec
    p = argparse.ArgumentParser(prog="python -m dlite.tiny")
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("info", help="print the embedded target's paths and measured figures (JSON)")
    b = sub.add_parser("build", help="rebuild tokenizer + target from the built-in corpus")
    b.add_argument("--out", default=str(tiny.ARTIFACTS))
    for f in fields(TargetSpec):
        b.add_argument(f"--{f.name.replace('_', '-')}", type=type(f.default), default=f.default)
    c = sub.add_parser("corpus", help="write built-in trajectories as JSONL")
    c.add_argument("--split", choices=["train", "heldout"], default="train")
    c.add_argument("--n", type=int, default=100)
    c.add_argument("--seed", type=int, default=0)
    c.add_argument("--min-chars", type=int, default=3000)
    c.add_argument("--max-chars", type=int, default=14000)
    c.add_argument("--out", required=True)
    args = p.parse_args(argv)
    if args.cmd == "info":
        print(json.dumps(tiny.info(), indent=2))
    elif args.cmd == "build":
        from dlite.tiny.build import build
        spec = TargetSpec(**{f.name: getattr(args, f.name) for f in fields(TargetSpec)})
        print(json.dumps(build(Path(args.out), spec, log=lambda s: print(s, flush=True)), indent=2))
    else:
        from dlite.corpus import trajectories as corpus
        recs = corpus.generate(args.split, args.n, args.seed, args.min_chars, args.max_chars)
        print(json.dumps({"written": corpus.write_jsonl(recs, args.out), "path": args.out}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
