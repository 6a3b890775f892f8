"""How well the target itself does at each context length, on the held-out
trajectories a benchmark replays: teacher-forced next-token accuracy against the
recorded text, the same on copyable tokens (the 6-gram ending there occurred earlier),
and the target's mean top-1 probability.

Why a drafter benchmark needs it: a drafter is scored on predicting the target's own
greedy tokens. Where the target stops working (a small model past the lengths it was
trained on), its argmax turns flat and erratic and no drafter, history-free or not,
can predict it; acceptance there measures the target, not the drafter."""

from typing import Iterable, Sequence

import torch

from dlite.decoding.metrics import bucket_labels, bucket_of
from dlite.tiny.copyeval import copy_mask


@torch.no_grad()
def probe(model, sequences: Iterable[Sequence[int]], buckets: Sequence[int]) -> dict:
    """{bucket: {next_token_acc, copy_acc, copy_fraction, top1_prob, tokens}} over the
    positions whose context length falls in the bucket (one full forward per sequence)."""
    sums = {}  # bucket -> [positions, hits, copyable, hits on copyable, sum of top-1 prob]
    dev = next(model.parameters()).device
    for ids in sequences:
        x = torch.tensor([list(ids)], device=dev)
        top_p, pred = model(input_ids=x).logits[0, :-1].float().softmax(-1).max(-1)
        hit = (pred == x[0, 1:]).tolist()
        copy = copy_mask(list(ids), 0)[1:]
        for t, (h, c, p) in enumerate(zip(hit, copy, top_p.tolist())):
            s = sums.setdefault(bucket_of(t + 1, buckets), [0, 0, 0, 0, 0.0])
            for i, v in enumerate((1, h, c, h and c, p)):
                s[i] += v
    out = {}
    for label in bucket_labels(buckets):
        if label in sums:
            n, h, c, ch, p = sums[label]
            out[label] = {"next_token_acc": round(h / n, 4), "copy_acc": round(ch / c, 4) if c else None,
                          "copy_fraction": round(c / n, 4), "top1_prob": round(p / n, 4), "tokens": n}
    return out


def step_costs(model, contexts: Sequence[int], block: int = 8, reps: int = 3, seed: int = 0) -> dict:
    """{context: {decode_ms, verify_ms, ratio}}: the best of `reps` times for one cached
    decode step and for verifying a block of `block` tokens (speculative decoding's two
    target costs) after a prefill of `context` random tokens. Speculative decoding pays
    only where verify_ms / decode_ms is well below tau."""
    from dlite.decoding.calibrate import forward_ms
    out = {}
    for L in contexts:
        ms = forward_ms(model, L, (1, block), reps, seed)
        best = {"decode_ms": round(ms[1], 2), "verify_ms": round(ms[block], 2)}
        out[str(L)] = {**best, "ratio": round(best["verify_ms"] / best["decode_ms"], 3)}
    return out
