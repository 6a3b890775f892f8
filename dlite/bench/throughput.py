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

- where the wall clock goes: `draft_ms` / `verify_ms` per step, and in total the time
  spent placing refilled requests' prefills in the cache (`place_s`), dropping a
  draining batch's empty rows (`drop_s`) and everything outside the forwards and
  drafting (`outside_forward_share`).

Repeats: `repeats` runs of every method at each concurrency, interleaved (all methods
once, then all again), so a method and plain share the machine's state; each figure
above is the first run's, except the speed figures, which are the median over the runs,
with every run's value beside (`runs`), and each speedup is taken per run (a method's run
over plain's run of the same round) with its median, min and max.

Before the first measured run of a method at a concurrency, one warm-up batch (the
first `concurrency` requests, 4 new tokens) runs on a fresh method and is dropped; each
run builds its method afresh, so a SuffixDecoding tree of earlier outputs starts empty
at every concurrency and repeat alike."""

import statistics
import time
from typing import Callable, Dict, List, Optional, Sequence

from dlite.decoding.batch import Request, batched_generate
from dlite.decoding.decode import plain_generate
from dlite.decoding.metrics import mean_of, percentile, ratio

WARMUP_TOKENS = 4


def reference_outputs(target, requests: Sequence[Request], max_new: int, eos) -> List[List[int]]:
    """Each request's batch-1 plain greedy output (what every method must reproduce)."""
    return [plain_generate(target, r.prompt_ids, max_new, eos_ids=eos, prefilled=r.prefill)[0]
            for r in requests]


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
        "tpot_ms_p50": percentile(tpot, 0.5), "tpot_ms_p99": percentile(tpot, 0.99),
        "tau": sum(x["accepted"] + 1 for x in rounds) / len(rounds) if rounds else None,
        "kv_bytes_per_request": mean_of(r["kv_bytes_peak"] for r in reqs),
        "drafter_bytes_per_request": mean_of(r["drafter_bytes_peak"] for r in reqs),
        "drafter_bytes_per_request_max": max((r["drafter_bytes_peak"] for r in reqs), default=0),
        "forwards": len(steps),
        "verify_ms_per_step": mean_of(s["verify_ms"] for s in steps),
        "draft_ms_per_step": mean_of(s["draft_ms"] for s in steps),
        "rows_per_step": mean_of(s["rows"] for s in steps),
        "tokens_per_row_per_step": mean_of(s["n"] for s in steps),
        "padding_share": mean_of(s["padding_share"] for s in steps),
        "place_s": round(sum(s.get("place_ms", 0.0) for s in steps) / 1e3, 3),
        "drop_s": round(sum(s.get("drop_ms", 0.0) for s in steps) / 1e3, 3),
        "outside_forward_share": 1 - sum(s["draft_ms"] + s["verify_ms"] for s in steps) / res["wall_ms"]
        if res["wall_ms"] else None,
        "lossless": None if reference is None else not bad, "mismatched_requests": bad,
    }


SPEED = ("output_tokens_per_s", "request_tokens_per_s", "output_tokens_per_s_with_prefill", "wall_s")
SPEEDUPS = {"speedup_vs_plain": "output_tokens_per_s", "speedup_vs_plain_request": "request_tokens_per_s",
            "speedup_vs_plain_with_prefill": "output_tokens_per_s_with_prefill",
            "verify_cost_vs_plain_step": "verify_ms_per_step"}


def _median(xs: list) -> Optional[float]:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def combine(runs: List[dict]) -> dict:
    """One method's runs at one concurrency: the first run's figures, the speed figures'
    median, every run's speed figures (`runs`), lossless only if every run was."""
    row = {**runs[0], **{k: _median([r[k] for r in runs]) for k in SPEED}}
    row["runs"] = [{k: r[k] for k in (*SPEED, "lossless")} for r in runs]
    row["lossless"] = None if runs[0]["lossless"] is None else all(r["lossless"] for r in runs)
    row["mismatched_requests"] = sorted({i for r in runs for i in r["mismatched_requests"]})
    return row


def speedups(runs: List[dict], plain: List[dict]) -> dict:
    """Per run against plain's run of the same round: each speedup's median, min, max."""
    out = {}
    for name, key in SPEEDUPS.items():
        per = [ratio(r[key], p[key]) for r, p in zip(runs, plain)]
        good = [x for x in per if x is not None]
        out.update({name: _median(good), f"{name}_runs": per,
                    f"{name}_min": min(good, default=None), f"{name}_max": max(good, default=None)})
    return out


def measure(target, methods: Dict[str, Callable], requests: Sequence[Request], concurrencies: Sequence[int],
            max_new: int, eos, reference: Optional[List[List[int]]] = None,
            log: Callable[[str], None] = lambda s: None, repeats: int = 1) -> Dict[str, Dict[str, dict]]:
    """{method: {str(concurrency): figures}} with "plain" first; `methods`: {name:
    build() -> drafter, factory or None}, each built afresh per run; `repeats` runs each,
    interleaved (see the module docstring)."""
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    names = {"plain": lambda: None, **methods}
    out: Dict[str, Dict[str, dict]] = {n: {} for n in names}
    for c in concurrencies:
        runs: Dict[str, List[dict]] = {n: [] for n in names}
        for k in range(repeats):
            for name, build in names.items():
                if k == 0:
                    batched_generate(target, build(), requests[:c], c, WARMUP_TOKENS, eos_ids=eos)  # dropped
                t0 = time.perf_counter()
                row = summarize(batched_generate(target, build(), requests, c, max_new, eos_ids=eos), reference)
                runs[name].append(row)
                log(f"[throughput] c={c:<3} run {k + 1}/{repeats} {name:<24} {row['output_tokens_per_s'] or 0:8.1f} "
                    f"tok/s  tau {row['tau'] or 0:.2f}  lossless {row['lossless']}  ({time.perf_counter() - t0:.0f} s)")
        for name in names:
            out[name][str(c)] = combine(runs[name])
            if name != "plain":
                out[name][str(c)].update(speedups(runs[name], runs["plain"]))
    return out


def goals(rows: Dict[str, Dict[str, dict]], primary: str, history_drafter: Optional[str]) -> dict:
    """The issue's goals, from one benchmark (medians over its repeats): DLite speedup at 8 over at 1 (>= 0.6), DLite over
    the DSpark-style drafter at every concurrency (>= 1.0), DLite's drafter memory 0."""
    d = rows.get(primary, {})
    sp = {c: r.get("speedup_vs_plain") for c, r in d.items()}
    out = {"retention_8_over_1": ratio(sp.get("8"), sp.get("1")),
           "primary_drafter_bytes_zero": all(r.get("drafter_bytes_per_request_max") == 0 for r in d.values()),
           "lossless_every_method": all(r.get("lossless") is not False for m in rows.values() for r in m.values())}
    if history_drafter and history_drafter in rows:
        h = rows[history_drafter]
        out["primary_over_history_drafter"] = {c: ratio(sp.get(c), h[c].get("speedup_vs_plain")) for c in d if c in h}
        out["primary_over_history_drafter_runs"] = {  # per repeat: the spread of the ratio
            c: [ratio(a, b) for a, b in zip(d[c].get("speedup_vs_plain_runs", []),
                                            h[c].get("speedup_vs_plain_runs", []))] for c in d if c in h}
    return out


def kv_bytes_per_token(config, dtype_bytes: int = 2) -> int:
    """A transformer's KV cache bytes per token: layers x 2 (k, v) x kv heads x head dim."""
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return int(config.num_hidden_layers * 2 * heads * head_dim * dtype_bytes)
