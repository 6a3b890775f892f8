"""Acceptance and speed metrics from the round records of `speculative_generate`,
under the names of DLITE.md §4: `tau`, `accept_at_k`, both per context-length bucket,
`draft_ms(L)` / `draft_cache_bytes(L)` per bucket, the draft / verify / other time
split, tokens/s and `speedup_vs_ar`.

A record's `accepted` is the verifier's count a (the drafter's quality), even when EOS
or the token budget cut the round's output short; speed metrics count only tokens
actually emitted. Undefined values (no rounds, no time) are None, never NaN, so
reports stay valid JSON."""

import random
import statistics
from typing import Callable, Dict, List, Optional, Sequence

DEFAULT_BUCKETS = (1024, 4096, 16384)


def _fmt(n: int) -> str:
    return f"{n // 1024}K" if n % 1024 == 0 else str(n)


def bucket_labels(buckets: Sequence[int] = DEFAULT_BUCKETS) -> List[str]:
    """Boundaries [1024, 4096, 16384] -> ["<1K", "1K-4K", "4K-16K", ">16K"]."""
    b = sorted(buckets)
    if not b:
        return ["all"]
    mids = [f"{_fmt(lo)}-{_fmt(hi)}" for lo, hi in zip(b, b[1:])]
    return [f"<{_fmt(b[0])}"] + mids + [f">{_fmt(b[-1])}"]


def bucket_of(context_len: int, buckets: Sequence[int] = DEFAULT_BUCKETS) -> str:
    """Label of the bucket holding `context_len` (a boundary belongs to the bucket above)."""
    b, labels = sorted(buckets), bucket_labels(buckets)
    return labels[sum(context_len >= x for x in b)]


def tau(rounds: List[dict]) -> Optional[float]:
    """Mean of (accepted + 1) over rounds; ceiling γ + 1."""
    return sum(r["accepted"] + 1 for r in rounds) / len(rounds) if rounds else None


def accept_at_k(rounds: List[dict], gamma: int) -> List[Optional[float]]:
    """Conditional acceptance per block slot k = 1..γ: #rounds accepting slot k / #rounds
    that reached it (a >= k-1 and a draft of >= k tokens; a drafter may propose fewer
    than γ), None where no round reached slot k."""
    out = []
    for k in range(1, gamma + 1):
        reached = sum(r["accepted"] >= k - 1 and r.get("drafted", gamma) >= k for r in rounds)
        out.append(sum(r["accepted"] >= k for r in rounds) / reached if reached else None)
    return out


def _mean(rounds: List[dict], key: str) -> Optional[float]:
    return sum(r[key] for r in rounds) / len(rounds) if rounds else None


def by_bucket(rounds: List[dict], fn: Callable[[List[dict]], object],
              buckets: Sequence[int] = DEFAULT_BUCKETS) -> Dict[str, object]:
    """fn applied to the rounds of each context-length bucket that has any (label order)."""
    groups: Dict[str, List[dict]] = {label: [] for label in bucket_labels(buckets)}
    for r in rounds:
        groups[bucket_of(r["context_len"], buckets)].append(r)
    return {label: fn(rs) for label, rs in groups.items() if rs}


def time_split(rounds: List[dict]) -> dict:
    """Mean ms per round of draft / verify / other, and each one's share of the total."""
    total = sum(r["draft_ms"] + r["verify_ms"] + r["other_ms"] for r in rounds)
    out = {}
    for part in ("draft", "verify", "other"):
        out[f"{part}_ms"] = _mean(rounds, f"{part}_ms")
        out[f"{part}_frac"] = sum(r[f"{part}_ms"] for r in rounds) / total if total > 0 else None
    return out


def weighted_mean(pairs: List[tuple]) -> Optional[float]:
    """sum(value * weight) / sum(weight) over (value, weight) pairs; None without weight."""
    total = sum(w for _, w in pairs)
    return sum(v * w for v, w in pairs) / total if total > 0 else None


def tokens_per_s(n_tokens: int, ms: float) -> Optional[float]:
    return n_tokens / (ms / 1e3) if ms > 0 else None


def ratio(a: Optional[float], b: Optional[float]) -> Optional[float]:
    """a / b; None when either is missing or b is 0."""
    return a / b if a is not None and b else None


def speedup_vs_ar(spec_tps: Optional[float], plain_tps: Optional[float]) -> Optional[float]:
    """Speculative tokens/s over plain tokens/s (same target, prompts and run)."""
    return ratio(spec_tps, plain_tps) if spec_tps else None


