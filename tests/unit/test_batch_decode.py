"""Batched speculative decoding (closed loop, ragged rows) over a tiny random-weight
Qwen3 target: every request's greedy output equals its own batch-1 plain greedy output
at concurrency 1, 3 and 8 with histories of very different lengths (plain, oracle,
half-right, DLite with its one-pass `draft_rows`, DSpark-style with its one-pass
`draft_history_rows`, a history-reading drafter, a tree hybrid of prompt lookup,
SuffixDecoding and DLite, crafted token trees), the ragged cache keeps exactly what a
one-row cache would (a tree's accepted path too), DLite's batched draft is its per-row
draft, finished rows are refilled in stream order, and a history-free drafter holds no
state per request."""

import pytest
import torch

import dlite.target.attention  # noqa: F401  (registers sdpa_packed_gqa)
from dlite.decoding.batch import Request, batched_generate
from dlite.decoding.decode import new_cache, plain_generate, prefill, target_forward
from dlite.decoding.oracle import TargetAsDrafter
from dlite.decoding.ragged import RaggedCache
from tests.unit.test_spec_decode import GAMMA, HalfRightDrafter, dlite_drafter, tiny_target

# Histories of very different lengths (2 .. 300 tokens), more requests than rows.
LENGTHS = [7, 300, 2, 45, 130, 13, 260, 5, 90, 31, 210]
MAX_NEW = 24


@pytest.fixture(scope="module")
def target():
    return tiny_target(vocab=128, layers=2)


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, 128, (n,), generator=g).tolist() for n in LENGTHS]


@pytest.fixture(scope="module")
def reference(target, prompts):
    return [plain_generate(target, p, MAX_NEW)[0] for p in prompts]


def _requests(target, prompts, layers=(0, 1), history=False):
    return [Request(i, p, prefill(target, p, layers, history)) for i, p in enumerate(prompts)]


class FeatureChecked(TargetAsDrafter):
    """The oracle reading a history: each call must get one feature row per position
    verified since the last one (the whole prompt first), of the right width."""

    def draft(self, state, feats, anchor_id, anchor_pos, temperature, generator=None):
        seen = state.setdefault("fed", 0)
        assert feats.shape == (anchor_pos - seen, 2 * self.target.config.hidden_size)
        state["fed"] = anchor_pos
        return super().draft(state, feats, anchor_id, anchor_pos, temperature, generator)


def tree_hybrid(target, learned: bool = True):
    """A tree hybrid (prompt lookup + SuffixDecoding + DLite; without DLite: the
    training-free `hybrid_free_tree`) rated so that every proposer's branch is
    verified: real trees of several branches in every row."""
    from dlite.decoding.calibration import BinnedMap, Calibration
    from dlite.decoding.hybrid import TreeHybrid
    from dlite.decoding.lookup import PromptLookupDrafter
    from dlite.decoding.suffix import SuffixDecoding
    model = dlite_drafter(target, list(range(128))) if learned else None
    rated = Calibration({"model": BinnedMap((0.0,), [0.9, 0.9], [0, 0]),
                         "lookup": BinnedMap((2,), [0.9, 0.9], [0, 0])})
    sx = SuffixDecoding(128, gamma=GAMMA)
    return lambda p: TreeHybrid(model, [PromptLookupDrafter(p, 128, gamma=GAMMA), sx(p)], rated, budget=10)


MAKERS = {
    "plain": lambda t: None,
    "oracle": lambda t: (lambda p: TargetAsDrafter(t, p, GAMMA, target_layer_ids=[0, 1])),
    "half_right": lambda t: (lambda p: HalfRightDrafter(t, p, GAMMA, target_layer_ids=[0, 1])),
    "history": lambda t: (lambda p: FeatureChecked(t, p, GAMMA, target_layer_ids=[0, 1])),
    "dlite": lambda t: dlite_drafter(t, list(range(128))),
    "dspark": lambda t: dspark_drafter(t),
    "tree_hybrid": tree_hybrid,
    "free_tree_hybrid": lambda t: tree_hybrid(t, learned=False),
}


