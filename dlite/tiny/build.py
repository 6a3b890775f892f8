"""Builds the embedded default target from nothing: generate the built-in corpus, train
the tokenizer, train a tiny `Qwen3ForCausalLM` (transformers' own class, so the same
code path as Qwen3-4B/8B) until it copies, measure it on held-out trajectories, and
save tokenizer + model + info.json. Deterministic for a given seed and Python version.

    python -m dlite.tiny build [--steps N] [--out DIR]
"""

import json
import math
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from dlite.corpus import trajectories as corpus
from dlite.tiny.copyeval import evaluate, repeated_random
from dlite.tiny.tokenizer import SPECIAL_TOKENS, render, train_tokenizer


@dataclass
class TargetSpec:
    seed: int = 0
    vocab_size: int = 4096
    hidden_size: int = 128
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 32
    intermediate_size: int = 384
    rope_theta: float = 10000.0
    # Phase 1 forms the induction (copy) circuit on repeated random sequences only:
    # short rows, many per batch, a high constant lr. Measured here: at width 192 with
    # few long rows, or at 4 layers, it had not formed after 300 steps; 2 layers of
    # width 128 formed it in ~150.
    induction_max_steps: int = 500
    induction_batch: int = 16
    induction_half: int = 64
    induction_lr: float = 3e-3
    # Phase 2 learns the corpus; half the rows stay repeated-random so copying survives.
    # Measured here: at lr 2e-3 with one synthetic row in four, the copy circuit was
    # gone 100 steps into phase 2 (repeat probe 0.0, copy acc 0.33 at step 200).
    seq_len: int = 1024
    batch_size: int = 4
    steps: int = 500
    lr: float = 1e-3
    warmup: int = 50
    synth_frac: float = 0.5
    n_train: int = 1500
    n_heldout: int = 64
    min_chars: int = 3000
    max_chars: int = 14000
    eval_every: int = 100


def qwen3_config(spec: TargetSpec):
    from transformers import Qwen3Config
    return Qwen3Config(
        vocab_size=spec.vocab_size, hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size, num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads, num_key_value_heads=spec.num_kv_heads,
        head_dim=spec.head_dim, rope_theta=spec.rope_theta, max_position_embeddings=32768,
        tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=0)


def _encode_split(tok, split: str, spec: TargetSpec) -> list[list[int]]:
    n = spec.n_train if split == "train" else spec.n_heldout
    recs = corpus.generate(split, n, spec.seed, spec.min_chars, spec.max_chars)
    return [tok(render(tok, r))["input_ids"] for r in recs]


def _window(rng: random.Random, seq: list[int], n: int, pad: int) -> list[int]:
    if len(seq) <= n:
        return seq + [pad] * (n - len(seq))
    # Start at 0 a quarter of the time so the model also sees system prompts and tools.
    start = 0 if rng.random() < 0.25 else rng.randrange(len(seq) - n + 1)
    return seq[start:start + n]


def _batch(rng, gen, seqs, spec: TargetSpec, step: int) -> torch.Tensor:
    n_synth = round(spec.batch_size * spec.synth_frac)
    rows = [_window(rng, rng.choice(seqs), spec.seq_len, 0) for _ in range(spec.batch_size - n_synth)]
    x = torch.tensor(rows, dtype=torch.long).reshape(-1, spec.seq_len)
    if n_synth:
        half = rng.choice([16, 32, 64, 128])
        reps = repeated_random(gen, n_synth * (spec.seq_len // (2 * half)), half, len(SPECIAL_TOKENS), spec.vocab_size)
        x = torch.cat([x, reps.reshape(n_synth, -1)[:, :spec.seq_len]])
    return x


def _lr(spec: TargetSpec, step: int) -> float:
    if step < spec.warmup:
        return spec.lr * (step + 1) / spec.warmup
    prog = (step - spec.warmup) / max(1, spec.steps - spec.warmup)
    return spec.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * prog)))


def _heldout_windows(seqs, n: int):
    """Fixed eval windows: the last n tokens of each held-out trajectory, where the
    edits, re-reads and test output (the copying) of an agent run accumulate."""
    return [s[-n:] for s in seqs if len(s) >= n]


def _step(model, opt, x, lr: float) -> float:
    loss = model(input_ids=x, labels=x.masked_fill(x == 0, -100)).loss
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    for g in opt.param_groups:
        g["lr"] = lr
    opt.step()
    return loss.item()


