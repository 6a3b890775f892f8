"""Shape rehearsal on CPU: a production DLite drafter for Qwen3-4B (`drafter`: by default
configs/drafter/dlite_qwen3_4b.yaml, this project's design: 5 layers x 2560, ~0.56B
trainable parameters, draft vocabulary 32768 of 151936, gamma 7; or
dlite_v1_qwen3_4b.yaml, the released drafter's design and shape, 0.58B, 7 context
slots, full vocabulary, its target cut to 7 layers; or the Qwen3-8B yamls, against
Qwen3-8B's shape) taken once through every code path it meets in production, in bf16,
against a random-weight target of its Qwen3's shape cut to `layers` decoder layers
(built from a Qwen3Config, nothing downloaded):
feature capture (`dlite.data.features`), one optimiser step of the real training math
(`dlite.train.step.compute_loss` + the plain engine's AdamW, `dlite.train.optim`), one
speculative round (`dlite.decoding.decode.speculative_generate`: prefill, capture,
`drafter.draft`, verification), and the artifact round trip (`dlite.export`, bitwise).
Each phase's wall time and peak RSS (VmHWM, reset between phases where the kernel
allows) are recorded, with the parameter / gradient / optimizer bytes arithmetic.

What it proves: the shapes, dtypes and code paths of the 4B drafter fit together (no
dtype or shape error anywhere from capture to reload), the loss is finite, the
artifact round-trips exactly, and how much host memory and time one step takes here.
What it does not: anything about quality (random weights, random tokens), GPU memory
or speed, DeepSpeed's mixed-precision state (fp32 master weights; given as arithmetic
only), or the real feature statistics -- the target has `layers` of 36 layers, so the
drafter's target_layer_ids [1, 9, 17, 25, 33] are mapped by relative depth onto the
layers present (reported as `layer_map`); the feature width (5 x 2560) is unchanged."""

import dataclasses
import statistics
import tempfile
import time
from pathlib import Path

import torch

from dlite.bench.draft_cost import CONFIG_DIR, load_drafter_yaml
from dlite.data.anchors import sample_anchors
from dlite.data.draft_vocab import build_draft_vocab
from dlite.data.features import TargetFeatures
from dlite.decoding.decode import speculative_generate
from dlite.envinfo import env_info
from dlite.export import load_drafter, save_drafter
from dlite.models import build_drafter, param_count
from dlite.train.optim import PlainEngine
from dlite.train.step import compute_loss

# Qwen3-4B's published shape (config.json of Qwen/Qwen3-4B); `layers` replaces its 36.
QWEN3_4B = dict(vocab_size=151936, hidden_size=2560, intermediate_size=9728, num_attention_heads=32,
                num_key_value_heads=8, head_dim=128, tie_word_embeddings=True, rms_norm_eps=1e-6,
                max_position_embeddings=40960, rope_parameters={"rope_type": "default", "rope_theta": 1e6})
QWEN3_4B_LAYERS = 36
# Qwen3-8B's (config.json of Qwen/Qwen3-8B): wider, 36 layers too, and its lm_head is a
# matrix of its own (untied), which the rehearsal's memory then counts.
QWEN3_8B = {**QWEN3_4B, "hidden_size": 4096, "intermediate_size": 12288, "tie_word_embeddings": False}
# Both designs run their backbone at the target's width, so a production drafter yaml
# names its target by its hidden size.
QWEN3_BY_WIDTH = {2560: QWEN3_4B, 4096: QWEN3_8B}


def target_shape_for(cfg) -> dict:
    """The Qwen3 target a production drafter config is rehearsed against (by its width)."""
    if cfg.hidden_size not in QWEN3_BY_WIDTH:
        raise ValueError(f"shape rehearsal: no Qwen3 target of hidden size {cfg.hidden_size} "
                         f"(drafter.hidden_size); known: {sorted(QWEN3_BY_WIDTH)}")
    return QWEN3_BY_WIDTH[cfg.hidden_size]


def _hwm() -> int:
    """Peak resident set size of this process so far (VmHWM), in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return -1


def _reset_hwm() -> bool:
    """Reset VmHWM to the current RSS (Linux: '5' > clear_refs), so each phase's peak is
    its own; False where the kernel refuses, and peaks are then cumulative."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


class _Phases:
    """Wall seconds and peak RSS per named phase."""

    def __init__(self):
        self.seconds, self.rss_peak, self.resets = {}, {}, True

    def run(self, name, fn):
        self.resets = _reset_hwm() and self.resets
        t0 = time.perf_counter()
        out = fn()
        self.seconds[name] = round(time.perf_counter() - t0, 3)
        self.rss_peak[name] = _hwm()
        return out


def map_layer_ids(ids, source_layers: int, layers: int) -> list:
    """Layer i of a `source_layers`-deep target -> the layer at the same relative depth
    of a `layers`-deep one (ids may repeat: each keeps its slot of the feature)."""
    return [round(i * (layers - 1) / max(1, source_layers - 1)) for i in ids]


