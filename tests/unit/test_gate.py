"""Unit tests for the release gate (a pure function of metrics, production's metrics and
the gate settings), the version's metric tags, and the model card built from an
evaluation report."""

import pytest

from dlite.card import card_sections, primary_method, report_methods
from dlite.export import model_card
from pipelines.stages.publish import metric_tags, release_gate, tagged_metrics

GATE = {"min_tau": 1.5, "min_speedup": 1.0, "tolerance": 0.05}


def _r(tau, speedup, lossless=True, t1=None):
    r = {"tau": tau, "speedup_vs_ar": speedup, "lossless": lossless, "accept_at_k": [0.9, 0.6, None],
         "tau_by_bucket": {"1K-4K": tau + 0.1, "<1K": tau - 0.1}, "bucket_labels": ["<1K", "1K-4K", ">4K"],
         "n_tasks": 6, "target_fingerprint": {"id": "w-t"}}
    r["by_temperature"] = {"0.0": dict(r), "1.0": dict(r, **(t1 or {"tau": tau - 0.5, "lossless": None}))}
    return r


def test_gate_passes_without_production():
    g = release_gate({"tau": 2.0, "speedup_vs_ar": 1.2, "lossless": True}, None, **GATE)
    assert g["passed"] and g["reasons"] == []
    assert [c["check"] for c in g["checks"]] == ["tau >= gate.min_tau", "speedup_vs_ar >= gate.min_speedup",
                                                 "lossless"]


@pytest.mark.parametrize("metrics,needle", [
    ({"tau": 1.2, "speedup_vs_ar": 1.2}, "tau >= gate.min_tau: 1.2 < 1.5"),
    ({"tau": 2.0, "speedup_vs_ar": 0.8}, "speedup_vs_ar >= gate.min_speedup: 0.8 < 1"),
    ({"tau": None, "speedup_vs_ar": 1.2}, "tau >= gate.min_tau: missing < 1.5"),
    ({"tau": float("nan"), "speedup_vs_ar": 1.2}, "missing"),
    ({"tau": 2.0, "speedup_vs_ar": 1.2, "lossless": False}, "greedy speculative output differed"),
])
def test_gate_floors_fail_with_numbers(metrics, needle):
    g = release_gate(metrics, None, **GATE)
    assert not g["passed"] and len(g["reasons"]) == 1 and needle in g["reasons"][0]


def test_gate_against_production_uses_relative_tolerance():
    prod = {"version": "3", "tau": 3.0, "speedup_vs_ar": 2.0}
    # 5% below production is the floor: 2.85 / 1.9 pass, just under fails.
    assert release_gate({"tau": 2.85, "speedup_vs_ar": 1.9}, prod, **GATE)["passed"]
    g = release_gate({"tau": 2.80, "speedup_vs_ar": 2.5}, prod, **GATE)
    assert not g["passed"] and len(g["reasons"]) == 1
    assert g["reasons"][0] == ("tau vs production: 2.8 < 2.85 (production v3 3 - 5% tolerance)")
    failed = [c for c in g["checks"] if not c["passed"]]
    assert failed[0]["value"] == 2.80 and failed[0]["threshold"] == pytest.approx(2.85)


def test_gate_skips_metrics_production_never_recorded():
    g = release_gate({"tau": 2.0, "speedup_vs_ar": 1.2}, {"version": "1", "tau": None, "speedup_vs_ar": 1.0},
                     **GATE)
    assert g["passed"] and [c["check"] for c in g["checks"]][-1] == "speedup_vs_ar vs production"


def test_metric_tags_round_trip():
    tags = metric_tags(_r(2.5, 1.4))
    assert tags["dlite.metric.tau"] == "2.5" and tags["dlite.metric.tau_T1"] == "2.0"
    assert tags["dlite.metric.accept_at_k"] == "[0.9, 0.6, null]" and "dlite.metric.lossless_T1" not in tags
    # A report without ties classified (as versions registered before them): None, strict.
    assert tagged_metrics(tags) == {"tau": 2.5, "speedup_vs_ar": 1.4, "speedup_vs_ar_lower": None,
                                    "lossless": True, "lossless_up_to_ties": None}
    r = _r(2.5, 1.4, lossless=False)
    r["by_temperature"]["0.0"]["lossless_up_to_ties"] = True
    tied = metric_tags(r)
    assert tagged_metrics(tied)["lossless_up_to_ties"] is True and tagged_metrics(tied)["lossless"] is False
    assert tagged_metrics({}) == {"tau": None, "speedup_vs_ar": None, "speedup_vs_ar_lower": None,
                                  "lossless": None, "lossless_up_to_ties": None}


