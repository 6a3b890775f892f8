"""Throughput at concurrency 1..N (issue 30): every method decoded closed loop through
`dlite.decoding.batch` at each concurrency, beside plain decoding batched the same way,
one process, side by side (ratios at the same concurrency).

Per method and concurrency (figures as the anchors name them):
- `output_tokens_per_s`: decode tokens (after each request's prefill token) / wall
  clock of the loop, prefill excluded (`serving`-style: vllm / SGLang bench output
  throughput without TTFT); `output_tokens_per_s_with_prefill`: all tokens / (wall +
  each request's measured prefill, run one after another as this single process would);
- `request_tokens_per_s`: the DLite authors' definition: sum of decode tokens / sum of
  per-request decode time (a request's time runs from its placement to its last token);
- `tpot_ms` p50 / p99 per request; `tau` = sum(accepted + 1) / rounds;
- `speedup_vs_plain` (and `_request`, `_with_prefill`) against plain at the SAME concurrency;
- memory per request: `kv_bytes_per_request` (the target's KV of the request's own
  slots, peak), `drafter_bytes_per_request` (`cache_bytes` of its drafter state: 0 for a
  history-free drafter, measured, not assumed), and the cache's padding share;
- `verify_ms_per_step` and rows x tokens per forward: what a batched block costs
  against a batched plain step -- where speculation stops paying, this says why;
- `lossless`: each request's greedy tokens equal its own batch-1 plain greedy output
  (`reference_outputs`: `plain_generate`, the loop every other figure is checked by).

Before each measured run, one warm-up batch (the first `concurrency` requests, 4 new
tokens) runs on a fresh method and is dropped; each run builds its method afresh, so a
SuffixDecoding tree of earlier outputs starts empty at every concurrency alike."""

import statistics
import time
from typing import Callable, Dict, List, Optional, Sequence

from dlite.decoding.batch import Request, batched_generate
from dlite.decoding.decode import plain_generate

WARMUP_TOKENS = 4


def reference_outputs(target, requests: Sequence[Request], max_new: int, eos) -> List[List[int]]:
    """Each request's batch-1 plain greedy output (what every method must reproduce)."""
    return [plain_generate(target, r.prompt_ids, max_new, eos_ids=eos, prefilled=r.prefill)[0]
            for r in requests]


def _pct(xs: List[float], q: float) -> Optional[float]:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def _mean(xs) -> Optional[float]:
    xs = list(xs)
    return statistics.fmean(xs) if xs else None


def summarize(res: dict, reference: Optional[List[List[int]]]) -> dict:
    """One run's figures (see the module docstring)."""
    reqs, steps = res["requests"], res["steps"]
    decode_tokens = sum(max(len(r["tokens"]) - 1, 0) for r in reqs)
    wall_s, prefill_s = res["wall_ms"] / 1e3, sum(r["prefill_ms"] for r in reqs) / 1e3
    rounds = [x for r in reqs for x in r["rounds"]]
    tpot = [r["decode_ms"] / (len(r["tokens"]) - 1) for r in reqs if len(r["tokens"]) > 1]
    bad = [] if reference is None else [r["index"] for r in reqs if r["tokens"] != reference[r["index"]]]
    return {
        "requests": len(reqs), "decode_tokens": decode_tokens, "wall_s": round(wall_s, 3),
        "output_tokens_per_s": decode_tokens / wall_s if wall_s else None,
        "output_tokens_per_s_with_prefill": sum(len(r["tokens"]) for r in reqs) / (wall_s + prefill_s)
        if wall_s + prefill_s else None,
        "request_tokens_per_s": decode_tokens / (sum(r["decode_ms"] for r in reqs) / 1e3) if reqs else None,
        "tpot_ms_p50": _pct(tpot, 0.5), "tpot_ms_p99": _pct(tpot, 0.99),
        "tau": sum(x["accepted"] + 1 for x in rounds) / len(rounds) if rounds else None,
        "kv_bytes_per_request": _mean(r["kv_bytes_peak"] for r in reqs),
        "drafter_bytes_per_request": _mean(r["drafter_bytes_peak"] for r in reqs),
        "drafter_bytes_per_request_max": max((r["drafter_bytes_peak"] for r in reqs), default=0),
        "forwards": len(steps),
        "verify_ms_per_step": _mean(s["verify_ms"] for s in steps),
        "draft_ms_per_step": _mean(s["draft_ms"] for s in steps),
        "rows_per_step": _mean(s["rows"] for s in steps),
        "tokens_per_row_per_step": _mean(s["n"] for s in steps),
        "padding_share": _mean(s["padding_share"] for s in steps),
        "lossless": None if reference is None else not bad, "mismatched_requests": bad,
    }


