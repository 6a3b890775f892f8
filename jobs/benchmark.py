"""Benchmarks that write one JSON report each (metric names as in DLITE.md §4):

    python -m jobs.benchmark draft_cost --config configs/experiments/tiny.yaml --out FILE

`draft_cost`: per-round draft time and drafter cache bytes against context length for
DLite and the DSpark-style baseline, same process, interleaved; plus parameter counts
of the Qwen3-4B/8B-shaped drafters.
`collect`: capture overhead, stored bytes/token per storage mode x reference vs the
DeepSpec layout, and collect-stage throughput with 1 and 2 actors.
`train`: engine_overhead (Ray Train + DeepSpeed, 2 CPU workers, vs a plain loop), the
same-math check (1 worker vs the plain loop) and the teacher-stage ablation (student
val_tau after teacher -> align vs align with `train.skip_teacher=true`), on shards it
collects itself.
`quality`: the headline comparison: DLite, DLite without the teacher stage and
the DSpark-style baseline, same data and step budget, trained on a 1536-token window and
evaluated on held-out histories up to 16K tokens; ratios, goals, draft cost; plots.
`--ablations all|a,b` adds the why-table: DLite with one switch changed at a time;
`--prompts FILE` the same drafters on --n-prompts prompts of FILE (e.g. SWE-bench issues).
`target_probe`: the configured target alone: next-token / copy accuracy and top-1
probability per context bucket on the held-out trajectories, and the cost of one decode
step vs one verified block at each `--context-lengths` (`--threads`, default 1).
`lookup_check`: prompt lookup in our decoding loop vs transformers' own
`generate(prompt_lookup_num_tokens=gamma)` on the evaluation's held-out turns: the two
speedups over their own plain decoding, which should agree if our timing is honest.
`loss_memory`: peak memory of the training loss, one-shot vs chunked, extrapolated to the
production batch (goal <= 2 GB).
`shape_rehearsal`: the Qwen3-4B DLite drafter's shapes (`--rehearse-drafter
dlite_v1_qwen3_4b`: the published design's; the `*_qwen3_8b` ones against Qwen3-8B's
shape) on CPU in bf16 (train step, draft round, export round trip), peak RSS and time
per phase.
`regenerate`: today's HFRegenerator against the batched, cache-carrying regenerator on
the same --conversations (4) built-in trajectories (2-3 assistant turns, 64 new tokens
per turn; `data.corpus`; `data.regen_lookup=K` adds the lookup-verified variant): tokens/s
of each, their ratio (goal >= 4x), whether the greedy tokens agree.
`peers`: a peer's drafter judged by our harness: SpecForge's DFlash (optional extra `peers`)
trained by SpecForge's own trainer on this config's collection (or --shards), checked round
by round against SpecForge's own decode loop on 20 held-out prompts, then evaluated beside
our drafters (--drafter NAME=DIR, default: the finished align stage) on the same turns.
`throughput`: closed-loop batched decoding of held-out turns at each of --concurrency
(1,2,4,8,16): every method beside plain decoding batched the same way -- output tokens/s,
per-request decode tokens/s, TPOT p50/p99, tau, speedup at the same concurrency, target KV
and drafter state bytes per request, lossless per request; plots; an MLflow run.
`gpu_check`: the prepared first GPU run (`scripts/gpu_check.sh` passes its sizes): the
pipeline without ablation and publish, then the engine comparison on its shards; tokens/s,
tau, engine overhead, peak GPU memory per training stage, seconds against the 8-minute budget.
"""

import json
import sys
from pathlib import Path

from jobs.cli import parse_args