def build_target(config, dtype):
    """A random-weight causal LM from an HF config, in `dtype`, with the few-row linears
    `dlite.target.load_model` installs (bf16 falls back to F.linear)."""
    from transformers import AutoModelForCausalLM
    from dlite import few_rows
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    few_rows.install(model)
    return model


def _batch(model, layer_ids, seq_len: int, anchors: int, seed: int) -> dict:
    """One training sequence as `collate` makes it: random tokens, every position
    supervised, `anchors` sampled anchors, features and reference hidden states from
    the target, held as float32 (collate's dtype)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, model.config.vocab_size, (1, seq_len), generator=g)
    mask = torch.ones(1, seq_len, dtype=torch.long)
    feats, final = TargetFeatures(model, layer_ids)(ids, mask)
    a = torch.as_tensor(sample_anchors(mask[0].numpy(), anchors, seed), dtype=torch.long)[None]
    return {"input_ids": ids, "loss_mask": mask.bool(), "anchors": a,
            "anchor_mask": torch.ones_like(a, dtype=torch.bool),
            "features": feats.float(), "ref_hidden": final.float()}


def _drafter(cfg, model, batch, dtype):
    """Built as the train stage builds it (fp32 weights around the target's frozen
    vocabulary), then cast as DeepSpeed's bf16 mode casts it. MASK: the last row, an
    unused padding row in Qwen3's 151936-row embedding. Draft vocabulary: the real
    `build_draft_vocab` over this sequence's tokens (then the lowest ids)."""
    V = model.config.vocab_size
    ids = None
    if cfg.draft_vocab_size:
        counts = torch.bincount(batch["input_ids"].reshape(-1), minlength=V).numpy()
        ids = build_draft_vocab(counts, cfg.draft_vocab_size)
    embed, lm_head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    parts = {"final_norm_weight": model.model.norm.weight.detach()} if cfg.arch == "dlite_v1" else {}
    torch.manual_seed(0)
    return build_drafter(cfg, embed.detach(), lm_head.detach(), V - 1, ids, **parts).to(dtype)


def _train_step(engine, batch) -> dict:
    """One forward + backward + AdamW step (the plain engine: clip, step, zero grads)."""
    model = engine.module.train()
    t0 = time.perf_counter()
    loss, m = compute_loss(model, batch)
    t1 = time.perf_counter()
    engine.backward(loss)
    t2 = time.perf_counter()
    grads = sum(p.grad.numel() * p.grad.element_size() for p in model.parameters() if p.grad is not None)
    stepped = engine.step()
    t3 = time.perf_counter()
    opt_bytes = sum(t.numel() * t.element_size() for s in engine.optimizer.state.values()
                    for k, t in s.items() if k != "step")  # the moments; `step` is a scalar
    return {"loss": loss.item(), "finite": bool(torch.isfinite(loss)), "stepped": stepped,
            "tau_est": m["tau_est"], "forward_s": round(t1 - t0, 3), "backward_s": round(t2 - t1, 3),
            "optimizer_step_s": round(t3 - t2, 3), "grad_bytes": grads, "optimizer_state_bytes": opt_bytes}


def _draft_round(model, drafter, prompt, feat, warm: int = 3) -> dict:
    """One speculative round as the decoding loop runs it (prefill + capture, draft,
    verify), then `warm` more drafts from the feature row `feat` [1, K*H], timed alone
    (the first draft pays one-time kernel set-up)."""
    drafter.eval()
    out, rounds = speculative_generate(model, drafter, prompt, max_new_tokens=2)
    r = rounds[0]
    times = []
    for _ in range(warm):
        t0 = time.perf_counter()
        tokens, _, _ = drafter.draft(None, feat, out[0], len(prompt), 0.0)
        times.append((time.perf_counter() - t0) * 1e3)
    V = model.config.vocab_size
    return {"tokens": out, "drafted": r["drafted"], "accepted": r["accepted"],
            "valid_ids": all(0 <= t < V for t in out + tokens.tolist()),
            "draft_ms_first": round(r["draft_ms"], 2), "verify_ms": round(r["verify_ms"], 2),
            "draft_ms_warm_median": round(statistics.median(times), 2)}


def _round_trip(model, drafter) -> dict:
    """Export, reload around the target's vocabulary, compare every tensor bitwise."""
    with tempfile.TemporaryDirectory(prefix="dlite-rehearsal-") as d:
        t0 = time.perf_counter()
        save_drafter(drafter, d, {"target_dtype": str(model.dtype).replace("torch.", ""),
                                  "rehearsal": True})
        t1 = time.perf_counter()
        size = (Path(d) / "model.safetensors").stat().st_size
        loaded = load_drafter(d, model.get_input_embeddings().weight.detach(),
                              model.get_output_embeddings().weight.detach())
        t2 = time.perf_counter()
    want, got = drafter.state_dict(), loaded.state_dict()
    equal = want.keys() == got.keys() and all(
        torch.equal(want[k], got[k]) and want[k].dtype == got[k].dtype for k in want)
    return {"bitwise_equal": equal, "dtypes": sorted({str(v.dtype) for v in got.values()}),
            "safetensors_bytes": size, "save_s": round(t1 - t0, 3), "load_s": round(t2 - t1, 3)}


