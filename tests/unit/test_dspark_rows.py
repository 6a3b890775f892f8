"""Batched drafting of the DSpark-style drafter (`DSparkDrafter.draft_history_rows`)
against its one-request `draft` called row by row on copies of the same caches: the
same tokens (T = 0, fp32), the same distributions (T > 0), the same cache contents
after, over two rounds, for rows with very different history lengths (2 .. 1200
positions) and numbers of new positions, B = 1 / 3 / 8, with and without the early
stop, with the full vocabulary and with a draft vocabulary. Also: each row reads only
its own history, sampling follows the returned probabilities and the seed, one row
drawn with a real generator draws what `draft` draws, and a gap in any row is refused
before any cache changes. Tiny sizes (the builder of test_models.py, re-initialised
so that drafts and confidences vary)."""

import copy

import pytest
import torch

from dlite.models.common import init_weights
from tests.unit.test_models import HT, K, V, VOCABS, make

LENGTHS = [5, 300, 1200, 17, 640, 2, 90, 1000]   # each row's history after round 1
NEW = [1, 3, 2, 5, 1, 4, 2, 7]                    # n_b of round 2: positions verified since
STOP = 0.5                                        # eval.draft_stop_prob: cuts these rows at different slots


def _median_draw(p, num_samples, generator=None):
    """A deterministic stand-in for torch.multinomial (p [N] or [B, N]): where p's CDF
    crosses 1/2. Both paths then draw the same token from the same distribution, so
    T > 0 can be compared row for row although their random streams differ."""
    c = p.cumsum(-1)
    return (c < 0.5 * c[..., -1:]).sum(-1, keepdim=True).clamp_max(p.shape[-1] - 1)


@pytest.fixture(scope="module", params=list(VOCABS))
def drafter(request):
    m = make("dspark", vocab=request.param)
    # Default init gives near-uniform logits and a zero Markov head: larger weights make
    # tokens depend on the history and the previous token, and confidences spread.
    init_weights(m, std=0.2)
    torch.nn.init.normal_(m.markov.w2.weight, std=0.3)
    return m


def _round(B: int, lengths, new, seed: int):
    """Features, anchors and anchor positions of one round for B rows."""
    g = torch.Generator().manual_seed(seed)
    feats = [torch.randn(n, K * HT, generator=g) for n in new[:B]]
    anchors = torch.randint(0, V - 1, (B,), generator=g).tolist()
    return feats, anchors, [L + n for L, n in zip(lengths, new[:B])]


def _row_by_row(m, states, feats, anchors, positions, T):
    return [m.draft(s, f, a, p, T, torch.Generator().manual_seed(0))[:2]
            for s, f, a, p in zip(states, feats, anchors, positions)]


def _assert_same_caches(got, want):
    for a, b in zip(got, want):
        assert a.length == b.length
        for x, y in zip(a.k + a.v, b.k + b.v):
            torch.testing.assert_close(x[:, :, :a.length], y[:, :, :b.length], rtol=1e-5, atol=1e-6)


