"""The throughput benchmark's figures (`dlite.bench.throughput`) on a tiny random-weight
target: repeats run every method that many times at each concurrency, speed figures
are medians with every run beside, speedups are taken per run against plain's run of
the same round, lossless holds per run, and the time outside the forwards is reported
(placing prefills, dropping a draining batch's rows)."""

import pytest

from dlite.bench import throughput as tp
from tests.unit.test_batch_decode import MAKERS, _requests


@pytest.fixture(scope="module")
def measured():
    from tests.unit.test_batch_decode import LENGTHS, MAX_NEW
    import torch
    from dlite.decoding.decode import plain_generate
    from tests.unit.test_spec_decode import tiny_target
    target = tiny_target(vocab=128, layers=2)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 128, (n,), generator=g).tolist() for n in LENGTHS[:6]]
    reqs = _requests(target, prompts, history=True)
    reference = [plain_generate(target, p, MAX_NEW)[0] for p in prompts]
    methods = {"half_right": lambda: MAKERS["half_right"](target)}
    return tp.measure(target, methods, reqs, [1, 4], MAX_NEW, [], reference, repeats=3)


def test_repeats_give_medians_runs_and_spread(measured):
    for name in ("plain", "half_right"):
        for c in ("1", "4"):
            row = measured[name][c]
            runs = [r["output_tokens_per_s"] for r in row["runs"]]
            assert len(runs) == 3 and row["output_tokens_per_s"] == sorted(runs)[1]
            assert row["lossless"] is True and all(r["lossless"] for r in row["runs"])
            assert row["place_s"] >= 0 and row["drop_s"] >= 0 and 0 <= row["outside_forward_share"] < 1
    row = measured["half_right"]["4"]
    per = row["speedup_vs_plain_runs"]
    plain = measured["plain"]["4"]["runs"]
    assert per == [a["output_tokens_per_s"] / b["output_tokens_per_s"] for a, b in zip(row["runs"], plain)]
    assert row["speedup_vs_plain_min"] <= row["speedup_vs_plain"] <= row["speedup_vs_plain_max"]
    assert row["speedup_vs_plain"] == sorted(per)[1]
    assert measured["half_right"]["1"]["tau"] > 1.0


def test_combine_is_lossless_only_if_every_run_was():
    run = {k: 1.0 for k in tp.SPEED}
    ok, bad = {**run, "lossless": True, "mismatched_requests": []}, {**run, "lossless": False, "mismatched_requests": [2]}
    row = tp.combine([ok, bad, ok])
    assert row["lossless"] is False and row["mismatched_requests"] == [2]


def test_goals_report_the_ratio_per_repeat():
    rows = {"dlite": {"1": {"speedup_vs_plain": 1.2, "speedup_vs_plain_runs": [1.2, 1.0], "drafter_bytes_per_request_max": 0},
                      "8": {"speedup_vs_plain": 0.9, "speedup_vs_plain_runs": [0.9, 0.8], "drafter_bytes_per_request_max": 0}},
            "dspark": {"1": {"speedup_vs_plain": 1.0, "speedup_vs_plain_runs": [1.0, 1.0]},
                       "8": {"speedup_vs_plain": 1.0, "speedup_vs_plain_runs": [0.9, 1.0]}}}
    g = tp.goals(rows, "dlite", "dspark")
    assert g["retention_8_over_1"] == pytest.approx(0.75)
    assert g["primary_over_history_drafter_runs"]["8"] == pytest.approx([1.0, 0.8])
    assert g["primary_drafter_bytes_zero"] is True


def test_repeats_must_be_positive():
    with pytest.raises(ValueError, match="repeats"):
        tp.measure(None, {}, [], [1], 4, [], repeats=0)