def mean_of(xs) -> Optional[float]:
    """The mean of an iterable; None when it is empty."""
    xs = list(xs)
    return statistics.fmean(xs) if xs else None


def percentile(xs: Sequence[float], q: float) -> Optional[float]:
    """The nearest-rank q-quantile (q in 0..1) of xs; None when empty."""
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


# Resamples and seed of the speedup's bootstrap: fixed, so one set of pairs always gives
# the same lower bound (the release gate must not flip on a rerun of the arithmetic).
BOOTSTRAP_RESAMPLES, BOOTSTRAP_SEED, LOWER_QUANTILE = 2000, 0, 0.05


def _pooled(pairs: Sequence[tuple]) -> Optional[float]:
    """Pooled speedup over (spec_tokens, spec_ms, plain_tokens, plain_ms) pairs."""
    cols = [sum(p[i] for p in pairs) for i in range(4)]
    return speedup_vs_ar(tokens_per_s(cols[0], cols[1]), tokens_per_s(cols[2], cols[3]))


def speedup_spread(pairs: Sequence[tuple]) -> dict:
    """The speedup's spread over interleaved plain/speculative timing pairs (one per timed
    task): per-pair ratios, min / median / max, and a one-sided lower bound -- the 5th
    percentile of the pooled ratio over bootstrap resamples of the pairs. Fewer than 3
    pairs cannot say how noisy the machine is: the bound is then the smallest pair."""
    good = [p for p in pairs if _pooled([p]) is not None]  # a pair without time or tokens says nothing
    ratios = [_pooled([p]) for p in good]
    out = {"n_pairs": len(ratios), "per_pair": [round(r, 4) for r in ratios], "pooled": _pooled(good) if good else None}
    if not ratios:
        return {**out, "min": None, "median": None, "max": None, "lower_bound": None, "lower_bound_method": None}
    out.update(min=min(ratios), median=statistics.median(ratios), max=max(ratios))
    if len(ratios) < 3:
        return {**out, "lower_bound": min(ratios), "lower_bound_method": "min over < 3 pairs"}
    rng = random.Random(BOOTSTRAP_SEED)
    boot = sorted(_pooled([rng.choice(good) for _ in good]) for _ in range(BOOTSTRAP_RESAMPLES))
    return {**out, "lower_bound": boot[int(LOWER_QUANTILE * len(boot))],
            "lower_bound_method": f"bootstrap p{LOWER_QUANTILE * 100:g} of the pooled ratio, "
                                  f"{BOOTSTRAP_RESAMPLES} resamples of the pairs, seed {BOOTSTRAP_SEED}"}


def by_source(rounds: List[dict]) -> Optional[dict]:
    """Hybrids: per source the accepted tokens came from (a tree: the branch whose match
    was longest, `shared` when several tie, `none` when nothing was accepted; choose:
    the proposal verified) -- its rounds, share of rounds, tau and accepted drafts.
    None for methods that record no source."""
    tagged = [r for r in rounds if r.get("source") is not None]
    if not tagged:
        return None
    groups: Dict[str, List[dict]] = {}
    for r in tagged:
        groups.setdefault(r["source"], []).append(r)
    return {s: {"rounds": len(rs), "share": len(rs) / len(tagged), "tau": tau(rs),
                "accepted": sum(r["accepted"] for r in rs)} for s, rs in sorted(groups.items())}


def branch_figures(rounds: List[dict]) -> Optional[dict]:
    """Tree hybrids: per proposer, over every tree round, how often it proposed, its
    mean tokens in the tree, and `tau_alone` -- mean (its own match + 1), 1 where it had
    nothing: what that branch alone would have reached under greedy verification (the
    tree's budget applied). None for methods without branch records."""
    trees = [r for r in rounds if r.get("branches") is not None]
    if not trees:
        return None
    sources = sorted({b["source"] for r in trees for b in r["branches"]})
    out = {}
    for s in sources:
        best = [max([b["matched"] for b in r["branches"] if b["source"] == s], default=None) for r in trees]
        sizes = [sum(b["n"] for b in r["branches"] if b["source"] == s) for r in trees]
        out[s] = {"proposed_share": sum(m is not None for m in best) / len(trees),
                  "mean_tokens": sum(sizes) / len(trees),
                  "tau_alone": sum((m or 0) + 1 for m in best) / len(trees)}
    return out