def _assert_same_drafts(got, want, T):
    assert len(got) == len(want)
    for (tok, q), (ref_tok, ref_q) in zip(got, want):
        assert tok.dtype == ref_tok.dtype == torch.long and tok.tolist() == ref_tok.tolist()
        if T == 0:
            assert q is None and ref_q is None
        else:
            assert q.shape == ref_q.shape == (len(ref_tok), V)
            torch.testing.assert_close(q, ref_q, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("T", [0.0, 0.8])
@pytest.mark.parametrize("stop", [0.0, STOP])
@pytest.mark.parametrize("B", [1, 3, 8])
def test_rows_draft_is_the_row_by_row_draft(drafter, B, stop, T, monkeypatch):
    """Round 1 from empty caches (each row's whole prompt), round 2 with 1-7 new
    positions per row over histories of 2 .. 1200: every row as `draft` would have it."""
    if T > 0:
        monkeypatch.setattr(torch, "multinomial", _median_draw)
    drafter.draft_stop_prob = stop
    try:
        rows, ref = [drafter.new_state() for _ in range(B)], [drafter.new_state() for _ in range(B)]
        kept = []
        for r, (lengths, new) in enumerate([([0] * B, LENGTHS), (LENGTHS, NEW)]):
            feats, anchors, positions = _round(B, lengths, new, seed=10 * B + r)
            want = _row_by_row(drafter, ref, feats, anchors, positions, T)
            got, states = drafter.draft_history_rows(rows, feats, anchors, positions, T,
                                                     torch.Generator().manual_seed(0))
            assert states == rows
            _assert_same_drafts(got, want, T)
            _assert_same_caches(rows, ref)
            kept += [len(t) for t, _ in want]
    finally:
        drafter.draft_stop_prob = 0.0
    if stop == 0:
        assert set(kept) == {drafter.gamma}
    elif B == 8:  # the early stop did cut rows, at different slots
        assert len(set(kept)) > 2


def test_each_row_reads_only_its_own_history(drafter, monkeypatch):
    """A different history for row 1 changes row 1's draft and no other row's."""
    monkeypatch.setattr(torch, "multinomial", _median_draw)
    base = [drafter.new_state() for _ in range(3)]
    drafter.draft_history_rows(base, *_round(3, [0] * 3, LENGTHS, seed=1), 1.0)
    other = copy.deepcopy(base)
    other[1] = drafter.new_state()
    drafter.draft(other[1], torch.randn(LENGTHS[1], K * HT), 0, LENGTHS[1], 0.0)
    step = _round(3, LENGTHS, NEW, seed=2)
    a, _ = drafter.draft_history_rows(base, *step, 1.0)
    b, _ = drafter.draft_history_rows(other, *step, 1.0)
    for row in (0, 2):
        assert torch.equal(a[row][1], b[row][1])
    assert not torch.allclose(a[1][1], b[1][1])


def test_rows_sampling_follows_its_probs_and_the_seed(drafter):
    states = [drafter.new_state() for _ in range(3)]
    drafter.draft_history_rows(states, *_round(3, [0] * 3, LENGTHS, seed=3), 0.0)
    step = _round(3, LENGTHS, NEW, seed=4)
    runs = [drafter.draft_history_rows(copy.deepcopy(states), *step, 1.0, torch.Generator().manual_seed(9))[0]
            for _ in range(2)]
    outside = drafter.vocab.to_draft(torch.arange(V)) < 0  # none without a draft vocabulary
    for (tok, q), (tok2, q2) in zip(*runs):
        assert torch.equal(tok, tok2) and torch.equal(q, q2)
        assert (q.gather(1, tok[:, None]) > 0).all() and (q[:, outside] == 0).all()
        torch.testing.assert_close(q.sum(-1), torch.ones(len(tok)))


def test_a_gap_in_any_row_is_refused_before_any_cache_changes(drafter):
    states = [drafter.new_state() for _ in range(3)]
    drafter.draft_history_rows(states, *_round(3, [0] * 3, LENGTHS, seed=5), 0.0)
    feats, anchors, positions = _round(3, LENGTHS, NEW, seed=6)
    positions[2] += 1
    with pytest.raises(ValueError, match="history cache holds"):
        drafter.draft_history_rows(states, feats, anchors, positions, 0.0)
    assert [s.length for s in states] == LENGTHS[:3]


def test_one_row_draws_what_draft_draws_from_the_same_generator(drafter):
    """B = 1 consumes the generator as `draft` does (one draw per slot): same tokens."""
    state = drafter.new_state()
    drafter.draft(state, torch.randn(LENGTHS[2], K * HT), 0, LENGTHS[2], 0.0)
    ref = copy.deepcopy(state)
    feats, anchors, positions = _round(1, LENGTHS[2:], NEW[2:], seed=7)
    gen = lambda: torch.Generator().manual_seed(3)  # noqa: E731
    (tok, q), = drafter.draft_history_rows([state], feats, anchors, positions, 1.0, gen())[0]
    ref_tok, ref_q, _ = drafter.draft(ref, feats[0], anchors[0], positions[0], 1.0, gen())
    assert tok.tolist() == ref_tok.tolist()
    torch.testing.assert_close(q, ref_q, rtol=1e-5, atol=1e-6)
    assert drafter.draft_history_rows([], [], [], [], 0.0) == ([], [])
