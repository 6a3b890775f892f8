"""Peak memory of the training loss at Qwen3-4B scale (issue 16): the one-shot loss
(`dlite_loss_unchunked` on a whole p_ref, as compute_loss did before) against the
chunked `dlite_loss`, measured on CPU at reduced slot-row counts and extrapolated to
the production batch B=4, A=512, γ=7 (14336 slot rows).

What runs: one loss forward + backward on random inputs of production widths -- drafter
logits [rows, N] (bf16, requiring grad), target hidden states [rows, H] (bf16), a frozen
lm_head [V, H] (bf16), data tokens (10% outside the draft vocabulary) and a valid mask
(90%) -- the reference re-projected through the lm_head and restricted to N draft ids.
The drafter itself is not run: only what the loss adds on top of its logits.

How it is measured: torch's CPU allocations bypass Python's allocator (tracemalloc sees
nothing) and the profiler's memory events do not give one clean high-water mark, so each
(path, rows) runs in a fresh subprocess that reads the kernel's own count: after setup
and a warm-up at a few rows (code pages, thread pools), it resets the peak resident set
(`5` into /proc/self/clear_refs), reads VmRSS as the baseline, runs the loss and reads
VmHWM. `loss_activation_bytes` = VmHWM - baseline: every byte the loss touched at its
peak, the logits' gradient [rows, N] included (the model's backward needs it anyway; it
is listed under `arithmetic`). MALLOC_MMAP_THRESHOLD_=64 KiB makes glibc map every
larger block on its own and unmap it on free, so RSS follows live tensors instead of a
heap's high-water mark. Linux only.

Extrapolation: bytes(rows) = intercept + slope * rows, least squares over the measured
rows, evaluated at production rows. A line only holds within one regime, so every
measured rows must be (a) >= chunk_rows: the chunked path's constant part is then one
chunk's intermediates, its slope the logits gradient; and (b) > hidden: below that the
one-shot path peaks on its rows-independent fp32 copy of the lm_head (V*H*4 bytes, more
than one [rows, V] fp32 block), above it on two [rows, V] blocks (logits and softmax)
as at production -- hence the default B=1 with A=512 and A=768 anchors, not fewer
(A=64/128 would put a 1.56 GB constant where production has 17 GB of slope). Each
one-shot measurement then holds ~4-7 GB and takes about a minute on one CPU thread.
`arithmetic` holds plain products, not measurements."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from dlite.losses import chunk_rows_for, dlite_loss, dlite_loss_unchunked, hidden_reference

ROOT = Path(__file__).resolve().parents[2]
GOAL_BYTES = 2 * 10**9   # loss_activation_bytes at the production shape (issue 16)
PATHS = ("unchunked", "chunked")


def _status(key: str) -> int:
    """A /proc/self/status memory figure (kB) in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