def dspark_drafter(target, seed=1):
    """A random-weight DSpark-style drafter (history cache per request, drafted for every
    row in one pass by `draft_history_rows`) whose Markov head is not neutral."""
    from dlite.models import LEARNED_MASK, DrafterConfig, build_drafter
    cfg = DrafterConfig(arch="dspark", gamma=GAMMA, target_layer_ids=[0, 1], hidden_size=32, num_layers=1,
                        num_heads=2, num_kv_heads=1, head_dim=16, intermediate_size=64, markov_rank=8)
    torch.manual_seed(seed)
    d = build_drafter(cfg, target.get_input_embeddings().weight.detach(), target.lm_head.weight.detach(),
                      LEARNED_MASK).eval()
    torch.nn.init.normal_(d.markov.w2.weight, std=0.5)
    return d


@pytest.mark.parametrize("concurrency", [1, 3, 8])
@pytest.mark.parametrize("name", MAKERS)
def test_every_request_equals_its_own_plain_greedy_output(target, prompts, reference, name, concurrency):
    history = name in ("oracle", "half_right", "history", "dspark")
    reqs = _requests(target, prompts, history=history)
    res = batched_generate(target, MAKERS[name](target), reqs, concurrency, MAX_NEW)
    assert [r["index"] for r in res["requests"]] == list(range(len(prompts)))
    for r, ref in zip(res["requests"], reference):
        assert r["tokens"] == ref, (name, concurrency, r["index"])
        assert sum(x["emitted"] for x in r["rounds"]) == len(ref) - 1
    assert max(s["rows"] for s in res["steps"]) == min(concurrency, len(prompts))
    if name == "oracle":  # the target drafting for itself: everything accepted
        rounds = [x for r in res["requests"] for x in r["rounds"][:-1]]
        assert all(x["accepted"] == GAMMA for x in rounds)


@pytest.mark.parametrize("attn", ["eager", "sdpa_packed_gqa"])
def test_lossless_under_every_attention(target, prompts, reference, attn):
    """The masks hold under the other attention kernels too (the packed GQA path also
    takes one-token steps under a mask: batched plain decoding)."""
    target.config._attn_implementation = attn
    try:
        for maker in ("plain", "half_right"):
            res = batched_generate(target, MAKERS[maker](target), _requests(target, prompts, history=True),
                                   4, MAX_NEW)
            assert [r["tokens"] for r in res["requests"]] == reference, (attn, maker)
    finally:
        target.config._attn_implementation = "sdpa"


def test_plain_steps_are_one_token_per_row_and_rows_refill(target, prompts):
    res = batched_generate(target, None, _requests(target, prompts), 4, MAX_NEW)
    assert {s["n"] for s in res["steps"]} == {1}
    # closed loop: 4 rows busy until the stream runs dry, then the batch drains
    rows = [s["rows"] for s in res["steps"]]
    assert rows[0] == 4 and rows == sorted(rows, reverse=True) and rows[-1] >= 1


def test_eos_and_budget_end_rows_early(target, prompts, reference):
    eos = reference[1][5]  # a token request 1 emits early
    res = batched_generate(target, MAKERS["half_right"](target), _requests(target, prompts, history=True),
                           3, MAX_NEW, eos_ids=[eos])
    for r, ref in zip(res["requests"], reference):
        cut = ref.index(eos) + 1 if eos in ref else len(ref)
        assert r["tokens"] == ref[:cut]


ROW_A, ROW_B = [3, 9, 27, 81, 5], list(range(40, 52))


def _two_rows(target) -> RaggedCache:
    """A ragged cache holding ROW_A and ROW_B's prefills."""
    rc = RaggedCache(target, 2)
    for row, p in enumerate((ROW_A, ROW_B)):
        rc.place(row, prefill(target, p).cache)
    return rc


def _next_logits_match(target, rc, seqs) -> None:
    """One more token per row: its logits equal a fresh forward over that row's
    sequence `seqs[row]` (history + what it kept + that token)."""
    nxt = torch.tensor([[s[-1]] for s in seqs])
    got = target_forward(target, nxt, 0, rc.cache, position_ids=rc.positions(1, "cpu"),
                         attention_mask=rc.mask(1, torch.float32, "cpu"))
    for row, seq in enumerate(seqs):
        fresh = target_forward(target, torch.tensor(seq), 0, new_cache(target))[-1]
        assert torch.allclose(got[row, -1], fresh, atol=1e-5)


