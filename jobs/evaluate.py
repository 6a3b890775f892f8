"""Evaluate a drafter against its target (single process):

    python -m jobs.evaluate --config FILE --drafter DIR --out report.json [key=value ...]

Replays held-out agent trajectories (built-in split, or `data.heldout_path` JSONL) turn
by turn, speculative and plain decoding interleaved on the same prompts, at every
`eval.temperatures`; writes the report of ARCHITECTURE.md §3 (greedy metrics at top
level, each temperature under `by_temperature`, `lossless`, `config`, `env`).
"""

import json
import sys
from pathlib import Path

from jobs.cli import parse_args


def heldout_records(cfg) -> list:
    """The evaluation trajectories: a JSONL path, or the built-in held-out split."""
    n = cfg.eval.n_trajectories
    if cfg.data.heldout_path:
        lines = Path(cfg.data.heldout_path).read_text().splitlines()
        return [json.loads(x) for x in lines if x.strip()][:n]
    from dlite.tiny import corpus
    return list(corpus.generate("heldout", n, cfg.run.seed, cfg.data.min_chars, cfg.data.max_chars))


def evaluate(cfg, drafter_dir: str, threads: int = 0) -> dict:
    import torch
    from omegaconf import OmegaConf
    from dlite import target as tgt
    from dlite.envinfo import env_info
    from dlite.export import load_drafter
    from dlite.spec.replay import evaluate_prompts
    if threads:
        torch.set_num_threads(threads)  # small models on shared CPUs time best single-threaded
    model, tok = tgt.load(cfg.target)
    embed, lm_head, _ = tgt.shared_vocab(model, tok)
    drafter = load_drafter(drafter_dir, embed, lm_head)
    records = heldout_records(cfg)
    by_t = {}
    for t in cfg.eval.temperatures:
        by_t[str(float(t))] = evaluate_prompts(model, tok, drafter, records, cfg.eval, temperature=float(t))
    first = by_t[min(by_t, key=float)]
    report = {k: v for k, v in first.items() if k != "per_task"}
    report.update(temperature=float(min(by_t, key=float)), by_temperature=by_t,
                  lossless=all(r["lossless"] is not False for r in by_t.values()),
                  drafter=str(drafter_dir), target_fingerprint=tgt.fingerprint(cfg.target),
                  config=OmegaConf.to_container(cfg, resolve=True), env=env_info())
    return report


def main(argv=None) -> int:
    def extra(p):
        p.add_argument("--drafter", required=True, help="drafter artifact directory")
        p.add_argument("--out", required=True, help="report JSON path")
        p.add_argument("--threads", type=int, default=1, help="torch CPU threads (0: leave)")

    args, cfg = parse_args(argv, extra)
    if args.dry_run:
        print(f"[evaluate] would evaluate {args.drafter} on {cfg.eval.n_trajectories} trajectories -> {args.out}")
        return 0
    report = evaluate(cfg, args.drafter, args.threads)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    keys = ("tau", "accept_at_k", "tau_by_bucket", "speedup_vs_ar", "lossless", "time_split")
    print(json.dumps({k: report.get(k) for k in keys}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
