"""The torch-only device check (issue 32): what a first GPU needs to tell us about DLite at
Qwen3-4B's shape, in one process that imports torch (and what torch imports), numpy and
PyYAML beside `dlite` -- no transformers, safetensors, tokenizers, pyarrow, omegaconf,
Ray, DeepSpeed or MLflow (`tests/unit/test_device_check.py` runs it with those imports
refused), so it runs on a bare GPU box from a copy of `dlite/` and `configs/drafter/`.

    python -m dlite.bench.device [--out FILE] [--smoke] [--layers N]
    (or: bash scripts/device_check.sh ...)

What it measures, random weights (speed, memory and losslessness, never quality):
- the target (`dlite.bench.qwen3`: Qwen3 in plain torch, bf16, Qwen3-4B's shape at full
  depth unless `--layers` cuts it): one decode step and one 8-token verification
  (anchor + gamma 7) at 1K / 8K / 32K context (`target_decode_ms`, `target_verify_ms`);
- the DLite and DSpark-style draft rounds at the same contexts, full and draft
  vocabulary, with DSpark's drafter cache bytes (`draft`: `draft_cost`'s report, the
  target's decode step interleaved with them: flat vs growing);
- greedy lossless decoding through DLite's loop (`speculative_generate` vs
  `plain_generate`), with the DLite drafter and with the target drafting for itself
  (every draft accepted), strict on an fp32 copy of the target (`lossless`) and up to
  ties on the bf16 one (`lossless_detail`);
- the chunked loss's (and the one-shot loss's) peak memory at the production batch,
  4 x 512 anchors x 7 (`loss_memory`: torch's allocator peak on a GPU, the process's
  VmHWM on CPU, as `loss_memory.measure`);
- the engine-free training loop's samples/s at the production batch (4 x 4096 tokens,
  512 anchors, features captured from the target), batches made on the device first.
Seconds per phase against the 8-minute budget, peak GPU / host memory per phase, env.
A phase that raises is recorded under `errors` and the others still run, so one device
call reports everything; the exit status is 1 when anything failed or was not lossless.

Without CUDA (or with `--smoke`) the same code runs at toy widths and short contexts
(`SMOKE`): that is what CI runs, in a few seconds."""

import argparse
import dataclasses
import itertools
import json
import os
import platform
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

from dlite.bench import draft_cost, loss_memory, qwen3
from dlite.bench.draft_cost import CONFIG_DIR, load_drafter_yaml
from dlite.bench.shape_rehearsal import QWEN3_4B, QWEN3_4B_LAYERS, _batch, _drafter, _Phases, map_layer_ids
from dlite.decoding import ties
from dlite.decoding.decode import crop_cache, plain_generate, speculative_generate, target_forward
from dlite.decoding.oracle import TargetAsDrafter
from dlite.losses import chunk_rows_for
from dlite.train.loop import LoopConfig, train_loop
from dlite.train.optim import PlainEngine

BUDGET_S = 480  # the device call's 8 minutes; phases past it are skipped, and say so
LR = 6e-4  # configs/base.yaml's train.lr
# GPU: Qwen3-4B, configs/drafter/dlite_qwen3_4b.yaml as is, the production batch of
# configs/experiments/qwen3_4b_swe.yaml (batch_size 4, max_seq_len 4096, 512 anchors).
FULL = dict(target={}, drafter={}, layers=QWEN3_4B_LAYERS, lengths=(1024, 8192, 32768), rounds=20,
            warmup=3, prompt=512, new_tokens=64, batch=4, seq_len=4096, anchors=512, train_steps=12,
            batches=2)
# CPU smoke: test_shape_rehearsal's toy widths, the same code path. Init std 0.2: layer
# outputs then outweigh the embedding as they do at Qwen3-4B's width with 0.02 (~0.02 x
# sqrt(2560) = 1); at width 64, 0.02 leaves the stream a copy of the input token and
# greedy decoding repeats one token. Contexts past DSpark's first 256-position block.
SMOKE = dict(target=dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16, initializer_range=0.2),
             drafter=dict(hidden_size=64, num_layers=1, num_heads=4, num_kv_heads=2, head_dim=16,
                          intermediate_size=96, head_hidden=32, markov_rank=32, draft_vocab_size=128),
             layers=2, lengths=(64, 512, 2048), rounds=5, warmup=2, prompt=24, new_tokens=32, batch=2,
             seq_len=96, anchors=8, train_steps=3, batches=1)


