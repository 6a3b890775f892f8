"""Throughput at several concurrencies (issue 30), shared by the evaluation stage
(`eval.concurrency`: one Ray worker after the speed replay, the report's `throughput`)
and `python -m jobs.benchmark throughput` (`pipelines.benchmarks.throughput`).

Requests are held-out turns whose history is lo..hi tokens, spread over every such
turn; each is prefilled once (capturing what every learned drafter reads) and shared by
every run. Methods: the learned drafters, `eval.baselines` and `eval.hybrids`, choose
and tree hybrids alike (`dlite.decoding.methods`; a tree hybrid's rows verify token
trees in the batched forward, `dlite.decoding.batch`); the per-request vocabulary is
not batched and is listed as skipped. The measuring
itself is `dlite.bench.throughput`: closed loop, one warm-up batch dropped, plain
decoding batched the same way at every concurrency, lossless checked per request."""

import time
from typing import Dict, List, Optional

from omegaconf import OmegaConf

SKIPPED = "skipped_methods"
HELDOUT_READS = (8, 16, 32, 64)  # held-out trajectories to read until enough turns are found


def turn_prompts(tok, records: list, n: int, lo: int, hi: Optional[int]) -> List[List[int]]:
    """Up to n prompts of the turns of `records` with lo..hi tokens of history, spread."""
    from dlite.decoding.replay import iter_tasks, pick_turns
    prompts = [t["prompt_ids"] for r in records for t in iter_tasks(tok, r, None, "context", (lo, hi))]
    return [prompts[k] for k in pick_turns(len(prompts), n, "spread")]


def heldout_turns(cfg, tok, n: int, lo: int, hi: Optional[int], reads=HELDOUT_READS) -> List[List[int]]:
    """Up to n prompts of held-out turns with lo..hi tokens of history (`turn_prompts`),
    reading more held-out trajectories than the evaluation's (`reads`, in turn) when its
    own hold fewer such turns."""
    from pipelines.stages.evaluate import heldout_records
    prompts: List[List[int]] = []
    for k in (cfg.eval.n_trajectories, *reads):
        more = OmegaConf.merge(cfg, {"eval": {"n_trajectories": max(k, cfg.eval.n_trajectories)}})
        prompts = turn_prompts(tok, heldout_records(more), n, lo, hi)
        if len(prompts) >= n:
            break
    return prompts


def batched_methods(ev, learned: dict, vocab: int, calibration: Optional[dict] = None) -> tuple:
    """({name: build}, skipped names): learned drafters, baselines, hybrids."""
    from dlite.decoding.methods import method_builders
    skipped = ["context_vocab"] if ev.context_vocab else []
    return method_builders(OmegaConf.merge(ev, {"context_vocab": False}), learned, vocab, calibration), skipped


def throughput_report(cfg, model, tok, learned: dict, vocab: int, prompts: List[List[int]],
                      concurrency: List[int], calibration: Optional[dict] = None,
                      log=lambda s: print(s, flush=True), repeats: int = 1) -> dict:
    """Every method at every concurrency on `prompts` (see the module docstring)."""
    import torch
    from dlite.bench import throughput as tp
    from dlite.decoding.batch import Request
    from dlite.decoding.decode import prefill
    from dlite.target import eos_ids
    if not prompts:
        raise ValueError("throughput: no held-out turn in the history range to decode")
    t0 = time.time()
    builders, skipped = batched_methods(cfg.eval, learned, vocab, calibration)
    layers = sorted({i for d in learned.values() for i in d.target_layer_ids})
    history = any(d.needs_history for d in learned.values())
    requests = [Request(i, p, prefill(model, p, layers, history)) for i, p in enumerate(prompts)]
    eos, max_new = eos_ids(model, tok), int(cfg.eval.max_new_tokens)
    log(f"[throughput] {len(requests)} requests, {min(map(len, prompts))}-{max(map(len, prompts))} tokens "
        f"of history, {max_new} new tokens each, concurrency {concurrency}; methods {['plain', *builders]}")
    reference = tp.reference_outputs(model, requests, max_new, eos)
    t1 = time.time()
    rows = tp.measure(model, builders, requests, concurrency, max_new, eos, reference, log, repeats)
    primary = next(iter(learned), None)
    hist = next((n for n, d in learned.items() if d.needs_history), None)
    return {"methods": rows, "concurrency": list(concurrency), "primary": primary, "history_drafter": hist,
            "goals": tp.goals(rows, primary, hist), SKIPPED: skipped,
            "requests": {"n": len(requests), "context_lens": [len(p) for p in prompts],
                         "prefill_ms": [round(r.prefill.ms, 1) for r in requests], "max_new_tokens": max_new},
            "calibration": "fitted on validation turns" if calibration else "defaults (not fitted)",
            "kv_bytes_per_token": tp.kv_bytes_per_token(model.config, next(model.parameters()).element_size()),
            "repeats": repeats, "threads": torch.get_num_threads(),
            "seconds_prefill_and_reference": round(t1 - t0, 1),
            "seconds_measuring": round(time.time() - t1, 1)}


def stage_throughput(cfg_dict: dict, drafters: Dict[str, str], records: list, threads: int,
                     calibration: Optional[dict] = None) -> dict:
    """The evaluation stage's worker: `eval.concurrency` on the turns of `records` with
    eval.min_context..eval.max_context tokens of history, `eval.concurrency_requests`
    of them (default twice the largest concurrency)."""
    from pipelines.stages.evaluate import _load
    cfg = OmegaConf.create(cfg_dict)
    ev = cfg.eval
    conc = sorted({int(c) for c in ev.concurrency})
    model, tok, learned, vocab = _load(cfg, drafters, threads)
    prompts = turn_prompts(tok, records, ev.concurrency_requests or 2 * conc[-1], ev.min_context or 0, ev.max_context)
    return throughput_report(cfg, model, tok, learned, vocab, prompts, conc, calibration)


def metric_items(report: dict, prefix: str = "") -> dict:
    """MLflow metrics `<prefix><method>.c<N>.<figure>` of the headline figures."""
    keys = ("output_tokens_per_s", "request_tokens_per_s", "speedup_vs_plain", "speedup_vs_plain_request",
            "tau", "tpot_ms_p50", "tpot_ms_p99", "drafter_bytes_per_request", "kv_bytes_per_request")
    return {f"{prefix}{m}.c{c}.{k}": float(v) for m, by in report["methods"].items() for c, r in by.items()
            for k in keys if isinstance((v := r.get(k)), (int, float)) and not isinstance(v, bool)}


def plots(report: dict, stem) -> list:
    """The speedup and drafter-memory plots of a throughput report, `<stem>-*.png`."""
    from pathlib import Path
    from pipelines.common import plots as p
    stem = Path(stem)
    return [p.by_concurrency_plot(report["methods"], "speedup_vs_plain", "speedup vs plain (same concurrency)",
                                  stem.with_name(f"{stem.name}-speedup.png")),
            p.by_concurrency_plot(report["methods"], "drafter_bytes_per_request", "drafter state bytes / request",
                                  stem.with_name(f"{stem.name}-drafter_memory.png"))]