def test_gate_decides_on_the_speedups_lower_bound():
    """A point speedup over the floor whose timing pairs' lower bound is under it is
    refused: one lucky machine or a noisy run does not promote a drafter."""
    from dlite.decoding.metrics import speedup_spread
    noisy = speedup_spread([(47, 1000, 47, 1300), (47, 1000, 47, 800), (47, 1000, 47, 1250), (47, 1000, 47, 900)])
    assert noisy["pooled"] > 1.0 > noisy["lower_bound"] and noisy["n_pairs"] == 4
    assert noisy["min"] <= noisy["median"] <= noisy["max"] and noisy["lower_bound"] >= noisy["min"]
    metrics = {"tau": 2.0, "speedup_vs_ar": noisy["pooled"], "speedup_vs_ar_lower": noisy["lower_bound"],
               "lossless": True}
    g = release_gate(metrics, None, **GATE)
    assert not g["passed"] and g["reasons"][0].startswith("speedup_vs_ar_lower >= gate.min_speedup: 0.")
    steady = speedup_spread([(47, 1000, 47, 1200), (47, 1000, 47, 1250), (47, 1000, 47, 1180)])
    assert release_gate({**metrics, "speedup_vs_ar_lower": steady["lower_bound"]}, None, **GATE)["passed"]
    assert speedup_spread([(47, 1000, 47, 1200)])["lower_bound_method"] == "min over < 3 pairs"
    r = _r(2.0, 1.1)
    r["by_temperature"]["0.0"]["speedup_vs_ar_lower"] = 0.97
    assert tagged_metrics(metric_tags(r))["speedup_vs_ar_lower"] == 0.97


def test_report_methods_and_primary():
    single = _r(2.0, 1.1)
    assert report_methods(single) == {"dlite": single} and primary_method(single) == "dlite"
    multi = {"methods": {"dspark": _r(1.8, 1.0), "dlite": _r(2.0, 1.1)}, "primary": "dlite"}
    assert primary_method(multi) == "dlite" and primary_method(multi, "dspark") == "dspark"
    with pytest.raises(ValueError, match="method 'nope' not in the report"):
        primary_method(multi, "nope")
    with pytest.raises(ValueError, match="report.methods: no methods"):
        report_methods({"methods": {}})
    with pytest.raises(ValueError, match=r"report.methods.dspark: not an evaluation result"):
        report_methods({"methods": {"dspark": {"speedup_vs_ar": 1.0}}})


DRAFTER = {"architecture": "dlite", "gamma": 3, "target_name": "tiny", "target_fingerprint": "w-t",
           "target_layer_ids": [0, 1], "num_parameters": 12345, "dtype": "float32", "stage": "align",
           "step": 20, "skip_teacher": False, "data_plan_id": "plan-abc", "val_tau": 2.25, "val_loss": 1.5}
CONFIG = {"train": {"steps_teacher": 10, "steps_align": 20, "distill_frac": 0.5, "lr": 6e-4,
                    "batch_size": 4, "grad_accum": 1},
          "data": {"n_train": 64, "max_seq_len": 2048}, "eval": {"n_trajectories": 4}, "run": {"seed": 0}}


def test_card_has_the_evaluation_table_against_other_methods():
    report = {"methods": {"dlite": _r(2.5, 1.4), "dspark": _r(1.75, 1.1), "dlite_no_teacher": _r(2.0, 1.2)},
              "primary": "dlite", "config": CONFIG}
    card = model_card(DRAFTER, card_sections(report, DRAFTER, registered_model="dlite-tiny"))
    rows = [line for line in card.splitlines() if line.startswith("| ") and "|---" not in line][1:]
    assert len(rows) == 6  # 3 methods x (greedy, T=1)
    assert rows[0].startswith("| **dlite** (this) | greedy | 2.50 | 1.40x | 0.90 0.60 – "
                              "| <1K 2.40, 1K-4K 2.60 |")
    assert rows[1].startswith("| **dlite** (this) | T=1 | 2.00 |") and "n/a" in rows[1]
    assert rows[2].startswith("| dlite_no_teacher | greedy | 2.00 |")
    assert rows[4].startswith("| dspark | greedy | 1.75 |")
    for needle in ("## What it drafts for", "`w-t`", "trained on agent trajectories from the built-in",
                   "1. `teacher`: the history-aware teacher against the target, 10 steps",
                   "distilling it for 10 steps", "data fingerprint (collection plan): `plan-abc`",
                   "supervised positions `assistant`",
                   "step 20 (best validation tau 2.25", "on 4 held-out", "load_drafter(",
                   'download_artifacts("models:/dlite-tiny@production")'):
        assert needle in card, needle
    assert "Not evaluated yet" not in card


