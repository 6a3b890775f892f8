"""The target probe of the quality benchmark: every position counted once in the bucket
of its context length, accuracy equal to a plain argmax check, copies found."""

import torch

from dlite.bench.target_probe import probe
from tests.unit.test_spec_decode import tiny_target


def test_probe_counts_and_accuracy():
    model = tiny_target()
    g = torch.Generator().manual_seed(0)
    half = torch.randint(3, 128, (20,), generator=g).tolist()
    seqs = [half + half, torch.randint(3, 128, (30,), generator=g).tolist()]
    out = probe(model, seqs, [8, 24])
    assert list(out) == ["<8", "8-24", ">24"]
    assert sum(b["tokens"] for b in out.values()) == sum(len(s) - 1 for s in seqs)
    # Positions t = 0..6 predict tokens 1..7 with contexts of 1..7 tokens.
    assert out["<8"]["tokens"] == 2 * 7
    hits = 0
    for s in seqs:
        with torch.no_grad():
            pred = model(input_ids=torch.tensor([s])).logits[0, :-1].argmax(-1)
        hits += int((pred == torch.tensor(s[1:])).sum())
    total = sum(b["next_token_acc"] * b["tokens"] for b in out.values())
    assert abs(total - hits) < 0.01 * len(out) * 40
    # The second half of the repeated sequence is copyable from the first.
    assert out[">24"]["copy_fraction"] > 0 and out["<8"]["copy_fraction"] == 0
    assert all(0 < b["top1_prob"] <= 1 for b in out.values())