def summarize_rounds(rounds: List[dict], gamma: int,
                     buckets: Sequence[int] = DEFAULT_BUCKETS) -> dict:
    """Every round-derived metric, overall and per context-length bucket."""
    return {
        "tau": tau(rounds),
        "accept_at_k": accept_at_k(rounds, gamma),
        "tau_by_bucket": by_bucket(rounds, tau, buckets),
        "accept_at_k_by_bucket": by_bucket(rounds, lambda rs: accept_at_k(rs, gamma), buckets),
        "rounds_by_bucket": by_bucket(rounds, len, buckets),
        # Mean tokens sent to verification per round (γ unless the drafter stops early).
        "drafted": _mean([{"d": r.get("drafted", gamma)} for r in rounds], "d"),
        # Draft tokens the target checked per round (a tree's nodes; else = drafted).
        "verified": _mean([{"v": r.get("verified", r.get("drafted", gamma))} for r in rounds], "v"),
        "by_source": by_source(rounds),
        # Choose / tree hybrids: share of rounds the learned drafter was run at all.
        "model_ran_share": _mean([{"m": float(r["model_ran"])} for r in rounds if "model_ran" in r], "m"),
        "branches": branch_figures(rounds),
        "branches_by_bucket": by_bucket(rounds, branch_figures, buckets),
        "time_split": time_split(rounds),
        "draft_ms_by_bucket": by_bucket(rounds, lambda rs: _mean(rs, "draft_ms"), buckets),
        "draft_cache_bytes_by_bucket": by_bucket(rounds, lambda rs: _mean(rs, "cache_bytes"), buckets),
        "n_rounds": len(rounds),
    }


def hybrid_vs_best(methods: Dict[str, dict]) -> Dict[str, dict]:
    """Per hybrid (a method named hybrid_*): its tau and speedup over the best single
    method's (every method not a hybrid) overall and per context bucket, which method
    that best one is, and whether it reaches it (ratio >= 1) everywhere on both --
    the goal "a hybrid is never worse than its best part"; where the methods carry
    `task_times`, also `time`: its decode rate over the fastest single method's on the
    same timed tasks (`_time_over_best`, with a paired bootstrap interval), and
    `time_ge_best_everywhere` and `time_behind` (the buckets whose whole interval is
    under 1)."""
    single = [n for n in methods if not n.startswith("hybrid_")]
    out = {}
    for h in (n for n in methods if n.startswith("hybrid_")):
        row = {}
        for metric, key in (("tau", "tau"), ("speedup", "speedup_vs_ar")):
            mine = {"all": methods[h].get(key), **(methods[h].get(f"{key}_by_bucket") or {})}
            fig = {}
            for b, v in mine.items():
                rivals = {n: (methods[n].get(key) if b == "all" else (methods[n].get(f"{key}_by_bucket") or {}).get(b))
                          for n in single}
                rivals = {n: x for n, x in rivals.items() if x is not None}
                if v is None or not rivals:
                    continue
                fig[b] = _over_best(v, rivals)
            row[metric] = fig
        ratios = [f["ratio"] for m in row.values() for f in m.values()]
        row["ge_best_everywhere"] = bool(ratios) and all(r is not None and r >= 1.0 for r in ratios)
        time = _time_over_best(methods, h, single)
        if time:
            row["time"] = time
            row["time_ge_best_everywhere"] = all(f["ratio"] >= 1.0 for f in time.values())
            # behind beyond the turns' spread: the whole bootstrap interval under 1
            row["time_behind"] = sorted(b for b, f in time.items()
                                        if f["upper_bound"] is not None and f["upper_bound"] < 1.0)
        out[h] = row
    return out


def learned_over_free(methods: Dict[str, dict]) -> Dict[str, dict]:
    """Per hybrid with the learned drafter whose training-free twin ran beside it
    (`hybrid_lookup_suffix_<rule>` and `hybrid_free_<rule>`: the same token drafters and
    rule, no learned drafter): its tau, speedup and decode rate on the same timed tasks
    over the twin's, overall and per bucket (the rate with its paired bootstrap
    interval) -- what the learned drafter adds to the hybrid, > 1 where it pays its
    draft time."""
    out = {}
    for free in (n for n in methods if n.startswith("hybrid_free_")):
        h = "hybrid_lookup_suffix_" + free[len("hybrid_free_"):]
        if h not in methods:
            continue
        row = {}
        for metric, key in (("tau", "tau"), ("speedup", "speedup_vs_ar")):
            mine = {"all": methods[h].get(key), **(methods[h].get(f"{key}_by_bucket") or {})}
            theirs = {"all": methods[free].get(key), **(methods[free].get(f"{key}_by_bucket") or {})}
            row[metric] = {b: _over_twin(_over_best(v, {free: theirs[b]})) for b, v in mine.items()
                           if v is not None and theirs.get(b) is not None}
        time = {b: _over_twin(f) for b, f in _time_over_best(methods, h, [free]).items()}
        if time:
            row["time"] = time
        out[h] = {"free": free, **row}
    return out