def test_card_training_for_ablation_and_baseline():
    cfg = {"config": CONFIG}
    ablation = card_sections({**_r(2.0, 1.1), **cfg}, {**DRAFTER, "skip_teacher": True})["How it was trained"]
    assert ablation.startswith("1. `align` (no-teacher ablation): from scratch against the target, 20 steps")
    assert "teacher`: the history" not in ablation
    dspark = card_sections({**_r(2.0, 1.1), **cfg}, {**DRAFTER, "architecture": "dspark", "stage": "dspark"})
    assert dspark["How it was trained"].startswith("1. `dspark`: the DSpark-style baseline")


def test_ties_are_shown_apart_from_strict_and_broken_losslessness():
    """A bf16 target's own logit ties may part speculative from plain output: the card and
    the results table say "up to ties" there, not a bare True/False."""
    from dlite.card import lossless_label
    from pipelines.orchestration.results import results_table
    cases = {"yes": {"lossless": True, "lossless_up_to_ties": True},
             "up to ties": {"lossless": False, "lossless_up_to_ties": True},
             "no": {"lossless": False, "lossless_up_to_ties": False},
             "n/a": {"lossless": None}}
    assert {k: lossless_label(m) for k, m in cases.items()} == {k: k for k in cases}
    assert lossless_label({"lossless": False}) == "no"  # a report from before ties were classified
    tie_only = cases["up to ties"]  # an fp32 target's rule is exact: the gate refuses it
    assert lossless_label(tie_only, "exact") == lossless_label({**tie_only, "lossless_rule": "exact"}) \
        == "no (at ties only)"
    assert lossless_label(tie_only, "up_to_ties(bf16)") == "up to ties"
    tied = _r(2.0, 1.1, lossless=False)
    tied["by_temperature"]["0.0"]["lossless_up_to_ties"] = True
    card = model_card(DRAFTER, card_sections({"methods": {"dlite": tied}, "primary": "dlite", "config": CONFIG},
                                             DRAFTER))
    assert "| up to ties | 6 |" in card and "**no**" not in card
    exact_card = model_card(DRAFTER, card_sections(  # fp32: the method's rule reaches every row
        {"methods": {"dlite": {**tied, "lossless_rule": "exact"}}, "primary": "dlite", "config": CONFIG}, DRAFTER))
    assert "| **no (at ties only)** | 6 |" in exact_card
    row = {"tau": 2.0, "speedup_vs_ar": 1.1, "tau_t1": None, "speedup_vs_ar_t1": None,
           "lossless": False, "lossless_up_to_ties": True}
    assert results_table({"evaluate": {"methods": {"dlite": row}}}).splitlines()[-1].endswith(" up to ties")
    exact = {"evaluate": {"methods": {"dlite": row}, "lossless_rule": "exact"}}
    assert results_table(exact).splitlines()[-1].endswith(" no (at ties only)")


def test_card_says_where_the_speed_was_measured_and_the_gates_figure():
    from dlite.decoding.metrics import speedup_spread
    r = _r(2.5, 1.2)
    r["speedup_vs_ar_spread"] = speedup_spread([(47, 1000, 47, 1150), (47, 1000, 47, 1250), (47, 1000, 47, 1200)])
    report = {"methods": {"dlite": r}, "primary": "dlite", "config": CONFIG,
              "timing": {"cpu_model": "Some CPU @ 2GHz", "device": "cpu", "cpu_count": 2, "torch_threads": 2,
                         "loadavg_1m_before": 0.4, "loadavg_1m_after": 1.9, "plain_tokens_per_s": 10.4}}
    text = card_sections(report, DRAFTER)["Evaluation"]
    low = r["speedup_vs_ar_spread"]["lower_bound"]
    for needle in ("Some CPU @ 2GHz (cpu, 2 cores, 2 torch threads, 1-min load 0.4 -> 1.9)",
                   "plain decoding 10.4 tokens/s", "over 3 interleaved plain/speculative pairs",
                   "per pair 1.15-1.25x", f"lower bound **{low:.2f}x**", "which the release gate decides on"):
        assert needle in text, needle
    assert "no timed pairs" in card_sections({"methods": {"dlite": _r(2.5, 1.2)}, "primary": "dlite",
                                              "config": CONFIG}, DRAFTER)["Evaluation"]
