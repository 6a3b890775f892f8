"""Trajectory replay: speculative vs plain decoding of the target on the assistant turns
of recorded agent trajectories, measured interleaved, reported under DLITE.md §4 names.

Inputs, one record each:
- an agent trajectory `{"id", "messages", "tools"?}` (OpenAI chat): every assistant
  turn i is generated from the RECORDED history `messages[:i]`, so histories grow
  turn by turn exactly as in the agent run;
- a DeepSpec-style prompt `{"turns": [str, ...]}`: turn j is a user message after the
  earlier turns and the target's own (plain, greedy-identical) replies to them.
Each history is rendered with the tokenizer's chat template (`add_generation_prompt`)
and generated until `<|im_end|>` (the tokenizer's EOS) or `max_new_tokens`.

Speed is compared on the decode phase (after the prefill that yields the first token,
identical work in both loops): replay re-prefills every history from scratch, which a
real agent with prefix caching would not, so end-to-end figures (`*_e2e`) understate
the decode speedup on long histories; both are reported.

Greedy output is compared token for token: `lossless` is strict (identical outputs).
A low-precision target can part the two at a tie of its own logits (`dlite.decoding.ties`),
so each mismatching task also records its first `divergence`, classified tie or not,
and `lossless_up_to_ties` says whether every mismatch was a tie.

`draft_vocab_coverage` (greedy): the share of the target's plain output tokens inside
the vocabulary the drafter drafts over (a learned drafter's static draft vocabulary, or
a per-request one, `dlite.decoding.context_vocab`), token-weighted over tasks."""

import dataclasses
import time
from typing import Callable, Dict, Iterable, Iterator, List, Optional, Sequence

import torch

from dlite.data import chat
from dlite.decoding import metrics, ties
from dlite.decoding.decode import Prefill, plain_generate, prefill, speculative_generate
from dlite.target import eos_ids


@dataclasses.dataclass
class EvalArgs:
    max_new_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    buckets: Sequence[int] = metrics.DEFAULT_BUCKETS
    max_context: Optional[int] = None   # longer histories are skipped (and counted)
    min_context: Optional[int] = None   # turn_pick "context": the range turns are picked from
    max_turns: Optional[int] = None     # assistant turns per record, None = all
    turn_pick: str = "first"            # which max_turns: "first", "spread" (to the last) or
    #                                     "context" (spread over the turns whose history is
    #                                     min_context..max_context tokens)
    seed: int = 0
    warmup: bool = True                 # one untimed short run of each loop first


def resolve_args(args=None, **overrides) -> EvalArgs:
    """EvalArgs from a dict, a config section (attributes) or None, plus overrides."""
    out = EvalArgs()
    for f in dataclasses.fields(EvalArgs):
        if isinstance(args, dict) and f.name in args:
            setattr(out, f.name, args[f.name])
        elif args is not None and not isinstance(args, dict) and hasattr(args, f.name):
            setattr(out, f.name, getattr(args, f.name))
    return dataclasses.replace(out, **overrides)