class _Check(_Phases):
    """shape_rehearsal's phases (wall s, peak RSS) plus torch's GPU peak per phase; a phase
    that raises, or starts past the budget, is recorded in `errors` and returns None."""

    def __init__(self, device: torch.device, budget_s: float):
        super().__init__()
        self.dev, self.budget_s, self.t0 = device, budget_s, time.perf_counter()
        self.gpu_peak, self.errors = {}, {}

    def run(self, name, fn):
        if time.perf_counter() - self.t0 > self.budget_s:
            self.errors[name] = f"skipped: the {self.budget_s} s budget was spent before it started"
            return None
        cuda = self.dev.type == "cuda"
        if cuda:
            torch.cuda.empty_cache()  # each phase's peak is its own, not its predecessor's
            torch.cuda.reset_peak_memory_stats(self.dev)
        t0 = time.perf_counter()
        try:
            out = super().run(name, fn)
        except Exception:  # noqa: BLE001 -- reported, and the other phases still run
            self.seconds[name] = round(time.perf_counter() - t0, 3)
            self.errors[name] = traceback.format_exc()[-3000:]
            out = None
        if cuda:
            self.gpu_peak[name] = torch.cuda.max_memory_allocated(self.dev)
        print(f"[device check] {name}: {self.seconds[name]} s{' FAILED' if name in self.errors else ''}",
              file=sys.stderr, flush=True)
        return out


class _Steps(draft_cost._TargetStep):
    """draft_cost's target decode step (`step(L)`: one token at context L, the cache
    cropped back to L) around the torch-native target; `block(L, n)` verifies n tokens
    the same way. Each context is prefilled once, not timed."""

    def __init__(self, model, lengths):
        self.model, self.forward, self.caches = model, target_forward, {}
        self.dev = next(model.parameters()).device
        with torch.no_grad():
            for L in lengths:
                self.caches[L] = model.new_cache()
                ids = torch.randint(0, model.config.vocab_size, (L,), device=self.dev)
                target_forward(model, ids, 0, self.caches[L], logits_to_keep=1)

    @torch.no_grad()
    def block(self, L: int, n: int) -> None:
        target_forward(self.model, torch.ones(n, dtype=torch.long, device=self.dev), L, self.caches[L])
        crop_cache(self.caches[L], L)


def _verify_ms(steps: _Steps, lengths, n: int, rounds: int, warmup: int) -> dict:
    """Median ms of an n-token verification per context, lengths rotated every round."""
    times = {L: [] for L in lengths}
    for r in range(warmup + rounds):
        for L in lengths[r % len(lengths):] + lengths[:r % len(lengths)]:
            ms = draft_cost._timed(lambda: steps.block(L, n), steps.dev)
            if r >= warmup:
                times[L].append(ms)
    return {str(L): round(statistics.median(t), 4) for L, t in times.items()}


def target_and_drafts(model, cfg, sz: dict) -> dict:
    """Target decode / verify steps and both drafters' rounds at every context."""
    lengths, dev = tuple(sz["lengths"]), next(model.parameters()).device
    H, V = model.config.hidden_size, model.config.vocab_size
    steps = _Steps(model, lengths)
    sizes = tuple(n for n in (cfg.draft_vocab_size,) if n and n < V)
    models = draft_cost._models(cfg, H, V, dev, torch.bfloat16, sizes)
    report = draft_cost._run(models, steps, cfg, H, V, lengths, sz["rounds"], sz["warmup"], 4, dev,
                             torch.bfloat16)
    report.pop("env")  # the check's own env block covers it
    verify = _verify_ms(steps, lengths, cfg.gamma + 1, sz["rounds"], sz["warmup"])
    return {"target_decode_ms": report.pop("target_step_ms"), "target_verify_ms": verify,
            "verify_block": cfg.gamma + 1, "draft": report}


