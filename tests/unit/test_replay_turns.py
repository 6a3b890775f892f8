"""Which assistant turns an evaluation replays: the first N, or N spread evenly up to the
last one (so long-history evaluations reach the longest histories)."""

import pytest

from dlite import tiny
from dlite.decoding.replay import iter_tasks, pick_turns
from dlite.corpus import trajectories as corpus


@pytest.mark.parametrize("n,k,how,want", [
    (10, 3, "first", [0, 1, 2]), (10, 3, "spread", [0, 4, 9]), (10, 4, "spread", [0, 3, 6, 9]),
    (10, 1, "spread", [9]), (2, 5, "spread", [0, 1]), (4, None, "spread", [0, 1, 2, 3]),
])
def test_pick_turns(n, k, how, want):
    assert pick_turns(n, k, how) == want


def test_spread_reaches_the_longest_history():
    tok = tiny.load_tokenizer()
    rec = next(iter(corpus.generate("heldout", 1, 0, 8000, 20000)))
    first = list(iter_tasks(tok, rec, 2, "first"))
    spread = list(iter_tasks(tok, rec, 2, "spread"))
    every = list(iter_tasks(tok, rec))
    assert [t["turn"] for t in spread] == [0, len(every) - 1]
    assert len(spread[-1]["prompt_ids"]) == max(len(t["prompt_ids"]) for t in every)
    assert len(spread[-1]["prompt_ids"]) > len(first[-1]["prompt_ids"])


def test_context_pick_stays_inside_the_range():
    tok = tiny.load_tokenizer()
    rec = next(iter(corpus.generate("heldout", 1, 0, 8000, 20000)))
    lengths = sorted(len(t["prompt_ids"]) for t in iter_tasks(tok, rec))
    lo, hi = lengths[1], lengths[-2]  # leaves out the shortest and the longest turn
    picked = list(iter_tasks(tok, rec, 3, "context", (lo, hi)))
    assert len(picked) == min(3, len(lengths) - 2)
    assert all(lo <= len(t["prompt_ids"]) <= hi for t in picked)
    assert len(picked[-1]["prompt_ids"]) == hi  # spread reaches the longest one in range
