"""Benchmark of the collect stage, one JSON report:

  capture_overhead  bare target prefill throughput over collection throughput (hooks +
                    reference capture + the stored arrays written to a shard), the same
                    length-bucketed batches in the same process, alternating which runs
                    first every repetition so machine noise hits both alike (goal <= 1.15)
  bytes_per_token   bytes of the stored arrays per token for every storage mode x
                    reference kind, measured on the arrays themselves, beside the
                    DeepSpec layout for the same data ((K*H + H) bf16 per token) and the
                    ratio DeepSpec / (anchors + topk) (goal >= 10x)
  collect_scaling   records/s and tokens/s of the whole `pipelines.stages.collect.collect` with
                    1 and 2 actors on a small built-in input (Ray started once)

All inputs are the built-in corpus rendered with `dlite.data.render.sequences`, so the
figures are reproducible from the config alone."""

import math
import os
import tempfile
import time
from pathlib import Path

from omegaconf import OmegaConf

from dlite.data import formats, shards
from dlite.data.features import TargetFeatures, extract, forward_groups, pad_group, write_features
from dlite.data.render import sequences
from dlite.corpus import trajectories as corpus
DEEPSPEC_BYTES = 2  # DeepSpec stores bf16 states


def _records(cfg, n: int) -> list:
    """The first `n` built-in train records, canonical and validated as collect reads them."""
    d, out = cfg.data, []
    for i, raw in enumerate(corpus.generate("train", n, cfg.run.seed, d.min_chars, d.max_chars)):
        where = f"builtin:train#{i}"
        out.append({"index": i, "where": where,
                    **formats.normalise(formats.to_canonical(raw, where), True)})
    return out


def _sequences(cfg, tok, records: list) -> list:
    d = cfg.data
    return [s for r in records for s in sequences(tok, r, d.max_seq_len, d.length_policy,
                                                   d.anchors_per_seq, cfg.run.seed)]


def _spec(cfg, storage_mode: str, reference: str) -> dict:
    return {"storage_mode": storage_mode, "reference": reference, "topk": cfg.data.topk,
            "gamma": cfg.drafter.gamma}


def _budget(cfg) -> int:
    return max(cfg.data.batch_tokens, cfg.data.max_seq_len)  # as CollectSettings does


# ---------------------------------------------------------------- capture overhead

def _padded_batches(seqs: list, budget: int, pad_id: int, device) -> list:
    """The (input_ids, attention_mask) batches `iter_extract` forms from `seqs` on `device`."""
    return [pad_group(seqs, group, pad_id) for group in forward_groups(seqs, budget, device)]


def _time_bare(tf: TargetFeatures, batches: list) -> float:
    t0 = time.perf_counter()
    for ids, mask in batches:
        tf.bare_forward(ids.to(tf.device), mask.to(tf.device))
    return time.perf_counter() - t0


def _time_collect(tf, seqs, spec, budget, pad_id, tmp: str) -> float:
    """One collection pass as an actor runs it, rows written to a throwaway shard file."""
    w = shards.ShardWriter(shards.Store(tmp), 0, spec["reference"])
    t0 = time.perf_counter()
    write_features(tf, seqs, spec, w, budget, pad_id)
    w.writer.close()
    seconds = time.perf_counter() - t0
    os.remove(shards.Store(tmp).path(w.tmp))
    return seconds


def capture_overhead(cfg, tf, seqs: list, pad_id: int, repetitions: int) -> dict:
    """Bare vs collection throughput, alternating order each repetition, after one
    untimed warm-up of each (first-call allocations would otherwise bias the first)."""
    spec, budget = _spec(cfg, cfg.data.storage_mode, cfg.data.reference), _budget(cfg)
    batches, tokens = _padded_batches(seqs, budget, pad_id, tf.device), sum(len(s["input_ids"]) for s in seqs)
    bare, coll = [], []
    with tempfile.TemporaryDirectory() as tmp:
        _time_bare(tf, batches)
        _time_collect(tf, seqs, spec, budget, pad_id, tmp)
        for rep in range(repetitions):
            runs = [(bare, lambda: _time_bare(tf, batches)),
                    (coll, lambda: _time_collect(tf, seqs, spec, budget, pad_id, tmp))]
            for times, fn in (runs if rep % 2 == 0 else runs[::-1]):
                times.append(fn())
    bare_tps, coll_tps = tokens * len(bare) / sum(bare), tokens * len(coll) / sum(coll)
    return {"ratio": round(bare_tps / coll_tps, 4), "goal_max": 1.15,
            "bare_tokens_per_s": round(bare_tps, 1), "collect_tokens_per_s": round(coll_tps, 1),
            "bare_s": [round(x, 4) for x in bare], "collect_s": [round(x, 4) for x in coll],
            "tokens_per_pass": tokens, "sequences": len(seqs), "batches": len(batches),
            "repetitions": repetitions, "storage_mode": spec["storage_mode"],
            "reference": spec["reference"]}