def _inputs(rows, vocab, draft_vocab, hidden, gamma, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    lm_head = (torch.randn(vocab, hidden, generator=g) / hidden ** 0.5).to(dtype)
    ids = torch.randperm(vocab, generator=g)[:draft_vocab].sort().values
    h = torch.randn(rows // gamma, gamma, hidden, generator=g).to(dtype)
    logits = (torch.randn(rows // gamma, gamma, draft_vocab, generator=g) * 2).to(dtype).requires_grad_()
    targets = torch.randint(0, draft_vocab, (rows // gamma, gamma), generator=g)
    targets[torch.rand(targets.shape, generator=g) < 0.1] = -1
    return logits, targets, torch.rand(targets.shape, generator=g) < 0.9, h, lm_head, ids


def _loss_step(path, logits, targets, valid, h, lm_head, ids, chunk_rows):
    if path == "unchunked":  # compute_loss before issue 16: the whole p_ref, lm_head cast whole
        p_ref = torch.softmax(F.linear(h.float(), lm_head.float()), -1).index_select(-1, ids)
        loss, _ = dlite_loss_unchunked(logits, targets, valid, p_ref, ce_valid=targets >= 0)
    else:
        ref = hidden_reference(h, lm_head, ids)
        loss, _ = dlite_loss(logits, targets, valid, ref, ce_valid=targets >= 0, chunk_rows=chunk_rows)
    loss.backward()


def measure(path: str, rows: int, vocab: int, draft_vocab: int, hidden: int, gamma: int,
            dtype: str, chunk_rows: int, threads: int = 1) -> dict:
    """One measurement; meant for a fresh process (`run` spawns one per call)."""
    torch.set_num_threads(threads)
    dt = getattr(torch, dtype)
    # small warm-up vocabulary: code paths are the same (two lm_head cast blocks and more)
    warm = _inputs(2 * gamma, min(vocab, 20000), min(draft_vocab, 4096), hidden, gamma, dt)
    _loss_step(path, *warm, chunk_rows=gamma)
    del warm
    inputs = _inputs(rows, vocab, draft_vocab, hidden, gamma, dt)
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS now
    base = _status("VmRSS")
    t0 = time.perf_counter()
    _loss_step(path, *inputs, chunk_rows=chunk_rows)
    return {"rows": rows, "loss_activation_bytes": _status("VmHWM") - base,
            "baseline_rss_bytes": base, "time_s": round(time.perf_counter() - t0, 3)}


def _spawn(**kw) -> dict:
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "OMP_NUM_THREADS": str(kw.get("threads", 1)),
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-m", "dlite.bench.loss_memory", "--child", json.dumps(kw)],
                         env=env, capture_output=True, text=True, cwd=ROOT)
    if out.returncode:
        raise RuntimeError(f"loss_memory child {kw} failed:\n{out.stderr[-4000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _fit(points, at_rows: int) -> dict:
    """Least-squares line bytes = intercept + slope * rows, evaluated at `at_rows`."""
    x = torch.tensor([p["rows"] for p in points], dtype=torch.float64)
    y = torch.tensor([p["loss_activation_bytes"] for p in points], dtype=torch.float64)
    slope = float(((x - x.mean()) * (y - y.mean())).sum() / ((x - x.mean()) ** 2).sum())
    intercept = float(y.mean()) - slope * float(x.mean())
    return {"intercept_bytes": round(intercept), "bytes_per_row": round(slope, 1),
            "loss_activation_bytes": round(intercept + slope * at_rows)}


def _arithmetic(rows, vocab, draft_vocab, hidden, dtype) -> dict:
    item = torch.empty(0, dtype=dtype).element_size()
    return {"label": "arithmetic (plain products, not measured)", "rows": rows,
            "fp32_rows_x_V_bytes_per_copy": rows * vocab * 4,
            "fp32_rows_x_N_bytes_per_copy": rows * draft_vocab * 4,
            "lm_head_fp32_copy_bytes": vocab * hidden * 4,
            "logits_grad_bytes": rows * draft_vocab * item}


def run(rows_list=(3584, 5376), vocab: int = 151936, draft_vocab: int = 32768, hidden: int = 2560,
        gamma: int = 7, dtype=torch.bfloat16, chunk_rows: int = None, batch: int = 4,
        anchors: int = 512, threads: int = 1) -> dict:
    """Measure both paths at each of rows_list (slot rows B*A*γ, multiples of gamma,
    default B=1 with A=512 and 768) and extrapolate to B=batch, A=anchors."""
    chunk_rows = chunk_rows or chunk_rows_for(vocab)
    if len(rows_list) < 2 or any(r % gamma or r < chunk_rows or r <= hidden for r in rows_list):
        raise ValueError(f"rows_list {rows_list}: >= 2 multiples of gamma={gamma}, each >= chunk_rows="
                         f"{chunk_rows} and > hidden={hidden} (the module docstring says why)")
    prod = batch * anchors * gamma
    kw = dict(vocab=vocab, draft_vocab=draft_vocab, hidden=hidden, gamma=gamma,
              dtype=str(dtype).removeprefix("torch."), chunk_rows=chunk_rows, threads=threads)
    measured = {p: [_spawn(path=p, rows=r, **kw) for r in rows_list] for p in PATHS}
    fits = {p: _fit(measured[p], prod) for p in PATHS}
    return {"shape": kw, "production": {"batch": batch, "anchors": anchors, "gamma": gamma, "rows": prod},
            "measured": measured,
            "extrapolated": {"formula": "loss_activation_bytes(rows) = intercept_bytes + bytes_per_row * rows "
                                        "(least squares over `measured`), at rows = batch * anchors * gamma",
                             **fits},
            "arithmetic": _arithmetic(prod, vocab, draft_vocab, hidden, dtype),
            "goal": {"loss_activation_bytes_max": GOAL_BYTES,
                     "met": fits["chunked"]["loss_activation_bytes"] <= GOAL_BYTES},
            "method": "VmHWM - VmRSS after setup, fresh subprocess per measurement (module docstring)"}


def main(out_path, **kwargs) -> dict:
    """Run with the production widths and write the JSON report to out_path."""
    report = run(**kwargs)
    Path(out_path).parent.mkdir(parents=True, exist_ok=True)
    Path(out_path).write_text(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:
        print(json.dumps(measure(**json.loads(sys.argv[2]))))
    else:
        print(json.dumps(main(sys.argv[1] if len(sys.argv) > 1 else "loss_memory.json"), indent=2))
