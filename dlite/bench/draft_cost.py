"""Drafter cost against context length (DLITE.md §4: `draft_ms(L)`, `draft_cache_bytes(L)`).

DLite and the DSpark-style baseline are built from the same DrafterConfig with random
weights (cost does not depend on training), fed random features of the right shape,
and timed in the same process, interleaved round by round and across context lengths
(order rotated every round), so machine noise hits both alike. A DSpark request is
first prefilled with L positions (not timed); each timed round then extends it with
`new_per_round` verified positions and drafts one block -- the work a real round does.
Also reports the trainable parameter counts of the Qwen3-4B/8B-shaped DLite configs,
computed on the meta device."""

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
PUBLISHED = {"dlite_qwen3_4b": (2560, 151936, "~0.6B"), "dlite_qwen3_8b": (4096, 151936, "~1B")}


def load_drafter_yaml(path) -> DrafterConfig:
    """A configs/drafter/*.yaml file (its `drafter:` section, or the bare fields)."""
    raw = yaml.safe_load(Path(path).read_text())
    return DrafterConfig(**raw.get("drafter", raw))


def param_counts(config_dir=CONFIG_DIR) -> dict:
    """Trainable parameters of the published-shape DLite drafters, built on `meta`."""
    out = {}
    for name, (hidden, vocab, published) in PUBLISHED.items():
        cfg = load_drafter_yaml(Path(config_dir) / f"{name}.yaml")
        with torch.device("meta"):
            vocab_w = torch.empty(vocab, hidden)
            n = param_count(build_drafter(cfg, vocab_w, vocab_w, vocab - 1))
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


def _models(drafter_cfg, target_hidden, vocab, device, dtype):
    gen = torch.Generator().manual_seed(0)
    embed = (torch.randn(vocab, target_hidden, generator=gen) * 0.02).to(device, dtype)
    lm_head = (torch.randn(vocab, target_hidden, generator=gen) * 0.02).to(device, dtype)
    return {arch: build_drafter(dataclasses.replace(drafter_cfg, arch=arch), embed, lm_head,
                                vocab - 1).to(device, dtype).eval()
            for arch in ("dlite", "dspark")}


def run(drafter_cfg: DrafterConfig, target_hidden: int, vocab: int,
        context_lengths=(256, 1024, 4096, 16384), rounds: int = 20, warmup: int = 3,
        new_per_round: int = 4, device: str = "cpu", dtype=torch.float32,
        threads: int = None) -> dict:
    """Median per-round draft_ms and cache bytes per request, per model and length.
    `threads` pins torch's CPU threads: on a shared machine one thread is the stable
    choice (spinning OpenMP workers on busy cores inflate tiny ops 5-10x)."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads or before)
    try:
        return _run(drafter_cfg, target_hidden, vocab, tuple(context_lengths), rounds, warmup,
                    new_per_round, torch.device(device), dtype)
    finally:
        torch.set_num_threads(before)


def _run(drafter_cfg, target_hidden, vocab, context_lengths, rounds, warmup, new_per_round,
         dev, dtype) -> dict:
    models = _models(drafter_cfg, target_hidden, vocab, dev, dtype)
    fdim = len(drafter_cfg.target_layer_ids) * target_hidden
    state, pos = {}, {}
    with torch.no_grad():
        for L in context_lengths:      # the prompt: prefill, not timed
            state[L] = {a: m.new_state() for a, m in models.items()}
            prompt = torch.randn(L, fdim, device=dev, dtype=dtype)
            for a, m in models.items():
                _, _, state[L][a] = m.draft(state[L][a], prompt, 1, L, 0.0)
            pos[L] = L
    times = {a: {L: [] for L in context_lengths} for a in models}
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
    return _report(models, state, times, context_lengths, drafter_cfg, target_hidden, vocab,
                   rounds, new_per_round, dev, dtype)


def _report(models, state, times, lengths, cfg, target_hidden, vocab, rounds, new_per_round,
            dev, dtype) -> dict:
    ms = {a: {str(L): round(statistics.median(times[a][L]), 4) for L in lengths} for a in models}
    cache = {a: {str(L): models[a].cache_bytes(state[L][a]) for L in lengths} for a in models}
    lo, hi = str(lengths[0]), str(lengths[-1])
    ratio = {a: round(ms[a][hi] / ms[a][lo], 3) for a in models}
    checks = {"dlite_ms_ratio_ok": ratio["dlite"] <= 1.10,
              "dlite_cache_constant": len(set(cache["dlite"].values())) == 1,
              "dspark_ms_grows": ratio["dspark"] > 1.0,
              "dspark_cache_grows": cache["dspark"][hi] > cache["dspark"][lo]}
    return {"draft_ms": ms, "draft_cache_bytes": cache, "draft_ms_ratio_last_over_first": ratio,
            "checks": checks, "param_counts": param_counts(),
            "config": {"drafter": dataclasses.asdict(cfg), "target_hidden": target_hidden,
                       "vocab": vocab, "context_lengths": list(lengths), "rounds": rounds,
                       "new_per_round": new_per_round, "dtype": str(dtype)},
            "env": {"torch": torch.__version__, "python": platform.python_version(),
                    "device": (torch.cuda.get_device_name(dev) if dev.type == "cuda"
                               else platform.processor() or "cpu"),
                    "threads": torch.get_num_threads()}}


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