def form_induction(model, opt, spec: TargetSpec, gen, log) -> int:
    """Phase 1: repeated random sequences until the second halves are copied (>0.9)."""
    half, lo = spec.induction_half, len(SPECIAL_TOKENS)
    for step in range(spec.induction_max_steps):
        x = repeated_random(gen, spec.induction_batch, half, lo, spec.vocab_size)
        model.train()
        loss = _step(model, opt, x, spec.induction_lr)
        if step % 25 == 0:
            with torch.no_grad():
                model.eval()
                probe = repeated_random(gen, 8, half, lo, spec.vocab_size)
                acc = (model(input_ids=probe).logits[:, half:-1].argmax(-1) == probe[:, half + 1:]).float().mean().item()
            log(json.dumps({"phase": "induction", "step": step, "loss": round(loss, 4), "repeat_acc": round(acc, 4)}))
            if acc > 0.9:
                return step + 1
    return spec.induction_max_steps


def heldout_set(tok, spec: TargetSpec):
    """(windows, copy-count starts, repeat probe): exactly what info.json's figures are
    measured on, so anyone can re-measure the shipped target (tests/unit/test_tiny.py)."""
    wins = _heldout_windows(_encode_split(tok, "heldout", spec), spec.seq_len)
    probe = repeated_random(torch.Generator().manual_seed(spec.seed + 7), 16, 128,
                            len(SPECIAL_TOKENS), spec.vocab_size)
    return wins, [0] * len(wins), probe


def train(model, seqs, spec: TargetSpec, eval_fn, log=print):
    rng, gen = random.Random(spec.seed), torch.Generator().manual_seed(spec.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=spec.lr, betas=(0.9, 0.95), weight_decay=0.01)
    t0 = time.time()
    n_ind = form_induction(model, opt, spec, gen, log)
    for step in range(spec.steps):
        model.train()
        loss = _step(model, opt, _batch(rng, gen, seqs, spec, step), _lr(spec, step))
        if step % spec.eval_every == 0 or step == spec.steps - 1:
            log(json.dumps({"phase": "corpus", "step": step, "loss": round(loss, 4),
                            "elapsed_s": round(time.time() - t0), **eval_fn(model)}))
    return time.time() - t0, n_ind


def build(out_dir: Path, spec: TargetSpec, log=print) -> dict:
    """Full deterministic build; writes tokenizer/, target/ and info.json under out_dir."""
    from transformers import AutoModelForCausalLM, Qwen3ForCausalLM
    torch.manual_seed(spec.seed)
    t0 = time.time()
    out_dir = Path(out_dir)
    texts = (render_plain(r) for r in corpus.generate("train", 400, spec.seed + 1, spec.min_chars, spec.max_chars))
    tok = train_tokenizer(texts, spec.vocab_size, out_dir / "tokenizer")
    train_seqs = _encode_split(tok, "train", spec)
    wins, starts, probe = heldout_set(tok, spec)
    model = Qwen3ForCausalLM(qwen3_config(spec))
    log(f"corpus: {len(train_seqs)} train trajectories, {len(wins)} held-out windows, "
        f"{sum(map(len, train_seqs))} train tokens; model {model.num_parameters()} params")
    train_s, n_ind = train(model, train_seqs, spec, lambda m: evaluate(m, wins[:16], starts[:16], probe[:8]), log)
    # Stored in fp16 to stay small; measured after reloading exactly what is shipped.
    model.to(torch.float16).save_pretrained(out_dir / "target")
    shipped = AutoModelForCausalLM.from_pretrained(out_dir / "target", dtype=torch.float32)
    metrics = evaluate(shipped, wins, starts, probe)
    info = {"n_params": shipped.num_parameters(), "vocab_size": spec.vocab_size,
            **metrics, "heldout_windows": len(wins), "window_tokens": spec.seq_len,
            "train_s": round(train_s), "induction_steps": n_ind, "build_s": round(time.time() - t0),
            "torch": torch.__version__, "spec": asdict(spec)}
    (out_dir / "info.json").write_text(json.dumps(info, indent=2) + "\n")
    return info


def render_plain(record: dict) -> str:
    """Text for tokenizer training: message contents and tool-call arguments (the chat
    markup is made of special tokens and needs no merges)."""
    parts = [json.dumps(record.get("tools") or [])]
    for m in record["messages"]:
        parts.append(m.get("content") or "")
        for tc in m.get("tool_calls") or []:
            parts.append(json.dumps(tc["function"]["arguments"]))
    return "\n".join(parts)