def _ratio(a, b) -> Optional[float]:
    return a / b if a is not None and b else None


def _speedups(row: dict, plain: dict) -> dict:
    return {"speedup_vs_plain": _ratio(row["output_tokens_per_s"], plain["output_tokens_per_s"]),
            "speedup_vs_plain_request": _ratio(row["request_tokens_per_s"], plain["request_tokens_per_s"]),
            "speedup_vs_plain_with_prefill": _ratio(row["output_tokens_per_s_with_prefill"],
                                                    plain["output_tokens_per_s_with_prefill"]),
            "verify_cost_vs_plain_step": _ratio(row["verify_ms_per_step"], plain["verify_ms_per_step"])}


def measure(target, methods: Dict[str, Callable], requests: Sequence[Request], concurrencies: Sequence[int],
            max_new: int, eos, reference: Optional[List[List[int]]] = None,
            log: Callable[[str], None] = lambda s: None) -> Dict[str, Dict[str, dict]]:
    """{method: {str(concurrency): figures}} with "plain" first; `methods`: {name:
    build() -> drafter, factory or None}, each built afresh per run."""
    names = {"plain": lambda: None, **methods}
    out: Dict[str, Dict[str, dict]] = {n: {} for n in names}
    for c in concurrencies:
        for name, build in names.items():
            batched_generate(target, build(), requests[:c], c, WARMUP_TOKENS, eos_ids=eos)  # dropped
            t0 = time.perf_counter()
            row = summarize(batched_generate(target, build(), requests, c, max_new, eos_ids=eos), reference)
            out[name][str(c)] = row
            log(f"[throughput] c={c:<3} {name:<24} {row['output_tokens_per_s'] or 0:8.1f} tok/s  "
                f"tau {row['tau'] or 0:.2f}  lossless {row['lossless']}  ({time.perf_counter() - t0:.0f} s)")
        for name in methods:
            out[name][str(c)].update(_speedups(out[name][str(c)], out["plain"][str(c)]))
    return out


def goals(rows: Dict[str, Dict[str, dict]], primary: str, history_drafter: Optional[str]) -> dict:
    """The issue's goals, from one run: DLite speedup at 8 over at 1 (>= 0.6), DLite over
    the DSpark-style drafter at every concurrency (>= 1.0), DLite's drafter memory 0."""
    d = rows.get(primary, {})
    sp = {c: r.get("speedup_vs_plain") for c, r in d.items()}
    out = {"retention_8_over_1": _ratio(sp.get("8"), sp.get("1")),
           "primary_drafter_bytes_zero": all(r.get("drafter_bytes_per_request_max") == 0 for r in d.values()),
           "lossless_every_method": all(r.get("lossless") is not False for m in rows.values() for r in m.values())}
    if history_drafter and history_drafter in rows:
        h = rows[history_drafter]
        out["primary_over_history_drafter"] = {c: _ratio(sp.get(c), h[c].get("speedup_vs_plain")) for c in d if c in h}
    return out


def kv_bytes_per_token(config, dtype_bytes: int = 2) -> int:
    """A transformer's KV cache bytes per token: layers x 2 (k, v) x kv heads x head dim."""
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return int(config.num_hidden_layers * 2 * heads * head_dim * dtype_bytes)
