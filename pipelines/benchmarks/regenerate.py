"""`python -m jobs.benchmark regenerate`: today's `HFRegenerator` (one conversation at a
time, HF `generate`, the whole history prefilled again every turn) against the batched,
cache-carrying `dlite.decoding.regenerate.BatchedRegenerator`, on the same conversations in
one process: the configured target, N training trajectories of the configured built-in
corpus (`data.corpus`) cut after their first 2-3 assistant turns, `max_new_tokens` per
turn, greedy. With `data.regen_lookup` > 0 the batched regenerator also runs with that
many prompt-lookup draft tokens verified per step (`batched_lookup`), on the same
conversations.

Reports generated tokens per second of each (end to end: prefills included), their
ratio (goal >= 4x), whether every turn's greedy tokens are identical (and the first
difference if not), and the batched one's prefill / decode rates."""

import time

import torch
from omegaconf import OmegaConf

GOAL = 4.0


def conversations(cfg, n: int) -> list:
    """n built-in training trajectories, validated, each ending with its k-th assistant
    turn (k = 2, 3, 2, ...): k turns to regenerate, histories of different lengths."""
    from dlite.corpus import build
    from dlite.data import formats
    d, out = cfg.data, []
    for i, raw in enumerate(build.generate(d.corpus, "train", n, cfg.run.seed, d.min_chars, d.max_chars)):
        rec = formats.normalise(formats.to_canonical(raw, f"train:{i}"))
        k, msgs = 2 + i % 2, []
        for m in rec["messages"]:
            msgs.append(m)
            k -= m["role"] == "assistant"
            if k == 0:
                break
        out.append({**rec, "index": i, "messages": msgs})
    return out


def _old(model, tok, recs: list, max_new: int) -> dict:
    from dlite.data.render import HFRegenerator
    hf = HFRegenerator(model, tok, max_new)
    t0 = time.perf_counter()
    for r in recs:
        hf.regenerate(r["messages"], r["tools"])
    seconds = time.perf_counter() - t0
    n = sum(map(len, hf.generated))
    return {"seconds": round(seconds, 2), "turns": len(hf.generated), "tokens_generated": n,
            "tokens_per_s": round(n / seconds, 2), "_tokens": hf.generated}


def _new(model, tok, recs: list, max_new: int, batch_size: int, lookup: int = 0) -> dict:
    from dlite.decoding.regenerate import BatchedRegenerator
    regen = BatchedRegenerator(model, tok, max_new, batch_size=batch_size, lookup=lookup)
    t0 = time.perf_counter()
    done, bad = regen.regenerate_many(recs)
    seconds = time.perf_counter() - t0
    s = regen.stats
    return {"seconds": round(seconds, 2), "turns": s["turns"], "tokens_generated": s["tokens_generated"],
            "tokens_per_s": round(s["tokens_generated"] / seconds, 2), "batch_size": batch_size,
            "prefill_tokens": s["prefill_tokens"], "prefill_tokens_per_s": round(s["prefill_tokens"] / s["prefill_s"], 1),
            "decode_tokens_per_s": round(s["tokens_generated"] / s["decode_s"], 2),
            "decode_steps": s["decode_steps"], "prefix_misses": s["prefix_misses"], "quarantined": bad,
            "lookup": lookup, "drafted": s["drafted"], "accepted": s["accepted"],
            "_tokens": [t for d in done for t in d["tokens"]]}


def _first_difference(old: list, new: list):
    for turn, (a, b) in enumerate(zip(old, new)):
        if a != b:
            at = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            return {"turn": turn, "position": at, "hf": a[at:at + 4], "batched": b[at:at + 4]}
    return None if len(old) == len(new) else {"turns": [len(old), len(new)]}


def run(cfg, n: int = 4, max_new_tokens: int = 64, threads: int = 1) -> dict:
    from dlite import target
    from dlite.envinfo import env_info
    torch.set_num_threads(threads)
    model, tok = target.load(cfg.target)
    recs = conversations(cfg, n)
    from dlite.data import chat
    lengths = [len(tok(chat.render(tok, r["messages"], r["tools"]), add_special_tokens=False)["input_ids"])
               for r in recs]  # the recorded conversations' tokens (regenerated ones differ)
    with torch.inference_mode():  # warm-up: first-call allocations out of both timings
        model(input_ids=torch.tensor([[tok.eos_token_id or 0] * 8]))
    new = _new(model, tok, recs, max_new_tokens, cfg.data.regen_batch_size)
    fast = _new(model, tok, recs, max_new_tokens, cfg.data.regen_batch_size, cfg.data.regen_lookup) \
        if cfg.data.regen_lookup > 0 else None
    old = _old(model, tok, recs, max_new_tokens)
    hf_tokens = old.pop("_tokens")
    diff = _first_difference(hf_tokens, new.pop("_tokens"))
    ratio = best = new["tokens_per_s"] / old["tokens_per_s"]
    lookup = {}
    if fast is not None:
        fast_diff = _first_difference(hf_tokens, fast.pop("_tokens"))
        lookup = {"batched_lookup": fast, "speedup_lookup": round(fast["tokens_per_s"] / old["tokens_per_s"], 2),
                  "lookup_identical_tokens": fast_diff is None, "lookup_first_difference": fast_diff}
        best = max(ratio, fast["tokens_per_s"] / old["tokens_per_s"])
    return {"target": cfg.target.name, "dtype": cfg.target.dtype, "threads": threads, "corpus": cfg.data.corpus,
            "conversations": n, "assistant_turns": [sum(m["role"] == "assistant" for m in r["messages"]) for r in recs],
            "recorded_tokens": lengths, "max_new_tokens": max_new_tokens, "hf_regenerator": old, "batched_regenerator": new,
            "speedup": round(ratio, 2), "goal": GOAL, "meets_goal": best >= GOAL,
            "identical_tokens": diff is None, "first_difference": diff, **lookup,
            "config": OmegaConf.to_container(cfg, resolve=True), "env": env_info()}