# ---------------------------------------------------------------- bytes per token

def bytes_per_token(cfg, tf, seqs: list, pad_id: int, hidden: int) -> dict:
    """Stored bytes / token of every mode x reference, from the arrays `extract` returns
    (features + reference; the int32 ids and int8 loss mask, 5 bytes/token in every
    mode, are reported apart), and the DeepSpec layout for the same tokens."""
    tokens = sum(len(s["input_ids"]) for s in seqs)
    k = len(cfg.drafter.target_layer_ids)
    out = {}
    for mode in ("full", "anchors"):
        for ref in ("last_hidden", "topk"):
            results, _ = extract(tf, seqs, _spec(cfg, mode, ref), _budget(cfg), pad_id)
            by_array = {}
            for r in results:
                for name, arr in r.items():
                    by_array[name] = by_array.get(name, 0) + arr.nbytes
            out[f"{mode}+{ref}"] = {"bytes_per_token": round(sum(by_array.values()) / tokens, 3),
                                    "by_array": {n: round(b / tokens, 3) for n, b in by_array.items()}}
    deepspec = (k * hidden + hidden) * DEEPSPEC_BYTES
    return {**out, "deepspec": {"bytes_per_token": deepspec,
                                "layout": f"({k}*{hidden} + {hidden}) * {DEEPSPEC_BYTES} (bf16, every token)"},
            "deepspec_over_anchors_topk": round(deepspec / out["anchors+topk"]["bytes_per_token"], 2),
            "goal_min": 10, "token_arrays_bytes_per_token": 5, "tokens": tokens,
            "layers": k, "hidden_size": hidden, "topk": cfg.data.topk,
            "anchors_per_seq": cfg.data.anchors_per_seq, "gamma": cfg.drafter.gamma}


# ---------------------------------------------------------------- collect scaling

def collect_scaling(cfg, n_records: int, actors=(1, 2)) -> dict:
    """The whole stage (Ray Data, actor start-up with the target load, shard files,
    manifest) on `n_records` built-in records, same plan for every actor count: shards
    of ceil(n/4) records, so two actors both get work."""
    from pipelines.stages.collect import CollectSettings, collect
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "input.jsonl"
        corpus.write_jsonl(corpus.generate("train", n_records, cfg.run.seed, cfg.data.min_chars,
                                           cfg.data.max_chars), src)
        for a in actors:
            st = CollectSettings.from_config(cfg)
            st.num_actors, st.records_per_shard = a, max(1, math.ceil(n_records / 4))
            t0 = time.perf_counter()
            m = collect(cfg, str(src), str(Path(tmp) / f"out-{a}"), st)
            s = time.perf_counter() - t0
            c = m["counts"]
            out[f"actors_{a}"] = {"records_per_s": round(c["written"] / s, 3),
                                  "tokens_per_s": round(c["tokens"] / s, 1), "seconds": round(s, 2),
                                  "records": c["written"], "tokens": c["tokens"],
                                  "shards": len(m["files"])}
    return out


def _start_ray() -> bool:
    """Local Ray with 2 CPUs unless one is up; True if started here. Workers inherit
    PYTHONPATH from this process, so the repo is importable in them from any cwd."""
    import ray
    if ray.is_initialized():
        return False
    root = str(Path(__file__).resolve().parents[1])
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    return True


def run(cfg, records: int = 16, repetitions: int = 3, collect_records: int = 16) -> dict:
    """The report: capture overhead and bytes/token on the first `records` built-in
    records, collect throughput on `collect_records`."""
    import ray
    from dlite import target
    from dlite.envinfo import env_info
    model, tok = target.load(cfg.target)
    model.eval()
    tf = TargetFeatures(model, cfg.drafter.target_layer_ids)
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else 0
    seqs = _sequences(cfg, tok, _records(cfg, records))
    report = {"capture_overhead": capture_overhead(cfg, tf, seqs, pad_id, repetitions),
              "bytes_per_token": bytes_per_token(cfg, tf, seqs, pad_id, model.config.hidden_size)}
    del model, tf
    started = _start_ray()
    try:
        report["collect_scaling"] = collect_scaling(cfg, collect_records)
    finally:
        if started:
            ray.shutdown()
    return {**report, "config": OmegaConf.to_container(cfg, resolve=True), "env": env_info()}