def _decode_pair(model, drafter, prompt, plain, n: int) -> dict:
    """One speculative run against the plain tokens: strict, and up to the target's ties
    (`dlite.decoding.ties`: one extra prefill at the first mismatch)."""
    spec, rounds = speculative_generate(model, drafter, prompt, max_new_tokens=n)
    div = ties.divergence(model, prompt, spec, plain)
    return {"lossless": spec == plain, "lossless_up_to_ties": div is None or bool(div["tie"]),
            "first_divergence": div, "rounds": len(rounds),
            "mean_accepted": round(statistics.mean(r["accepted"] for r in rounds), 3) if rounds else None}


def lossless(model, cfg, sz: dict) -> dict:
    """Greedy plain vs speculative decoding of a random prompt, with the bf16 DLite
    drafter (built as the train stage builds it) and with the target as its own drafter."""
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, model.config.vocab_size, (sz["prompt"],), generator=g).tolist()
    dev, n = next(model.parameters()).device, sz["new_tokens"]
    drafter = _drafter(cfg, model, {"input_ids": torch.tensor([prompt])}, torch.bfloat16).to(dev).eval()
    oracle = TargetAsDrafter(model, prompt, cfg.gamma, list(cfg.target_layer_ids))
    plain, _ = plain_generate(model, prompt, max_new_tokens=n)
    return {"target_dtype": str(model.dtype).removeprefix("torch."), "prompt_tokens": len(prompt),
            "new_tokens": n, "plain_distinct_tokens": len(set(plain)),
            "dlite": _decode_pair(model, drafter, prompt, plain, n),
            "target_as_drafter": _decode_pair(model, oracle, prompt, plain, n)}


def _on(dev, tensors) -> list:
    """`loss_memory._inputs` moved to `dev`, the drafter logits a leaf that takes grad."""
    logits, *rest = [t.to(dev) for t in tensors]
    return [logits.detach().requires_grad_(), *rest]


def _cuda_loss_peak(path: str, rows: int, dev, vocab, draft_vocab, hidden, gamma, dtype, chunk_rows) -> dict:
    """`loss_memory.measure` on a GPU: warm up at a few rows (cuBLAS workspaces), then
    the allocator's peak over one loss forward + backward above what the inputs hold."""
    dt = getattr(torch, dtype)
    warm = _on(dev, loss_memory._inputs(2 * gamma, min(vocab, 20000), min(draft_vocab, 4096), hidden, gamma, dt))
    loss_memory._loss_step(path, *warm, chunk_rows=gamma)
    del warm
    inputs = _on(dev, loss_memory._inputs(rows, vocab, draft_vocab, hidden, gamma, dt))
    torch.cuda.synchronize(dev)
    torch.cuda.reset_peak_memory_stats(dev)
    base, t0 = torch.cuda.memory_allocated(dev), time.perf_counter()
    loss_memory._loss_step(path, *inputs, chunk_rows=chunk_rows)
    torch.cuda.synchronize(dev)
    return {"rows": rows, "loss_activation_bytes": torch.cuda.max_memory_allocated(dev) - base,
            "baseline_allocated_bytes": base, "time_s": round(time.perf_counter() - t0, 3)}


def loss_peak(cfg, shape: dict, sz: dict, dev) -> dict:
    """Both loss paths at the batch's slot rows (batch x anchors x gamma), measured there
    directly (no extrapolation, unlike `jobs.benchmark loss_memory` on CPU)."""
    V, rows = shape["vocab_size"], sz["batch"] * sz["anchors"] * cfg.gamma
    kw = dict(vocab=V, draft_vocab=cfg.draft_vocab_size or V, hidden=shape["hidden_size"], gamma=cfg.gamma,
              dtype="bfloat16", chunk_rows=chunk_rows_for(V))
    threads = torch.get_num_threads()
    try:
        got = {p: (_cuda_loss_peak(p, rows, dev, **kw) if dev.type == "cuda"
                   else loss_memory.measure(p, rows, threads=threads, **kw)) for p in loss_memory.PATHS}
    finally:
        torch.set_num_threads(threads)
    chunked = got["chunked"]["loss_activation_bytes"]
    return {**kw, "rows": rows, **got,
            "method": "torch.cuda.max_memory_allocated - allocated after setup" if dev.type == "cuda"
                      else "VmHWM - VmRSS after setup, in this process (loss_memory.measure)",
            "goal": {"loss_activation_bytes_max": loss_memory.GOAL_BYTES, "met": chunked <= loss_memory.GOAL_BYTES}}