def test_ragged_cache_keeps_what_a_one_row_cache_keeps(target):
    """Two rows of different lengths, a round of 4 slots, rows keeping 1 and 3: the next
    token's logits per row equal a fresh forward over that row's kept sequence."""
    with torch.inference_mode():
        rc = _two_rows(target)
        block = torch.tensor([[7, 8, 9, 10], [11, 12, 13, 14]])
        target_forward(target, block, 0, rc.cache, position_ids=rc.positions(4, "cpu"),
                       attention_mask=rc.mask(4, torch.float32, "cpu"))
        rc.commit(4, [1, 3])
        assert rc.lengths == [6, 15] and rc.length == 15
        _next_logits_match(target, rc, [ROW_A + [7, 60], ROW_B + [11, 12, 13, 61]])
        rc.commit(1, [1, 1])
        rc.drop_rows([1])
        assert rc.lengths == [16] and rc.length == 16


def test_ragged_cache_keeps_a_tree_path(target):
    """A row verifying a tree keeps its accepted path's slots (not a prefix of the
    block) behind its history: the next logits equal a fresh forward over the path."""
    from dlite.decoding.tree import ancestors
    with torch.inference_mode():
        rc = _two_rows(target)
        # row 0: a chain 7 8 9 10; row 1: anchor 11 -> {12 -> 13, 14} (nodes 0..3)
        block = torch.tensor([[7, 8, 9, 10], [11, 12, 13, 14]])
        depths = torch.tensor([[0, 1, 2, 3], [0, 1, 2, 1]])
        within = torch.stack([ancestors([-1, 0, 1, 2]), ancestors([-1, 0, 1, 0])])
        target_forward(target, block, 0, rc.cache, position_ids=rc.positions(4, "cpu", depths),
                       attention_mask=rc.mask(4, torch.float32, "cpu", within))
        rc.commit(4, [2, [0, 3]])  # row 0: 7 8; row 1: 11 14 (the second branch)
        assert rc.lengths == [7, 14]
        _next_logits_match(target, rc, [ROW_A + [7, 8, 60], ROW_B + [11, 14, 61]])


@pytest.mark.parametrize("stop", [0.0, 0.3])
def test_dlite_batched_draft_is_its_per_row_draft(target, prompts, stop):
    d = dlite_drafter(target, list(range(0, 120, 3)))
    d.draft_stop_prob = stop
    pres = [prefill(target, p, d.target_layer_ids) for p in prompts[:5]]
    anchors = [int(p.logits.argmax()) for p in pres]
    feats = torch.cat([p.features(d.target_layer_ids, False) for p in pres])
    rows = d.draft_rows(feats, anchors, [p.t for p in pres], 0.0)
    lengths = set()
    for (tok, q), pre, anc, f in zip(rows, pres, anchors, feats):
        one, _, _ = d.draft(None, f[None], anc, pre.t, 0.0)
        assert tok.tolist() == one.tolist() and q is None
        lengths.add(len(one))
    assert stop == 0.0 and lengths == {GAMMA} or stop > 0


def test_history_free_rows_hold_no_drafter_state(target, prompts):
    res = batched_generate(target, MAKERS["dlite"](target), _requests(target, prompts), 8, 8)
    assert all(r["drafter_bytes_peak"] == 0 and r["kv_bytes_peak"] > 0 for r in res["requests"])
    hist = batched_generate(target, MAKERS["oracle"](target), _requests(target, prompts, history=True), 8, 8)
    assert all(r["drafter_bytes_peak"] > 0 for r in hist["requests"])


def test_sampling_runs_per_row_and_repeats_with_the_seed(target, prompts):
    reqs = _requests(target, prompts[:5])
    runs = [batched_generate(target, MAKERS["dlite"](target), reqs, 3, 12, temperature=1.0, seed=4)
            for _ in range(2)]
    assert [r["tokens"] for r in runs[0]["requests"]] == [r["tokens"] for r in runs[1]["requests"]]
    assert all(0 <= t < 128 for r in runs[0]["requests"] for t in r["tokens"])