def memory_arithmetic(n_params: int, dtype) -> dict:
    """Bytes of the drafter's training state, by arithmetic. `here`: plain torch AdamW on
    bf16 weights (weights, grads, exp_avg, exp_avg_sq all in the weights' dtype).
    `deepspeed_bf16`: bf16 weights and grads + fp32 master weights and fp32 Adam moments
    (16 B/param), and per rank under ZeRO-2 on `world` ranks (weights replicated, the
    rest partitioned). Activations and the frozen vocabulary are not included."""
    b = torch.tensor([], dtype=dtype).element_size()
    out = {"params": n_params, "weights": n_params * b, "grads": n_params * b,
           "adamw_states_here": 2 * n_params * b, "total_here": 4 * n_params * b,
           "deepspeed_bf16_unpartitioned": 16 * n_params}
    for world in (8, 16):
        out[f"deepspeed_bf16_zero2_per_rank_world{world}"] = int(n_params * (2 + 14 / world))
    return out


def run(seq_len: int = 512, anchors: int = 64, layers: int = 2, dtype=torch.bfloat16,
        threads: int = 2, drafter_cfg=None, target_shape: dict = None,
        source_layers: int = QWEN3_4B_LAYERS, seed: int = 0, drafter: str = "dlite_qwen3_4b") -> dict:
    """The rehearsal (see the module docstring); returns the report dict. `drafter_cfg`
    (a DrafterConfig; default configs/drafter/<drafter>.yaml) and `target_shape`
    (Qwen3Config fields over QWEN3_4B; default the drafter's Qwen3 by its width,
    `target_shape_for`) shrink it for tests; the code path is the
    same. The published design (`dlite_v1_qwen3_4b`) reads its fixed selection of K
    layers (first, last, evenly spaced), so its target keeps at least K layers and the
    selection is taken again over those (`published_layer_ids`)."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        base = drafter_cfg or load_drafter_yaml(CONFIG_DIR / f"{drafter}.yaml")
        if base.arch == "dlite_v1":
            from dlite.models.dlite_v1 import published_layer_ids
            layers = max(layers, len(base.target_layer_ids))
            used = published_layer_ids(layers, len(base.target_layer_ids))
        else:
            used = map_layer_ids(base.target_layer_ids, source_layers, layers)
        cfg = dataclasses.replace(base, target_layer_ids=used)
        full = QWEN3_4B if target_shape else target_shape_for(base)
        shape = {**full, **(target_shape or {}), "num_hidden_layers": layers}
        return _rehearse(cfg, base, shape, used, source_layers, seq_len, anchors, dtype, seed)
    finally:
        torch.set_num_threads(before)


def _rehearse(cfg, base, shape, used, source_layers, seq_len, anchors, dtype, seed) -> dict:
    from transformers import Qwen3Config
    ph, tcfg = _Phases(), Qwen3Config(**shape)
    model = ph.run("build_target", lambda: build_target(tcfg, dtype))
    with torch.no_grad():
        batch = ph.run("capture_features", lambda: _batch(model, used, seq_len, anchors, seed))
    drafter = ph.run("build_drafter", lambda: _drafter(cfg, model, batch, dtype))
    engine = PlainEngine(drafter, lr=6e-4, weight_decay=0.0, grad_clip=1.0)
    train = ph.run("train_step", lambda: _train_step(engine, batch))
    engine.optimizer.state.clear()  # the step is done: free AdamW's moments before decoding
    feat = batch["features"][0, -1:].to(dtype)
    draft = ph.run("draft_round", lambda: _draft_round(model, drafter, batch["input_ids"][0].tolist(), feat))
    export = ph.run("export_reload", lambda: _round_trip(model, drafter))
    n = param_count(drafter)
    return {
        "kind": "shape rehearsal on CPU (random weights: shapes, dtypes, memory and time, not quality)",
        "shapes": {"target": shape,
                   "drafter": dataclasses.asdict(cfg), "seq_len": seq_len, "anchors": anchors,
                   "anchors_sampled": int(batch["anchors"].shape[1]), "dtype": str(dtype)},
        "layer_map": {"configured": list(base.target_layer_ids), "of_layers": source_layers,
                      "used": used, "of_layers_here": shape["num_hidden_layers"],
                      "how": ("the published selection over the layers present" if base.arch == "dlite_v1"
                              else "same relative depth") + "; feature width unchanged"},
        "params": {"drafter_trainable": n, "target": sum(p.numel() for p in model.parameters()),
                   "vocab_shared_with_target": drafter.vocab.embed_weight.data_ptr()
                   == model.get_input_embeddings().weight.data_ptr()},
        "memory_arithmetic_bytes": memory_arithmetic(n, dtype),
        "rss_peak_bytes": ph.rss_peak, "rss_peak_max_bytes": max(ph.rss_peak.values()),
        "rss_peak_per_phase": ph.resets, "seconds": ph.seconds,
        "seconds_total": round(sum(ph.seconds.values()), 3),
        "train": train, "draft": draft, "export": export, "env": env_info(),
    }
