"""Drafter cost against context length (DLITE.md §4: `draft_ms(L)`, `draft_cache_bytes(L)`).

DLite and the DSpark-style baseline are built from the same DrafterConfig with random
weights (cost does not depend on training), fed random features of the right shape,
and timed in the same process, interleaved round by round and across context lengths
(order rotated every round), so machine noise hits both alike. A DSpark request is
first prefilled with L positions (not timed); each timed round then extends it with
`new_per_round` verified positions and drafts one block -- the work a real round does.
Also reports the trainable parameter counts of the Qwen3-4B/8B-shaped DLite configs,
computed on the meta device.

Draft vocabulary (issue 20): with `draft_vocab_sizes` both drafters are also timed
projecting onto N of the V tokens (`dlite@N`, `dspark@N`); with `target_config` (an HF
config) one plain decode step of a random-weight target of those dimensions is timed
at the same context lengths, interleaved with the drafts, and `draft_over_target` is
the ratio. `traffic_arithmetic` adds the bytes a round reads for Qwen3-4B/8B: plain
arithmetic from published shapes, not a measurement."""

import dataclasses
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import yaml

from dlite.models import build_drafter, param_count
from dlite.models.config import DrafterConfig

CONFIG_DIR = Path(__file__).resolve().parents[2] / "configs" / "drafter"
# (config file, target hidden size, vocabulary, published drafter size)
PUBLISHED = {"dlite_qwen3_4b": (2560, 151936, "~0.6B"), "dlite_qwen3_8b": (4096, 151936, "~1B"),
             "dlite_v1_qwen3_4b": (2560, 151936, "~0.6B"), "dlite_v1_qwen3_8b": (4096, 151936, "~1B")}


def load_drafter_yaml(path) -> DrafterConfig:
    """A configs/drafter/*.yaml file (its `drafter:` section, or the bare fields)."""
    raw = yaml.safe_load(Path(path).read_text())
    return DrafterConfig(**raw.get("drafter", raw))


def param_counts(config_dir=CONFIG_DIR) -> dict:
    """Trainable parameters of the published-shape DLite drafters (ours and the authors'
    design, `dlite_v1_*`), built on `meta`."""
    out = {}
    for name, (hidden, vocab, published) in PUBLISHED.items():
        cfg = load_drafter_yaml(Path(config_dir) / f"{name}.yaml")
        with torch.device("meta"):
            vocab_w = torch.empty(vocab, hidden)
            ids = torch.arange(cfg.draft_vocab_size, device="cpu") if cfg.draft_vocab_size else None
            parts = {"final_norm_weight": torch.empty(hidden)} if cfg.arch == "dlite_v1" else {}
            n = param_count(build_drafter(cfg, vocab_w, vocab_w, vocab - 1, draft_vocab=ids, **parts))
        out[name] = {"trainable_params": n, "billions": round(n / 1e9, 3), "published": published}
    return out


