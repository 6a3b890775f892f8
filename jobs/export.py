"""Write one of our drafter artifacts in another project's checkpoint layout:

    python -m jobs.export --format dlite_v1 --drafter DIR --out DIR2 [--config FILE] [key=value ...]

`dlite_v1`: the authors' published DLite layout (`DAI-System/DLite`'s
`DLiteDraftModel.from_pretrained`: their config.json fields and safetensors key
names; `dlite.models.dlite_v1_io`), from a `drafter.arch: dlite_v1` artifact with a
vocabulary-row MASK and the full vocabulary. The weights are only renamed: no target
is loaded. Our `load_drafter` reads the result back (given the target's final-norm
weight, which that layout does not hold). Exit 0 on success, 2 on a bad config, a
drafter directory that is unusable or made for another target, or one that has no
counterpart in the layout (`artifact error: <file or field>: ...`).
"""

import sys

from jobs.cli import parse_args, require_artifacts

FORMATS = ("dlite_v1",)


def _flags(parser) -> None:
    parser.add_argument("--format", required=True, choices=FORMATS, help="the layout to write")
    parser.add_argument("--drafter", required=True, help="our exported drafter directory")
    parser.add_argument("--out", required=True, help="directory to write")


def main(argv=None) -> int:
    args, cfg = parse_args(argv, extra=_flags)
    # Only files are read: a configured target not reachable from here is not compared.
    require_artifacts(cfg, [args.drafter], "export", need_target=False)
    from dlite.export import ArtifactError
    from dlite.models.dlite_v1_io import export_published
    if args.dry_run:
        print(f"[export] would write {args.drafter} as {args.format} to {args.out}", flush=True)
        return 0
    try:
        out = export_published(args.drafter, args.out)
    except ArtifactError as e:
        print(f"artifact error: {args.drafter}: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    print(f"[export] {args.drafter} -> {out} ({args.format} layout)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