def _over_twin(f: dict) -> dict:
    """An `_over_best` figure against the one twin: its value named `free_value`."""
    f = {k: v for k, v in f.items() if k != "best"}
    f["free_value"] = f.pop("best_value")
    return f


def _time_over_best(methods: Dict[str, dict], h: str, single: List[str]) -> dict:
    """The hybrid's decode tokens per second over the fastest single method's, on the
    timed tasks every one of them ran (`task_times`), overall and per bucket: the same
    turns and, greedy and lossless, the same tokens, so the ratio reads the methods'
    own decode times only -- a speedup ratio also carries the noise of the separate
    plain run each method's is divided by. Each figure also has a paired bootstrap
    interval (`_time_interval`). {} when a method has no task times."""
    timed = [n for n in single if methods[n].get("task_times")]
    if not methods[h].get("task_times") or not timed:
        return {}
    keys = set.intersection(*({(t["id"], t["turn"]) for t in methods[n]["task_times"]} for n in [h, *timed]))
    times = {n: _task_table(methods[n]["task_times"], keys) for n in [h, *timed]}
    rates = {n: _rates(times[n]) for n in [h, *timed]}
    out = {b: _over_best(v, {n: rates[n][b] for n in timed if b in rates[n]}) for b, v in rates[h].items()}
    return {b: {**f, **_time_interval(times[h], times[f["best"]], b)} for b, f in out.items()}


def _time_interval(mine: Dict[tuple, tuple], best: Dict[tuple, tuple], bucket: str) -> dict:
    """How far the decode-time ratio could move with other turns of the same kind: its
    5th and 95th percentiles over bootstrap resamples of the bucket's timed tasks, the
    same resampled tasks for the hybrid and the best single method (paired). A bucket
    whose upper bound is under 1 is behind its best part beyond what these turns'
    spread explains; one whose interval holds 1 cannot tell. Fewer than 3 tasks: no
    interval."""
    keys = sorted(k for k, v in mine.items() if bucket in ("all", v[2]))
    if len(keys) < 3:
        return {"lower_bound": None, "upper_bound": None, "n_tasks": len(keys)}
    rng, boot = random.Random(BOOTSTRAP_SEED), []
    for _ in range(BOOTSTRAP_RESAMPLES):
        pick = [rng.choice(keys) for _ in keys]
        rival = _rate([best[k] for k in pick])
        boot.append(_rate([mine[k] for k in pick]) / rival if rival > 0 else float("inf"))
    boot.sort()
    return {"lower_bound": round(boot[int(LOWER_QUANTILE * len(boot))], 4),
            "upper_bound": round(boot[int((1 - LOWER_QUANTILE) * len(boot)) - 1], 4), "n_tasks": len(keys)}


def _over_best(value: float, rivals: Dict[str, float]) -> dict:
    """`value` over the largest of `rivals` ({method: figure}): {ratio, best, best_value, value}."""
    best = max(rivals, key=rivals.get)
    r = ratio(value, rivals[best])
    return {"ratio": None if r is None else round(r, 4), "best": best, "best_value": round(rivals[best], 4),
            "value": round(value, 4)}


def _task_table(tasks: List[dict], keys: set) -> Dict[tuple, tuple]:
    """{(id, turn): (tokens, decode ms, bucket)} of the tasks in `keys`."""
    return {(t["id"], t["turn"]): (t["tokens"], t["spec_ms"], t["bucket"]) for t in tasks
            if (t["id"], t["turn"]) in keys}


def _rate(rows: List[tuple]) -> float:
    """Decode tokens per second over (tokens, ms, ...) rows; 0 without time."""
    ms = sum(r[1] for r in rows)
    return 1000.0 * sum(r[0] for r in rows) / ms if ms > 0 else 0.0


def _rates(table: Dict[tuple, tuple]) -> Dict[str, float]:
    """Decode tokens per second over a `_task_table`, overall ("all") and per bucket."""
    groups: Dict[str, list] = {}
    for row in table.values():
        for b in ("all", row[2]):
            groups.setdefault(b, []).append(row)
    return {b: _rate(rows) for b, rows in groups.items() if sum(r[1] for r in rows) > 0}