def _batches(model, cfg, sz: dict, dev) -> list:
    """`sz["batches"]` training batches of `batch` sequences, each made as the shape
    rehearsal makes one (random tokens, all supervised, anchors sampled, features and
    reference from the target), stacked and moved to `dev` before any step is timed."""
    out = []
    for b in range(sz["batches"]):
        seqs = [_batch(model, cfg.target_layer_ids, sz["seq_len"], sz["anchors"], seed=b * sz["batch"] + i)
                for i in range(sz["batch"])]
        out.append({k: torch.cat([s[k] for s in seqs]).to(dev) for k in seqs[0]})
    return out


def train_throughput(model, cfg, sz: dict) -> dict:
    """`dlite.train.loop.train_loop` with the plain engine (AdamW, bf16 drafter) over the
    pre-made batches: samples/s of the steps after the first (warm-up) one."""
    dev = next(model.parameters()).device
    with torch.no_grad():
        batches = _batches(model, cfg, sz, dev)
    ids = {"input_ids": batches[0]["input_ids"].cpu()}  # the draft vocabulary's token counts
    engine = PlainEngine(_drafter(cfg, model, ids, torch.bfloat16).to(dev), lr=LR, weight_decay=0.0, grad_clip=1.0)
    logs = []
    last = train_loop(engine, itertools.cycle(batches), LoopConfig(steps=sz["train_steps"], lr=LR),
                      log=lambda step, m: logs.append(m))
    steps = [m["step_s"] for m in logs[1:]] or [logs[0]["step_s"]]
    return {"steps": sz["train_steps"], "batch": sz["batch"], "seq_len": sz["seq_len"], "anchors": sz["anchors"],
            "slot_rows": sz["batch"] * sz["anchors"] * cfg.gamma, "samples_per_s": last["samples_per_s_avg"],
            "tokens_per_s": sz["batch"] * sz["seq_len"] / statistics.median(steps),
            "step_s_median": statistics.median(steps), "loss_first": logs[0]["loss"], "loss_last": last["loss"],
            "peak_gpu_bytes": last.get("peak_gpu_bytes"), "data": "batches made on the device before the steps"}


def _env(dev) -> dict:
    """Versions and the device; `third_party_modules` lists every non-stdlib top-level
    module this process imported, the proof that the check ran on torch alone."""
    mods = {m.split(".")[0] for m in sys.modules} - set(sys.stdlib_module_names) - {"dlite", "__main__"}
    return {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
            "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else f"cpu ({os.cpu_count()} cores)",
            "torch_threads": torch.get_num_threads(), "platform": platform.platform(),
            "third_party_modules": sorted(m for m in mods if not m.startswith("_"))}


def _setup(smoke: bool, layers):
    """(drafter config, target shape, sizes, layer map) for the full or the smoke size;
    a cut target gets the drafter's layer ids mapped by relative depth."""
    sz = SMOKE if smoke else FULL
    layers = layers or sz["layers"]
    base = load_drafter_yaml(CONFIG_DIR / "dlite_qwen3_4b.yaml")
    used = map_layer_ids(base.target_layer_ids, QWEN3_4B_LAYERS, layers)
    cfg = dataclasses.replace(base, **sz["drafter"], target_layer_ids=used)
    shape = {**QWEN3_4B, **sz["target"], "num_hidden_layers": layers}
    layer_map = {"configured": list(base.target_layer_ids), "of_layers": QWEN3_4B_LAYERS, "used": used,
                 "layers_here": layers, "full_depth": layers == QWEN3_4B_LAYERS}
    return cfg, shape, sz, layer_map