def draft_cost(cfg, args) -> dict:
    # Random-weight drafters and a random-weight target of the configured target's
    # shape (its config.json only): draft round vs one target decode step per context,
    # for the full vocabulary and each of --draft-vocab-sizes.
    from omegaconf import OmegaConf
    from transformers import AutoConfig
    from dlite.bench.draft_cost import run
    from dlite.target import target_dir
    tc = AutoConfig.from_pretrained(target_dir(cfg.target))
    limit = getattr(tc, "max_position_embeddings", None) or max(args.context_lengths)
    report = run(OmegaConf.to_object(cfg.drafter), tc.hidden_size, tc.vocab_size,
                 context_lengths=[L for L in args.context_lengths if L + 16 <= limit] or [limit // 2],
                 rounds=args.rounds, threads=args.threads, target_config=tc,
                 draft_vocab_sizes=[n for n in args.draft_vocab_sizes if n < tc.vocab_size])
    report["config"]["run"] = OmegaConf.to_container(cfg, resolve=True)
    return report


def collect(cfg, args) -> dict:
    # Rates, not volume: a small input (at most 16 records, fewer via data.n_train=N), and
    # at most 5 interleaved bare/collection repetitions (fewer via --rounds): each is a
    # full pass over the input, so draft_cost's 20 would take minutes on CPU.
    from pipelines.benchmarks.collect import run
    n = min(16, cfg.data.n_train)
    return run(cfg, records=n, repetitions=min(args.rounds, 5), collect_records=n)


def train(cfg, args) -> dict:
    # Sizes are config: data.n_train / n_heldout records, train.steps_dspark for the
    # engine comparison, train.steps_teacher / steps_align for the ablation.
    from pipelines.benchmarks.train import benchmark
    return benchmark(cfg, args.work_dir)


def quality(cfg, args) -> dict:
    # DLite vs DSpark-style vs no-teacher on histories >= 8x the training window
    # (the pipeline DAG with the settings of pipelines/benchmarks/quality.py); plots beside --out.
    from pipelines.benchmarks import ablations
    from pipelines.benchmarks.quality import run
    return run(cfg, args.out, ablations=ablations.parse(args.ablations, cfg) if args.ablations else (),
               budget=args.budget, prompts=args.prompts, n_prompts=args.n_prompts)


def target_probe(cfg, args) -> dict:
    # The configured target alone, on the held-out trajectories the evaluation replays:
    # accuracy / copy accuracy / confidence per context bucket, and what one decode step
    # and one verified block cost at each of --context-lengths (cut to its max positions).
    import torch
    from dlite import target as tgt
    from dlite.bench.target_probe import step_costs
    from dlite.envinfo import env_info
    from omegaconf import OmegaConf
    from pipelines.benchmarks.quality import target_by_bucket
    torch.set_num_threads(args.threads)
    model = tgt.load_model(cfg.target)
    limit = getattr(model.config, "max_position_embeddings", None) or max(args.context_lengths) + 8
    contexts = [L for L in args.context_lengths if L + 8 <= limit]
    return {"target": cfg.target.name, "dtype": cfg.target.dtype, "attn": cfg.target.attn_implementation,
            "target_by_bucket": target_by_bucket(cfg, max_len=limit),
            "step_costs": step_costs(model, contexts, block=cfg.drafter.gamma + 1),
            "config": OmegaConf.to_container(cfg, resolve=True), "env": env_info()}


def lookup_check(cfg, args) -> dict:
    # Our prompt-lookup loop vs transformers' generate(prompt_lookup_num_tokens=gamma) on
    # the evaluation's held-out turns (eval.* picks them), interleaved per turn.
    import torch
    from dlite import target as tgt
    from dlite.bench.lookup_check import run
    from dlite.decoding.replay import iter_tasks
    from dlite.envinfo import env_info
    from omegaconf import OmegaConf
    from pipelines.stages.evaluate import heldout_records
    torch.set_num_threads(args.threads)
    model, tok = tgt.load(cfg.target)
    e = cfg.eval
    prompts = [t["prompt_ids"] for r in heldout_records(cfg)
               for t in iter_tasks(tok, r, e.max_turns, e.turn_pick, (e.min_context, e.max_context))]
    prompts = [p for p in prompts if not e.max_context or len(p) <= e.max_context]
    report = run(model, prompts, tgt.eos_ids(model, tok), e.max_new_tokens,
                 e.lookup_gamma or cfg.drafter.gamma, e.lookup.max_ngram)
    return {**report, "target": cfg.target.name, "threads": args.threads,
            "config": OmegaConf.to_container(cfg, resolve=True), "env": env_info()}


def loss_memory(cfg, args) -> dict:
    # Peak memory of one loss forward+backward, one-shot vs chunked (issue 16), measured
    # on CPU in a fresh subprocess each at B=1 (A=512, 768) and extrapolated to B=4,
    # A=512, γ=7 at Qwen3-4B's fixed widths (V 151936, N 32768, H 2560; not from --config:
    # the question is the production shape). ~4 min, ~7.5 GB RAM at peak, Linux only.
    from dlite.bench.loss_memory import run
    from dlite.envinfo import env_info
    return {**run(threads=args.threads), "env": env_info()}


def shape_rehearsal(cfg, args) -> dict:
    # The Qwen3-4B DLite drafter's real shapes on CPU in bf16: one train step, one
    # speculative round and the export round trip against a random-weight Qwen3-4B-shaped
    # target cut to 2 layers (built from a config, no download); wall time and peak RSS
    # per phase. The run config is only recorded: the shapes are the production yaml's.
    import torch
    from omegaconf import OmegaConf
    from dlite.bench.shape_rehearsal import run
    report = run(seq_len=512, anchors=64, layers=2, dtype=torch.bfloat16, threads=args.threads,
                 drafter=args.rehearse_drafter)
    return {**report, "config": OmegaConf.to_container(cfg, resolve=True)}


def regenerate(cfg, args) -> dict:
    # HFRegenerator vs the batched regenerator on the same --conversations (4) built-in
    # trajectories of data.corpus (2-3 assistant turns, 64 new tokens each), one process:
    # tokens/s, ratio, identical tokens. Batch size: data.regen_batch_size; with
    # data.regen_lookup > 0 also the batched one with verified lookup drafts.
    from pipelines.benchmarks.regenerate import run
    return run(cfg, n=args.conversations, max_new_tokens=64, threads=args.threads)


def peers(cfg, args) -> dict:
    # SpecForge runs as its own CLI in a subprocess (train, export); see pipelines/benchmarks/peers.py.
    from pipelines.benchmarks.peers import run
    return run(cfg, args)


def throughput(cfg, args) -> dict:
    # Drafters: --drafter NAME=DIR (default: the finished align / dspark stages); turns:
    # --requests of the held-out set with --min-context..--max-context tokens of history.
    from pipelines.benchmarks.throughput import run
    return run(cfg, args)


def gpu_check(cfg, args) -> dict:
    # The pipeline runs as a subprocess with --config and the same key=value overrides.
    from pipelines.benchmarks.gpu_check import run
    return run(cfg, args)


BENCHMARKS = {"draft_cost": draft_cost, "collect": collect, "train": train, "quality": quality,
              "target_probe": target_probe, "lookup_check": lookup_check, "loss_memory": loss_memory, "shape_rehearsal": shape_rehearsal,
              "gpu_check": gpu_check, "regenerate": regenerate, "peers": peers, "throughput": throughput}


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in BENCHMARKS:
        print(f"usage: python -m jobs.benchmark {{{','.join(BENCHMARKS)}}} --out FILE [--config FILE] [key=value ...]",
              file=sys.stderr)
        return 2

    def extra(p):
        p.add_argument("--out", required=True, help="JSON report path")
        p.add_argument("--rounds", type=int, default=20)
        p.add_argument("--threads", type=int, default=1)
        p.add_argument("--context-lengths", type=int, nargs="+", default=[256, 1024, 4096, 16384])
        p.add_argument("--draft-vocab-sizes", type=int, nargs="*", default=[4096, 8192, 16384],
                       help="draft_cost: draft vocabularies to time beside the full one")
        p.add_argument("--rehearse-drafter", default="dlite_qwen3_4b",
                       help="shape_rehearsal: the configs/drafter/ file to rehearse (e.g. dlite_v1_qwen3_4b, "
                            "dlite_v1_qwen3_8b)")
        p.add_argument("--work-dir", default=None, help="train: keep shards, runs, MLflow store here")
        p.add_argument("--budget", type=int, default=200,
                       help="quality: optimiser steps per method (DLite: half teacher, half align)")
        p.add_argument("--ablations", default=None,
                       help="quality: also train + replay these DLite variants ('all' or a comma list of "
                            "pipelines.benchmarks.ablations.ABLATIONS), each under the same budget")
        p.add_argument("--prompts", default=None,
                       help="quality: also evaluate on prompts nobody here wrote (a JSONL of "
                            "{\"turns\": [...]} records, e.g. ../shared/data/swe-bench-prompts.jsonl)")
        p.add_argument("--n-prompts", type=int, default=8, help="quality: how many of --prompts")
        p.add_argument("--conversations", type=int, default=4, help="regenerate: how many trajectories")
        p.add_argument("--shards", default=None, help="peers: a full-mode collection (default: the config's collect stage)")
        p.add_argument("--drafter", action="append", default=[],
                       help="peers, throughput: our drafter(s), NAME=DIR (default: the align stage's)")
        p.add_argument("--concurrency", default="1,2,4,8,16", help="throughput: concurrent requests, a comma list")
        p.add_argument("--requests", type=int, default=None,
                       help="throughput: held-out turns to decode (default: twice the largest concurrency)")
        p.add_argument("--min-context", type=int, default=1024, help="throughput: shortest history (tokens)")
        p.add_argument("--max-context", type=int, default=8192, help="throughput: longest history (tokens)")
        p.add_argument("--repeats", type=int, default=1,
                       help="throughput: runs of every method per concurrency, interleaved (medians and spread)")

    name, (args, cfg) = argv[0], parse_args(argv[1:], extra)
    if args.dry_run:
        print(f"[benchmark] would run {name} -> {args.out}")
        return 0
    report = BENCHMARKS[name](cfg, args)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps({k: report[k] for k in report if k not in ("config", "env")}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