@pytest.mark.parametrize("concurrency", [1, 3, 8])
@pytest.mark.parametrize("mode,accepted", [("shared", 3), ("both_wrong", 0), ("second", 2), ("to_end", 4)])
def test_crafted_trees_in_a_batch_are_lossless(target, prompts, reference, mode, accepted, concurrency):
    """Every row verifies its own crafted two-branch tree (shared prefixes, both wrong,
    the second right, a branch to the block's end) in the batched forward: each keeps
    its accepted path -- scattered slots when the second branch wins -- and equals its
    own plain greedy output."""
    from tests.unit.test_tree import CraftedTrees
    refs = {tuple(p): ref for p, ref in zip(prompts, reference)}
    res = batched_generate(target, lambda p: CraftedTrees(p, refs[tuple(p)], mode), _requests(target, prompts),
                           concurrency, MAX_NEW)
    for r, ref, p in zip(res["requests"], reference, prompts):
        assert r["tokens"] == ref, (mode, concurrency, r["index"])
        full = [x for x in r["rounds"] if x["context_len"] - len(p) + 1 + 4 <= len(ref)]  # truth known
        assert full and all(x["accepted"] == accepted for x in full), (mode, r["index"])
        assert all(x["verified"] == {"shared": 6, "both_wrong": 8, "second": 8, "to_end": 6}[mode] for x in r["rounds"])


def test_a_ragged_cache_that_forgets_to_move_kept_slots_breaks_losslessness(target, prompts, reference,
                                                                             monkeypatch):
    """The checks above can fail: rows keeping slots where they were computed (not behind
    their history) attend to padding and part from the plain output."""
    def lazy_commit(self, n, kept):
        self.lengths = [s + k for s, k in zip(self.lengths, kept)]
        self._shrink()
    monkeypatch.setattr(RaggedCache, "commit", lazy_commit)
    res = batched_generate(target, MAKERS["half_right"](target), _requests(target, prompts, history=True),
                           3, MAX_NEW)
    assert any(r["tokens"] != ref for r, ref in zip(res["requests"], reference))


def test_rounds_write_the_cache_in_place(target, prompts):
    """No copy of the whole cache per forward: across rounds (appends, crops, moves) every
    layer keeps its buffer, and dropping rows moves the last rows into the holes."""
    rc = RaggedCache(target, 3)
    with torch.inference_mode():
        for row, p in enumerate(prompts[:3]):
            rc.place(row, prefill(target, p).cache)
        ptrs = None
        for step in range(6):
            target_forward(target, torch.full((3, 5), 7), 0, rc.cache, position_ids=rc.positions(5, "cpu"),
                           attention_mask=rc.mask(5, torch.float32, "cpu"))
            rc.commit(5, [1 + step % 3, 5, 2])
            now = [la._kbuf.data_ptr() for la in rc.cache.layers]
            assert ptrs is None or now == ptrs
            ptrs = now
        row2 = [la.keys[2, :, :rc.lengths[2]].clone() for la in rc.cache.layers]
        rc.drop_rows([0, 2])
        target_forward(target, torch.full((2, 1), 7), 0, rc.cache, position_ids=rc.positions(1, "cpu"),
                       attention_mask=rc.mask(1, torch.float32, "cpu"))
        assert [la._kbuf.data_ptr() for la in rc.cache.layers] == ptrs  # a drop is a move + a view
        assert all(la.keys.shape[0] == 2 for la in rc.cache.layers)
        assert all(torch.equal(la.keys[1, :, :k.shape[1]], k) for la, k in zip(rc.cache.layers, row2))


def test_drop_rows_reads_every_source_before_writing(target, prompts):
    """A keep order whose sources are also destinations (row 0 := row 2, row 1 := row 0)
    still gives every kept row its own entries and length."""
    rc = RaggedCache(target, 3)
    with torch.inference_mode():
        for row, p in enumerate(prompts[:3]):
            rc.place(row, prefill(target, p).cache)
        before = [[la.keys[b, :, :rc.lengths[b]].clone() for la in rc.cache.layers] for b in range(3)]
        lengths = list(rc.lengths)
        rc.drop_rows([2, 0])
    assert rc.lengths == [lengths[2], lengths[0]]
    for j, src in enumerate([2, 0]):
        assert all(torch.equal(la.keys[j, :, :rc.lengths[j]], k) for la, k in zip(rc.cache.layers, before[src]))