def _timed(fn, device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (time.perf_counter() - t0) * 1e3


def _models(drafter_cfg, target_hidden, vocab, device, dtype, draft_vocab_sizes=()):
    """Random-weight drafters, keyed `arch` (full vocabulary) and `arch@N` (N of V ids:
    which ids does not change the cost, so the lowest N)."""
    gen = torch.Generator().manual_seed(0)
    embed = (torch.randn(vocab, target_hidden, generator=gen) * 0.02).to(device, dtype)
    lm_head = (torch.randn(vocab, target_hidden, generator=gen) * 0.02).to(device, dtype)
    out = {}
    for n in (None, *draft_vocab_sizes):
        for arch in ("dlite", "dspark"):
            cfg = dataclasses.replace(drafter_cfg, arch=arch, draft_vocab_size=n)
            ids = None if n is None else torch.arange(n, device=device)
            out[arch if n is None else f"{arch}@{n}"] = build_drafter(
                cfg, embed, lm_head, vocab - 1, ids).to(device, dtype).eval()
    return out


class _TargetStep:
    """One plain decode step of a random-weight target at context L: prefilled once
    (not timed); each timed step decodes one token and crops the cache back to L, so
    every step sees the same context length."""

    def __init__(self, target_config, lengths, device, dtype):
        from transformers import AutoModelForCausalLM
        from dlite.decoding.decode import loop_cache, new_cache, target_forward
        torch.manual_seed(0)
        self.model = AutoModelForCausalLM.from_config(target_config).to(device, dtype).eval()
        self.forward, self.caches, self.dev = target_forward, {}, device
        V = target_config.vocab_size
        with torch.no_grad():
            for L in lengths:
                self.caches[L] = new_cache(self.model)
                target_forward(self.model, torch.randint(0, V, (L,), device=device), 0,
                               self.caches[L], logits_to_keep=1)
                # decoded as the loops decode: in place, no copy of the history per step
                self.caches[L] = loop_cache(self.caches[L], 1, copy_of=False)

    @torch.no_grad()
    def step(self, L: int) -> None:
        from dlite.decoding.decode import crop_cache
        self.forward(self.model, torch.tensor([1], device=self.dev), L, self.caches[L])
        crop_cache(self.caches[L], L)


def run(drafter_cfg: DrafterConfig, target_hidden: int, vocab: int,
        context_lengths=(256, 1024, 4096, 16384), rounds: int = 20, warmup: int = 3,
        new_per_round: int = 4, device: str = "cpu", dtype=torch.float32,
        threads: int = None, draft_vocab_sizes=(), target_config=None) -> dict:
    """Median per-round draft_ms and cache bytes per request, per model and length
    (plus `target_step_ms` and `draft_over_target` when `target_config` is given).
    `threads` pins torch's CPU threads: on a shared machine one thread is the stable
    choice (spinning OpenMP workers on busy cores inflate tiny ops 5-10x)."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads or before)
    try:
        dev = torch.device(device)
        models = _models(drafter_cfg, target_hidden, vocab, dev, dtype,
                         tuple(n for n in draft_vocab_sizes if n and n < vocab))
        target = _TargetStep(target_config, context_lengths, dev, dtype) if target_config else None
        return _run(models, target, drafter_cfg, target_hidden, vocab, tuple(context_lengths),
                    rounds, warmup, new_per_round, dev, dtype)
    finally:
        torch.set_num_threads(before)


def _run(models, target, drafter_cfg, target_hidden, vocab, context_lengths, rounds, warmup,
         new_per_round, dev, dtype) -> dict:
    fdim = len(drafter_cfg.target_layer_ids) * target_hidden
    state, pos = {}, {}
    with torch.no_grad():
        for L in context_lengths:      # the prompt: prefill, not timed
            state[L] = {a: m.new_state() for a, m in models.items()}
            prompt = torch.randn(L, fdim, device=dev, dtype=dtype)
            for a, m in models.items():
                _, _, state[L][a] = m.draft(state[L][a], prompt, 1, L, 0.0)
            pos[L] = L
    times = {a: {L: [] for L in context_lengths} for a in (*models, *(["target"] if target else []))}
    n = len(context_lengths)
    for r in range(warmup + rounds):
        # Rotate the length order and alternate the model order every round so no
        # (length, model) pair always runs right after the same neighbour.
        for L in context_lengths[r % n:] + context_lengths[:r % n]:
            feats = torch.randn(new_per_round, fdim, device=dev, dtype=dtype)
            pos[L] += new_per_round
            order = list(models) if r % 2 == 0 else list(models)[::-1]
            for a in order:
                def one(a=a):
                    state[L][a] = models[a].draft(state[L][a], feats, 1, pos[L], 0.0)[2]
                ms = _timed(one, dev)
                if r >= warmup:
                    times[a][L].append(ms)
            if target is not None:
                ms = _timed(lambda: target.step(L), dev)
                if r >= warmup:
                    times["target"][L].append(ms)
    return _report(models, state, times, context_lengths, drafter_cfg, target_hidden, vocab,
                   rounds, new_per_round, dev, dtype)


def _report(models, state, times, lengths, cfg, target_hidden, vocab, rounds, new_per_round,
            dev, dtype) -> dict:
    ms = {a: {str(L): round(statistics.median(times[a][L]), 4) for L in lengths} for a in models}
    extra = {}
    if "target" in times:
        step = {str(L): round(statistics.median(times["target"][L]), 4) for L in lengths}
        extra = {"target_step_ms": step, "draft_over_target": {
            a: {L: round(ms[a][L] / step[L], 3) for L in step} for a in models}}
    cache = {a: {str(L): models[a].cache_bytes(state[L][a]) for L in lengths} for a in models}
    lo, hi = str(lengths[0]), str(lengths[-1])
    ratio = {a: round(ms[a][hi] / ms[a][lo], 3) for a in models}
    checks = {"dlite_ms_ratio_ok": ratio["dlite"] <= 1.10,
              "dlite_cache_constant": len(set(cache["dlite"].values())) == 1,
              "dspark_ms_grows": ratio["dspark"] > 1.0,
              "dspark_cache_grows": cache["dspark"][hi] > cache["dspark"][lo]}
    return {"draft_ms": ms, "draft_cache_bytes": cache, "draft_ms_ratio_last_over_first": ratio,
            **extra, "checks": checks, "param_counts": param_counts(),
            "traffic_arithmetic": traffic_arithmetic(),
            "config": {"drafter": dataclasses.asdict(cfg), "target_hidden": target_hidden,
                       "vocab": vocab, "context_lengths": list(lengths), "rounds": rounds,
                       "new_per_round": new_per_round, "dtype": str(dtype)},
            "env": {"torch": torch.__version__, "python": platform.python_version(),
                    "device": (torch.cuda.get_device_name(dev) if dev.type == "cuda"
                               else platform.processor() or "cpu"),
                    "threads": torch.get_num_threads()}}


# Published Qwen3 shapes: (target parameters, hidden, vocabulary, KV bytes per token in
# bf16 = layers x 2 x kv_heads x head_dim x 2). Qwen3-4B ties its embeddings.
QWEN3 = {"qwen3_4b": (4.02e9, 2560, 151936, 36 * 2 * 8 * 128 * 2),
         "qwen3_8b": (8.19e9, 4096, 151936, 36 * 2 * 8 * 128 * 2)}


def traffic_arithmetic(gamma: int = 7, sizes=(16384, 32768), context: int = 32768) -> dict:
    """Bytes read per round in bf16 decoding (memory-bound): one target step (weights +
    its KV cache at `context`) vs one DLite round (drafter weights once + gamma
    sequential projections onto N lm_head rows), full vs draft vocabulary. ARITHMETIC
    from published shapes, not a measurement: it ignores activations, the small
    embedding reads and caches, which is why it is an estimate of the floor."""
    drafter = param_counts()
    out = {"kind": "arithmetic, not measured", "dtype": "bf16", "gamma": gamma, "context": context}
    for name, (params, hidden, vocab, kv_per_token) in QWEN3.items():
        target = params * 2 + kv_per_token * context
        weights = drafter[f"dlite_{name}"]["trainable_params"] * 2
        rounds = {str(n or vocab): weights + gamma * (n or vocab) * hidden * 2 for n in (None, *sizes)}
        out[name] = {"target_step_bytes": int(target), "dlite_weights_bytes": int(weights),
                     "dlite_round_bytes": {k: int(v) for k, v in rounds.items()},
                     "dlite_round_over_target_step": {k: round(v / target, 3) for k, v in rounds.items()}}
    return out


def main(out_path, drafter_cfg: DrafterConfig = None, target_hidden: int = 256, vocab: int = 2048,
         **kwargs) -> dict:
    """Run with a tiny default drafter and write the JSON report to out_path."""
    if drafter_cfg is None:
        drafter_cfg = DrafterConfig(hidden_size=256, num_layers=2, target_layer_ids=[0, 1, 2])
    report = run(drafter_cfg, target_hidden, vocab, **kwargs)
    Path(out_path).parent.mkdir(parents=True, exist_ok=True)
    Path(out_path).write_text(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1] if len(sys.argv) > 1 else "draft_cost.json"), indent=2))
