"""Checks every e2e test applies to an evaluation report's method figures: each number
must be the one its own rounds and timings give, so a bug in aggregation fails them."""

import pytest


def check_figures(m: dict) -> None:
    """tau is the per-bucket taus weighted by their rounds and, when every round drafted
    all γ slots, 1 + the running products of accept_at_k (each the share of rounds
    reaching slot k); the speedup is the ratio of the tokens/s it reports."""
    rounds = m["rounds_by_bucket"]
    assert set(rounds) == set(m["tau_by_bucket"]) and sum(rounds.values()) == m["n_rounds"] > 0
    assert m["tau"] == pytest.approx(sum(m["tau_by_bucket"][b] * n for b, n in rounds.items()) / m["n_rounds"])
    if m.get("drafted", m["gamma"]) == m["gamma"]:
        reach, run = 0.0, 1.0
        for a in m["accept_at_k"]:
            run *= a or 0.0
            reach += run
        assert m["tau"] == pytest.approx(1 + reach)
    assert m["speedup_vs_ar"] == pytest.approx(m["tokens_per_s"]["spec"] / m["tokens_per_s"]["plain"])