def render_ids(tokenizer, messages: List[dict], tools=None) -> List[int]:
    text = chat.render(tokenizer, messages, tools, generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def pick_turns(n: int, max_turns: Optional[int], how: str = "first") -> List[int]:
    """Which of n turns to replay: the first `max_turns`, or `max_turns` spread evenly
    from the first to the last (histories of every length, the longest included)."""
    if max_turns is None or max_turns >= n:
        return list(range(n))
    if how == "first" or max_turns < 2:
        return list(range(max_turns)) if how == "first" else [n - 1]
    return sorted({round(k * (n - 1) / (max_turns - 1)) for k in range(max_turns)})


def iter_tasks(tokenizer, record: dict, max_turns: Optional[int] = None, how: str = "first",
               context: tuple = (0, None)) -> Iterator[dict]:
    """Yield {"id", "turn", "prompt_ids"} per turn to generate. For `turns` records the
    consumer must set task["reply_ids"] before asking for the next turn (so those are
    always replayed from the first turn on). `how="context"` spreads `max_turns` over
    the turns whose history length lies in `context` = (min, max or None) tokens."""
    rid = record.get("id")
    if "messages" in record:
        msgs, tools = record["messages"], record.get("tools")
        turns = [i for i, m in enumerate(msgs) if m.get("role") == "assistant"]
        if how == "context":
            lo, hi = context[0] or 0, context[1] or float("inf")
            prompts = [(n, render_ids(tokenizer, msgs[:t], tools)) for n, t in enumerate(turns)]
            prompts = [(n, p) for n, p in prompts if lo <= len(p) <= hi]
            for k in pick_turns(len(prompts), max_turns, "spread"):
                yield {"id": rid, "turn": prompts[k][0], "prompt_ids": prompts[k][1]}
            return
        for n in pick_turns(len(turns), max_turns, how):
            yield {"id": rid, "turn": n, "prompt_ids": render_ids(tokenizer, msgs[:turns[n]], tools)}
        return
    history: List[dict] = []
    for n, user in enumerate(record["turns"][:max_turns]):
        history.append({"role": "user", "content": user})
        task = {"id": rid, "turn": n, "prompt_ids": render_ids(tokenizer, history)}
        yield task
        reply = tokenizer.decode(task.get("reply_ids", []), skip_special_tokens=True)
        history.append({"role": "assistant", "content": reply})


def drafter_for(drafter, prompt_ids):
    """A drafter instance (it drafts blocks, or trees: `TreeHybrid.draft_tree`), or a
    factory prompt_ids -> drafter (e.g. SuffixDecoding, ContextVocab)."""
    is_drafter = hasattr(drafter, "draft") or hasattr(drafter, "draft_tree")
    return drafter if is_drafter else drafter(prompt_ids)


def vocab_coverage(drafter, tokens) -> Optional[float]:
    """Share of `tokens` inside the vocabulary `drafter` drafts over: its own answer
    (`vocab_coverage`: a per-request vocabulary) or a learned drafter's static draft
    vocabulary; None for the rest (every token reachable, or tokens read from context)."""
    if hasattr(drafter, "vocab_coverage"):
        return drafter.vocab_coverage(tokens)
    vocab = getattr(drafter, "vocab", None)
    return vocab.coverage(tokens) if hasattr(vocab, "coverage") else None


def _spec(target, d, task: dict, a: EvalArgs, eos, seed: int, pre: Prefill) -> dict:
    """The speculative loop from the shared prefill; e2e adds the prefill's time."""
    dev = next(target.parameters()).device
    t0 = time.perf_counter()
    ids, rounds = speculative_generate(target, d, task["prompt_ids"], a.max_new_tokens, a.temperature,
                                       a.top_p, a.top_k, eos, torch.Generator(dev).manual_seed(seed), pre)
    return dict(spec_ids=ids, rounds=rounds, gamma=d.gamma,
                spec_e2e_ms=pre.ms + (time.perf_counter() - t0) * 1e3,
                spec_ms=sum(r["draft_ms"] + r["verify_ms"] + r["other_ms"] for r in rounds))


def _plain(target, task: dict, a: EvalArgs, eos, seed: int, pre: Prefill) -> dict:
    """The plain loop from the shared prefill; e2e adds the prefill's time."""
    dev = next(target.parameters()).device
    t0 = time.perf_counter()
    ids, timing = plain_generate(target, task["prompt_ids"], a.max_new_tokens, a.temperature,
                                 a.top_p, a.top_k, eos, torch.Generator(dev).manual_seed(seed), pre)
    return dict(plain_ids=ids, plain_ms=timing["decode_ms"],
                plain_e2e_ms=pre.ms + (time.perf_counter() - t0) * 1e3)


def _checked(target, d, task: dict, a: EvalArgs, res: dict) -> dict:
    """Greedy: the first divergence (an extra forward only where the loops part) and the
    drafter's vocabulary coverage of the target's own greedy tokens."""
    if a.temperature <= 0:
        res["divergence"] = ties.divergence(target, task["prompt_ids"], res["spec_ids"], res["plain_ids"])
        res["vocab_coverage"] = vocab_coverage(d, res["plain_ids"])
    return res


def _base(task: dict, pre: Prefill) -> dict:
    return {"id": task["id"], "turn": task["turn"], "context_len": len(task["prompt_ids"]),
            "prefill_ms": pre.ms}


def _run_task(target, drafter, task: dict, a: EvalArgs, eos, spec_first: bool, seed: int,
              pre: Optional[Prefill] = None) -> dict:
    """Both loops on one prompt, in the given order, with per-loop seeded generators,
    from `pre` (this prompt's prefill) or a prefill of their own."""
    d = drafter_for(drafter, task["prompt_ids"])  # untimed, as a per-request factory call
    pre = pre or prefill(target, task["prompt_ids"], d.target_layer_ids, d.needs_history)
    runs = [lambda: _spec(target, d, task, a, eos, seed, pre), lambda: _plain(target, task, a, eos, seed, pre)]
    res = _base(task, pre)
    for run in (runs if spec_first else runs[::-1]):
        res.update(run())
    return _checked(target, d, task, a, res)


def _first_mismatch(res: dict) -> Optional[dict]:
    at = ties.mismatch_at(res["spec_ids"], res["plain_ids"])
    return None if at is None else {"id": res["id"], "turn": res["turn"], **at}


def _tokens(r: dict, loop: str, drop: int = 1) -> int:
    """Tokens `loop` ("spec" / "plain") produced in task `r`, less `drop`: the decode
    phase does not count the prefill's one."""
    return max(len(r[f"{loop}_ids"]) - drop, 0)


def _speed(results: List[dict], e2e: bool = False) -> dict:
    """Pooled tokens/s of each loop (decode phase, or end to end with `e2e`)."""
    sfx, drop = ("_e2e_ms", 0) if e2e else ("_ms", 1)
    return {loop: metrics.tokens_per_s(sum(_tokens(r, loop, drop) for r in results),
                                       sum(r[f"{loop}{sfx}"] for r in results))
            for loop in ("spec", "plain")}


def _pairs(results: List[dict]) -> List[tuple]:
    """Each timed task's (spec tokens, spec ms, plain tokens, plain ms), decode phase."""
    return [(_tokens(r, "spec"), r["spec_ms"], _tokens(r, "plain"), r["plain_ms"]) for r in results]


def _task_summary(res: dict) -> dict:
    keep = ("id", "turn", "context_len", "spec_ms", "plain_ms")
    return {**{k: res[k] for k in keep}, "tau": metrics.tau(res["rounds"]),
            "n_tokens": len(res["spec_ids"]), "divergence": res.get("divergence"),
            "vocab_coverage": res.get("vocab_coverage")}


def aggregate(results: List[dict], skipped: int, a: EvalArgs) -> dict:
    """Every DLITE.md §4 metric over raw `replay` results."""
    rounds = [r for res in results for r in res["rounds"]]
    gamma = results[0]["gamma"] if results else 0
    tps, tps_e2e = _speed(results), _speed(results, e2e=True)
    spread = metrics.speedup_spread(_pairs(results))
    greedy = a.temperature <= 0
    mismatches = [m for m in map(_first_mismatch, results) if m] if greedy else []
    # A mismatching task without a recorded divergence (older raw results) is no tie.
    n_ties = sum(bool((res.get("divergence") or {}).get("tie")) for res in results) if greedy else 0
    by_ctx = {}
    for res in results:
        by_ctx.setdefault(metrics.bucket_of(res["context_len"], a.buckets), []).append(res)
    order = metrics.bucket_labels(a.buckets)
    coverage = [(r["vocab_coverage"], len(r["plain_ids"])) for r in results
                if r.get("vocab_coverage") is not None]
    return {
        **metrics.summarize_rounds(rounds, gamma, a.buckets),
        "speedup_vs_ar": metrics.speedup_vs_ar(tps["spec"], tps["plain"]),
        "speedup_vs_ar_e2e": metrics.speedup_vs_ar(tps_e2e["spec"], tps_e2e["plain"]),
        # Per timed pair; its lower bound is what the release gate decides on.
        "speedup_vs_ar_spread": spread,
        "speedup_vs_ar_lower": spread["lower_bound"],
        "speedup_vs_ar_by_bucket": {k: metrics.speedup_vs_ar(*_speed(by_ctx[k]).values())
                                    for k in order if k in by_ctx},
        # Each task's decode: what compares methods on the same turns directly, without
        # the plain runs each one's speedup is divided by (`metrics.hybrid_vs_best`).
        "task_times": [{"id": r["id"], "turn": r["turn"], "bucket": metrics.bucket_of(r["context_len"], a.buckets),
                        "tokens": _tokens(r, "spec"), "spec_ms": round(r["spec_ms"], 3)} for r in results],
        "tokens_per_s": {**tps, "spec_e2e": tps_e2e["spec"], "plain_e2e": tps_e2e["plain"]},
        # Sampled outputs cannot be compared token by token; the unit tests check the
        # sampling rule's distribution instead.
        "lossless": (not mismatches) if greedy else None,
        "first_mismatch": mismatches[0] if mismatches else None,
        "n_mismatched_tasks": len(mismatches),
        # Only each task's first mismatch is classified: after a tie the outputs differ.
        "lossless_up_to_ties": (n_ties == len(mismatches)) if greedy else None,
        "n_tie_divergences": n_ties,
        # Greedy only: share of the target's plain output tokens the drafter could have
        # proposed (its draft vocabulary, static or per-request), token-weighted.
        "draft_vocab_coverage": metrics.weighted_mean(coverage) if greedy else None,
        "gamma": gamma, "n_tasks": len(results), "skipped_turns": skipped,
        "n_tokens": {"spec": sum(len(r["spec_ids"]) for r in results),
                     "plain": sum(len(r["plain_ids"]) for r in results)},
        "bucket_labels": order, "settings": dataclasses.asdict(a),
        "per_task": [_task_summary(res) for res in results],
    }


def _shared_prefills(target, live: Dict[float, dict], made: Dict[tuple, object]) -> Dict[float, Prefill]:
    """One prefill per distinct prompt among this step's tasks (one per temperature; the
    same prompt unless a `turns` record's sampled replies parted them), capturing every
    layer its drafters read, at every position if one of them keeps a history."""
    groups: Dict[tuple, list] = {}
    for t, task in live.items():
        groups.setdefault(tuple(task["prompt_ids"]), []).append(t)
    out = {}
    for temps in groups.values():
        ds = [d for (_, t), d in made.items() if t in temps]
        pre = prefill(target, live[temps[0]]["prompt_ids"], [i for d in ds for i in d.target_layer_ids],
                      any(d.needs_history for d in ds))
        out.update({t: pre for t in temps})
    return out


def replay_methods(target, tokenizer, builders: Dict[str, Callable], records: Iterable[dict], args=None,
                   temperatures: Optional[Sequence[float]] = None, timed: bool = True, **overrides) -> tuple:
    """Replay every record (trajectory or `turns` prompt) with every method
    (`builders`: {name: build() -> drafter or factory prompt_ids -> drafter}, each built
    once per temperature) at every temperature; returns
    ({name: {str(temperature): (raw per-task results, skipped turns)}}, args).

    Each history is prefilled ONCE for all methods and temperatures (`dlite.decoding.
    decode.prefill`; every loop starts from a copy of its cache), so `*_e2e_ms` add that
    one measured prefill to each loop's decode. `timed`: per method, plain and
    speculative decoding interleaved per prompt (alternating which goes first) after one
    untimed warm-up, the figures to time. Untimed (acceptance): plain decoding runs once
    per prompt and temperature and is shared by every method -- the same tokens a rerun
    would give (same prompt, seed and rule) -- its timing is not for speedups.
    Raw results of several calls (e.g. parallel workers) concatenate before `aggregate`."""
    a = resolve_args(args, **overrides)
    a.buckets = tuple(a.buckets)
    temps = [float(t) for t in (temperatures if temperatures is not None else [a.temperature])]
    eos = eos_ids(target, tokenizer)  # every id the target's generation config stops on
    made = {(n, t): build() for n, build in builders.items() for t in temps}
    results = {key: [] for key in made}
    skipped = {t: 0 for t in temps}
    names = list(builders)
    for rec in records:
        # One task generator per temperature: a `turns` record's next prompt holds this
        # temperature's own reply, so each renders its turns itself (a few ms of
        # tokenising per turn against seconds of prefill).
        gens = [iter_tasks(tokenizer, rec, a.max_turns, a.turn_pick, (a.min_context, a.max_context))
                for _ in temps]
        for step in zip(*gens):  # lockstep: a `turns` record's reply_ids is set before next()
            live = {}
            for t, task in zip(temps, step):
                if a.max_context and len(task["prompt_ids"]) > a.max_context:
                    skipped[t] += 1  # counted, never silently dropped
                else:
                    live[t] = task
            ds = {(n, t): drafter_for(f, live[t]["prompt_ids"]) for (n, t), f in made.items() if t in live}
            pres = _shared_prefills(target, live, ds)
            for t, task in live.items():
                at = dataclasses.replace(a, temperature=t)
                k = len(results[(names[0], t)])
                if timed:
                    for n in names:
                        if at.warmup and not results[(n, t)]:
                            _warm_up(target, made[(n, t)], task, at, eos, pres[t])
                        results[(n, t)].append(_run_task(target, ds[(n, t)], task, at, eos, k % 2 == 0,
                                                         at.seed + k, pres[t]))
                else:
                    plain = _plain(target, task, at, eos, at.seed + k, pres[t])  # one for all methods
                    for n in names:
                        res = {**_base(task, pres[t]), **_spec(target, ds[(n, t)], task, at, eos, at.seed + k, pres[t]),
                               **plain}
                        results[(n, t)].append(_checked(target, ds[(n, t)], task, at, res))
                task["reply_ids"] = results[(names[0], t)][-1]["plain_ids"]
    out = {n: {str(t): (results[(n, t)], skipped[t]) for t in temps} for n in names}
    return out, a


def _warm_up(target, drafter, task: dict, a: EvalArgs, eos, pre: Prefill) -> None:
    """One untimed short run of both loops. A factory with memory across prompts
    (SuffixDecoding's tree of earlier outputs) warms up on a fork, so the warm-up's
    output cannot leak."""
    warm = drafter.fork() if hasattr(drafter, "fork") else drafter
    _run_task(target, warm, task, dataclasses.replace(a, max_new_tokens=4), eos, True, a.seed, pre)


def replay(target, tokenizer, drafter, records: Iterable[dict], args=None, **overrides) -> tuple:
    """One drafter (or factory prompt_ids -> drafter) over every record, timed
    (`replay_methods`); returns (raw per-task results, skipped turns, args)."""
    out, a = replay_methods(target, tokenizer, {"method": lambda: drafter}, records, args, **overrides)
    results, skipped = out["method"][str(float(a.temperature))]
    return results, skipped, a


def evaluate_prompts(target, tokenizer, drafter, records: Iterable[dict], args=None, **overrides) -> dict:
    """`replay` then `aggregate`: the report dict of one drafter on these records."""
    return aggregate(*replay(target, tokenizer, drafter, records, args, **overrides))
