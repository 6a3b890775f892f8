"""The verification rule on hand-made distributions: greedy prefix matching, the
rejection rule's output distribution (exactly p, and a wrong residual is caught),
its edge cases, and the shared temperature / top-p / top-k warp."""

import pytest
import torch
from scipy.stats import chisquare

from dlite.decoding import verify as V



def test_warp_defaults_are_identity_and_top_k_top_p_truncate():
    p = torch.tensor([0.1, 0.4, 0.2, 0.3])
    assert torch.equal(V.warp_probs(p), p)
    assert torch.allclose(V.warp_probs(p, top_k=2), torch.tensor([0, 4 / 7, 0, 3 / 7]))
    # top_p=0.6: 0.4 alone falls short, so 0.3 (the crossing token) is kept too.
    assert torch.allclose(V.warp_probs(p, top_p=0.6), torch.tensor([0, 4 / 7, 0, 3 / 7]))
    assert torch.allclose(V.warp_probs(p, top_p=0.4), torch.tensor([0.0, 1.0, 0.0, 0.0]))
    rows = V.warp_probs(torch.softmax(torch.randn(5, 9), -1), top_p=0.7, top_k=4)
    assert torch.allclose(rows.sum(-1), torch.ones(5)) and ((rows > 0).sum(-1) <= 4).all()


def test_process_logits_applies_temperature_and_refuses_zero():
    logits = torch.tensor([1.0, 2.0, 0.5])
    assert torch.allclose(V.process_logits(logits, 0.5), torch.softmax(logits / 0.5, -1))
    with pytest.raises(ValueError):
        V.process_logits(logits, 0.0)
    assert V.sample_token(logits, 0.0) == 1


def test_greedy_accepts_matching_prefix_then_corrects_or_bonus():
    logits = torch.eye(6)[[3, 1, 4, 1, 5]] * 5  # argmax per row: 3 1 4 1 5
    assert V.verify_greedy(torch.tensor([3, 1, 4, 1]), logits) == (4, 5)  # bonus
    assert V.verify_greedy(torch.tensor([3, 1, 0, 1]), logits) == (2, 4)  # correction
    assert V.verify_greedy(torch.tensor([0, 1, 4, 1]), logits) == (0, 3)
    # top-p/top-k never change a greedy decision.
    assert V.verify_block(torch.tensor([3, 1, 0, 1]), None, logits, 0.0, 0.5, 1) == (2, 4)


def test_sampling_p_equal_q_always_accepts_and_bonus_comes_from_p():
    g = torch.Generator().manual_seed(0)
    q = torch.softmax(torch.randn(3, 5, generator=g), -1)
    bonus = torch.tensor([[0.0, 0.0, 0.0, 1.0, 0.0]])
    p = torch.cat([q, bonus])
    for _ in range(200):
        x = torch.multinomial(q, 1, generator=g)[:, 0]
        assert V.verify_sampling(x, q, p, g) == (3, 3)


def test_sampling_never_accepts_where_target_is_zero():
    g = torch.Generator().manual_seed(1)
    p = torch.tensor([[0.5, 0.5, 0.0], [0.2, 0.3, 0.5]])
    q = torch.tensor([[0.0, 0.1, 0.9]])
    for _ in range(200):
        a, nxt = V.verify_sampling(torch.tensor([2]), q, p, g)
        assert a == 0 and nxt in (0, 1)  # residual max(0, p - q) = [0.5, 0.4, 0]


def test_residual_falls_back_to_p_without_mass():
    p = torch.tensor([0.25, 0.75])
    assert torch.equal(V.residual_distribution(p, p), p)
    assert torch.allclose(V.residual_distribution(p, torch.tensor([0.75, 0.25])), torch.tensor([0.0, 1.0]))


def _first_token_counts(p_logits, q, n, top_p=1.0, top_k=0, seed=0):
    """Draw x ~ q, verify one draft against p, count the first emitted token."""
    g = torch.Generator().manual_seed(seed)
    counts = torch.zeros(q.shape[-1])
    logits = torch.stack([p_logits, p_logits])
    for _ in range(n):
        x = torch.multinomial(q, 1, generator=g)[:, 0]
        a, nxt = V.verify_block(x, q, logits, 1.0, top_p, top_k, g)
        counts[int(x[0]) if a else nxt] += 1
    return counts


P_LOGITS = torch.tensor([1.5, 0.2, -0.3, 1.0, -2.0, 0.6])
Q = torch.tensor([[0.05, 0.4, 0.3, 0.05, 0.15, 0.05]])  # far from p on purpose


@pytest.mark.parametrize("top_p,top_k", [(1.0, 0), (0.5, 0), (1.0, 4), (0.9, 3)])
def test_sampling_output_follows_warped_target(top_p, top_k):
    p = V.process_logits(P_LOGITS, 1.0, top_p, top_k)
    n = 3000
    counts = _first_token_counts(P_LOGITS, Q, n, top_p, top_k)
    keep = p > 0
    assert counts[~keep].sum() == 0  # nothing outside the top-p / top-k set, ever
    assert chisquare(counts[keep].numpy(), (p[keep] * n).numpy()).pvalue > 1e-3


def test_sampling_statistics_catch_a_wrong_residual(monkeypatch):
    p, n = torch.softmax(P_LOGITS, -1), 3000
    monkeypatch.setattr(V, "residual_distribution", lambda p_row, q_row: q_row)
    counts = _first_token_counts(P_LOGITS, Q, n)
    assert chisquare(counts.numpy(), (p * n).numpy()).pvalue < 1e-6
