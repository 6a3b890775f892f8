"""Anchor sampling for drafter training (DLITE.md §3): an anchor a is a position where
both a and a+1 are supervised (assistant) tokens, with a >= 1 so that its context
feature -- the target's state at a-1, the last verified position -- exists.

Slot j (0-based) of the block anchored at a predicts the token at a+j+1 from the
target's reference at position a+j (`dlite.losses`), so an anchor needs the feature row
a-1 and the reference rows a..a+gamma-1. Sampling is deterministic per (seed, record
id, part) so a rerun or a resumed collection stores the same anchors."""

import hashlib

import numpy as np


def candidate_anchors(loss_mask) -> np.ndarray:
    """All positions a in [1, L-2] with loss_mask[a] and loss_mask[a+1]."""
    m = np.asarray(loss_mask, dtype=bool)
    if m.size < 3:
        return np.zeros(0, dtype=np.int32)
    ok = m[1:-1] & m[2:]
    return (np.nonzero(ok)[0] + 1).astype(np.int32)


def anchor_seed(seed: int, record_id: str, part: int = 0) -> int:
    digest = hashlib.sha256(f"{seed}:{record_id}:{part}".encode()).digest()
    return int.from_bytes(digest[:8], "little")


def sample_anchors(loss_mask, n: int, seed: int) -> np.ndarray:
    """Up to n distinct candidate anchors, sorted, drawn with `np.random.default_rng(seed)`
    (all candidates when there are fewer than n)."""
    cand = candidate_anchors(loss_mask)
    if len(cand) <= n:
        return cand
    rng = np.random.default_rng(seed)
    return np.sort(rng.choice(cand, size=n, replace=False)).astype(np.int32)


def reference_positions(anchors: np.ndarray, gamma: int, length: int) -> np.ndarray:
    """[A, gamma] positions a+j of each anchor's reference rows, clipped to length-1: rows
    past the end repeat the last position, and the loss's `valid` mask drops them (their
    data token a+j+1 does not exist)."""
    pos = np.asarray(anchors, dtype=np.int64)[:, None] + np.arange(gamma)[None, :]
    return np.minimum(pos, length - 1)


def supervised_runs(loss_mask) -> list:
    """(start, end) of each run of supervised tokens: one per assistant message (a forked
    row's branch: one answer)."""
    edges = np.flatnonzero(np.diff(np.asarray(loss_mask, dtype=np.int8), prepend=0, append=0))
    return [(int(a), int(b)) for a, b in zip(edges[::2], edges[1::2])]