def _lossless_both(model, cfg, sz) -> dict:
    """bf16 first (up to ties), then the same weights cast to fp32 (strict)."""
    low = lossless(model, cfg, sz)
    return {"bfloat16": low, "float32": lossless(model.float(), cfg, sz)}


def run(smoke=None, layers=None, device=None, budget_s: float = BUDGET_S) -> dict:
    """The whole check; `smoke` None: smoke exactly when there is no CUDA device."""
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    smoke = dev.type != "cuda" if smoke is None else smoke
    before = torch.get_num_threads()
    # On CPU one thread: toy ops on shared cores run 5-10x slower with spinning OpenMP
    # workers (draft_cost's note); a GPU run keeps torch's host threads.
    torch.set_num_threads(1 if dev.type == "cpu" else before)
    try:
        return _check(dev, smoke, layers, budget_s)
    finally:
        torch.set_num_threads(before)


def _target_info(model, shape: dict, layer_map: dict) -> dict:
    n = layer_map["layers_here"]
    depth = ("full depth" if layer_map["full_depth"] else
             f"CUT to {n} of {QWEN3_4B_LAYERS} layers (--layers): steps are ~{n}/{QWEN3_4B_LAYERS} of the "
             f"full target's; the drafter's layer ids are mapped by relative depth (layer_map)")
    return {"implementation": "dlite.bench.qwen3 (plain torch, eager)", "dtype": "bfloat16", "depth": depth,
            "init_std": shape.get("initializer_range", 0.02), "shape": shape, "layer_map": layer_map,
            "params": None if model is None else sum(p.numel() for p in model.parameters())}


def _check(dev, smoke: bool, layers, budget_s: float) -> dict:
    cfg, shape, sz, layer_map = _setup(smoke, layers)
    ck = _Check(dev, budget_s)
    model = ck.run("build_target", lambda: qwen3.build(shape, dev, torch.bfloat16))
    timing = ck.run("target_and_drafts", lambda: target_and_drafts(model, cfg, sz)) or {}
    train = ck.run("train_loop", lambda: train_throughput(model, cfg, sz))
    loss = ck.run("loss_memory", lambda: loss_peak(cfg, shape, sz, dev))
    info = _target_info(model, shape, layer_map)  # before the lossless phase casts it to fp32
    exact = ck.run("lossless", lambda: _lossless_both(model, cfg, sz)) or {}
    strict = exact.get("float32", {})
    ok = bool(strict) and all(strict[d]["lossless"] for d in ("dlite", "target_as_drafter"))
    total = round(time.perf_counter() - ck.t0, 3)
    return {"kind": "torch-only device check (random weights: speed, memory, losslessness; not quality)",
            "smoke": smoke, "env": _env(dev),
            "budget": {"seconds_budget": budget_s, "seconds_total": total, "within_budget": total <= budget_s,
                       "seconds": ck.seconds},
            "target": info, "drafter": dataclasses.asdict(cfg), **timing, "lossless": ok,
            "lossless_detail": exact, "loss_memory": loss, "train": train, "gpu_peak_bytes": ck.gpu_peak,
            "rss_peak_bytes": ck.rss_peak, "errors": ck.errors}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m dlite.bench.device", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="device_check.json", help="the JSON report")
    p.add_argument("--smoke", action="store_true", help="toy size (the default without CUDA)")
    p.add_argument("--layers", type=int, help=f"target depth (default {QWEN3_4B_LAYERS}: full)")
    p.add_argument("--device", help="cuda / cpu (default: cuda when available)")
    a = p.parse_args(argv)
    report = run(smoke=True if a.smoke else None, layers=a.layers, device=a.device)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(report, indent=2, default=str))
    print(json.dumps({k: report[k] for k in ("lossless", "target_decode_ms", "target_verify_ms", "budget",
                                             "errors") if k in report}, indent=2, default=str))
    return 0 if report["lossless"] and not report["errors"] else 1


if __name__ == "__main__":
    sys.exit(main())
