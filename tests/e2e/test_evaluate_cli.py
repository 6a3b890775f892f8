"""`python -m jobs.evaluate` on the embedded target with two drafter artifacts saved to
disk (random-weight DLite and DSpark-style; a trained one in tests/unit/test_train_loop)
plus the training-free baselines (prompt lookup, SuffixDecoding) and the hybrid of
DLite with SuffixDecoding: one Ray evaluation of all on the same prompts, greedy speculative decoding token-for-
token identical to plain decoding over multi-turn trajectories, the report's DLITE.md §4
metrics per method, plots, and an `evaluate` run on a real MLflow server; and the
throughput benchmark batching every hybrid (choose and tree) after fitting their
calibration; the training-free choose hybrid beside the learned one (`learned_over_free`)."""

import json
import subprocess
import sys

import pytest
import torch
from omegaconf import OmegaConf

from dlite import target as tgt
from dlite.config import load_config
from dlite.export import save_drafter
from dlite.models import build_drafter
from tests.report_checks import check_figures


@pytest.fixture(scope="module")
def tiny_cfg():
    return load_config("configs/experiments/tiny.yaml")


def _save_random(cfg, arch, out):
    model, tok = tgt.load(cfg.target)
    dcfg = OmegaConf.to_object(cfg.drafter)
    dcfg.arch = arch
    torch.manual_seed(0)
    drafter = build_drafter(dcfg, *tgt.shared_vocab(model, tok))
    save_drafter(drafter, out, {"target_fingerprint": tgt.fingerprint(cfg.target)["id"]})
    return out


@pytest.mark.timeout(1800)
def test_evaluate_two_drafters_on_ray(repo_root, tmp_path, tiny_cfg, mlflow_server):
    dirs = {arch: _save_random(tiny_cfg, arch, tmp_path / arch) for arch in ("dlite", "dspark")}
    out = tmp_path / "eval" / "report.json"
    r = subprocess.run([sys.executable, "-m", "jobs.evaluate", "--config", "configs/experiments/tiny.yaml", "--drafter", str(dirs["dlite"]),
                        "--drafter", f"baseline={dirs['dspark']}", "--out", str(out),
                        "eval.n_trajectories=2", "eval.max_turns=3", "eval.max_new_tokens=24",
                        "eval.temperatures=[0.0,1.0]", "eval.speed_trajectories=1",
                        "eval.baselines=[prompt_lookup,suffix]",
                        "eval.hybrids=[hybrid_suffix,hybrid_lookup_suffix_choose,hybrid_lookup_suffix_tree,hybrid_free_choose]",
                        "eval.concurrency=[1,3]", "eval.concurrency_requests=5",
                        f"tracking.uri={mlflow_server}", "tracking.experiment=evaluate-cli"],
                       cwd=repo_root, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    rep = json.loads(out.read_text())
    hybrids = ["hybrid_suffix", "hybrid_lookup_suffix_choose", "hybrid_lookup_suffix_tree", "hybrid_free_choose"]
    assert list(rep["methods"]) == ["dlite", "baseline", "prompt_lookup", "suffix", *hybrids]
    assert rep["primary"] == "dlite" and rep["methods"]["suffix"]["drafter"] is None
    for m in rep["methods"].values():
        assert m["lossless"] is True and m["by_temperature"]["0.0"]["lossless"] is True
        assert m["n_tokens"]["spec"] == m["n_tokens"]["plain"] > 0 and m["n_mismatched_tasks"] == 0
        assert m["n_tasks"] == 6 and m["speed_tasks"] == 3  # 2 x 3 turns; 1 x 3 timed alone
        assert len(m["accept_at_k"]) == 7 and set(m["by_temperature"]) == {"0.0", "1.0"}
        assert 0 <= m["drafted"] <= 7
        for r in m["by_temperature"].values():
            check_figures(r)
    # Every method replayed the same turns: same histories, same plain replies.
    greedy = [m["by_temperature"]["0.0"] for m in rep["methods"].values()]
    assert len({tuple(t["context_len"] for t in g["per_task"]) for g in greedy}) == 1
    assert len({g["n_tokens"]["plain"] for g in greedy}) == 1
    # Training-free methods draft only where the context repeats: fewer than gamma.
    assert rep["methods"]["prompt_lookup"]["drafted"] < 7 and rep["methods"]["dlite"]["drafted"] == 7
    assert rep["tau"] == rep["methods"]["dlite"]["tau"] and rep["lossless"] is True
    assert rep["config"]["drafter"]["gamma"] == 7 and rep["env"]["torch"]
    assert {k: rep["heldout"][k] for k in ("path", "read", "used", "quarantined")} == \
        {"path": "builtin:heldout", "read": 2, "used": 2, "quarantined": 0}
    spread = rep["methods"]["dlite"]["speedup_vs_ar_spread"]  # one pair per timed task
    assert spread["n_pairs"] == 3 and spread["min"] <= spread["lower_bound"] <= spread["pooled"] <= spread["max"]
    assert rep["speedup_vs_ar_lower"] == spread["lower_bound"] and rep["timing"]["pairs"] == 3
    assert rep["timing"]["plain_tokens_per_s"] > 0 and rep["timing"]["cpu_count"] >= 1
    assert (out.parent / "report-accept_at_k.png").read_bytes()[:4] == b"\x89PNG"
    # Each hybrid beside the best single method, tau and speedup, overall and per bucket;
    # the choose hybrid was calibrated on validation turns and priced by a cost curve
    # measured in this run.
    assert set(rep["hybrid_vs_best"]) == set(hybrids)
    for row in rep["hybrid_vs_best"].values():
        assert {"all"} <= set(row["tau"]) and row["tau"]["all"]["best"] in ("dlite", "baseline", "prompt_lookup", "suffix")
        assert isinstance(row["ge_best_everywhere"], bool)
        # and by decode time on the same timed turns (the speed worker's, one per timed task)
        assert row["time"]["all"]["ratio"] > 0 and isinstance(row["time_ge_best_everywhere"], bool)
        # 3 timed turns: a paired bootstrap interval of the overall ratio
        assert 0 < row["time"]["all"]["lower_bound"] <= row["time"]["all"]["upper_bound"]
        assert isinstance(row["time_behind"], list)
    assert len(rep["methods"]["dlite"]["task_times"]) == rep["methods"]["dlite"]["speed_tasks"] == 3
    # The training-free twin (lookup + suffix, the same choice, no learned drafter) never
    # runs DLite; the learned hybrid over it is what DLite adds, on the same timed turns.
    assert rep["methods"]["hybrid_free_choose"]["model_ran_share"] == 0
    assert "model" not in (rep["methods"]["hybrid_free_choose"]["by_source"] or {})
    free = rep["learned_over_free"]["hybrid_lookup_suffix_choose"]
    assert free["free"] == "hybrid_free_choose" and free["tau"]["all"]["ratio"] == pytest.approx(
        rep["methods"]["hybrid_lookup_suffix_choose"]["tau"] / rep["methods"]["hybrid_free_choose"]["tau"], abs=1e-4)
    assert free["time"]["all"]["ratio"] > 0 and set(rep["learned_over_free"]) == {"hybrid_lookup_suffix_choose"}
    # The tree's rounds say whether the calibration fitted on validation turns holds on
    # the reported ones: per source, the slots its branches reached, predicted and seen.
    rel = rep["methods"]["hybrid_lookup_suffix_tree"]["calibration_reliability"]
    assert set(rel["all"]) <= {"lookup", "suffix", "model"} and rel["all"]
    for cells in rel["all"].values():
        assert cells["all"]["slots"] > 0 and 0 <= cells["all"]["observed"] <= 1 and 0 < cells["all"]["predicted"] <= 1
    assert "calibration_reliability" not in rep["methods"]["hybrid_lookup_suffix_choose"]  # no branches verified
    assert rep["calibration"]["fitted_on"]["methods"] == ["calib_prompt_lookup", "calib_suffix"]
    assert rep["calibration"]["cost"]["costs"][0] == 1.0 and rep["calibration"]["cost"]["decode_ms"] > 0
    # eval.concurrency: every method batched at 1 and 3 concurrent requests, closed loop
    tp = rep["throughput"]
    assert list(tp["methods"]) == ["plain", "dlite", "baseline", "prompt_lookup", "suffix", *hybrids]
    assert tp["requests"]["n"] == 5 and tp["skipped_methods"] == []
    for name, by in tp["methods"].items():
        assert set(by) == {"1", "3"}
        for c, row in by.items():
            assert row["lossless"] is True and row["requests"] == 5 and row["output_tokens_per_s"] > 0
            assert row["rows_per_step"] <= int(c) and (name == "plain" or row["speedup_vs_plain"] > 0)
    assert tp["methods"]["plain"]["1"]["tau"] == 1.0
    assert tp["goals"]["primary_drafter_bytes_zero"] is True  # DLite: no state per request
    assert all(r["drafter_bytes_per_request"] > 0 for r in tp["methods"]["baseline"].values())  # DSpark's cache
    assert (out.parent / "report-throughput-speedup.png").read_bytes()[:4] == b"\x89PNG"

    from mlflow import MlflowClient
    c = MlflowClient(mlflow_server)
    exp = c.get_experiment_by_name("evaluate-cli")
    (run,) = c.search_runs([exp.experiment_id], "tags.`dlite.stage` = 'evaluate'")
    assert run.info.status == "FINISHED"
    assert run.data.metrics["dlite.greedy.tau"] == pytest.approx(rep["tau"])
    assert "baseline.t1.accept_at_k.1" in run.data.metrics
    assert run.data.metrics["suffix.greedy.tau"] == pytest.approx(rep["methods"]["suffix"]["tau"])
    assert run.data.metrics["hybrid_suffix.lossless"] == 1.0
    assert run.data.metrics["hybrid_lookup_suffix_choose.over_best.tau.all"] == pytest.approx(
        rep["hybrid_vs_best"]["hybrid_lookup_suffix_choose"]["tau"]["all"]["ratio"])
    assert run.data.metrics["hybrid_lookup_suffix_choose.over_best.time.all"] == pytest.approx(
        rep["hybrid_vs_best"]["hybrid_lookup_suffix_choose"]["time"]["all"]["ratio"])
    src = next(iter(rel["all"]))
    assert run.data.metrics[f"hybrid_lookup_suffix_tree.calibration_ratio.{src}"] == pytest.approx(
        rel["all"][src]["all"]["ratio"])
    assert run.data.metrics["hybrid_lookup_suffix_choose.over_best.time_lower_bound.all"] == pytest.approx(
        rep["hybrid_vs_best"]["hybrid_lookup_suffix_choose"]["time"]["all"]["lower_bound"])
    assert run.data.metrics["hybrid_lookup_suffix_choose.over_free.tau.all"] == pytest.approx(free["tau"]["all"]["ratio"])
    assert run.data.metrics["throughput.dlite.c3.tau"] == pytest.approx(tp["methods"]["dlite"]["3"]["tau"])
    arts = {a.path for a in c.list_artifacts(run.info.run_id, "evaluation")}
    assert {"evaluation/report.json", "evaluation/accept_at_k.png", "evaluation/tau_by_bucket.png"} <= arts


@pytest.mark.timeout(900)
def test_throughput_benchmark_batches_every_hybrid(repo_root, tmp_path, tiny_cfg, mlflow_server):
    """`jobs.benchmark throughput` with the three-way choose and tree hybrids: it fits
    their calibration (and measures the cost curve) first, batches both, and every
    request of every method at every concurrency is plain greedy's output."""
    d = _save_random(tiny_cfg, "dlite", tmp_path / "dlite")
    out = tmp_path / "tp" / "throughput.json"
    hybrids = ["hybrid_lookup_suffix_choose", "hybrid_lookup_suffix_tree"]
    r = subprocess.run([sys.executable, "-m", "jobs.benchmark", "throughput", "--config", "configs/experiments/tiny.yaml",
                        "--out", str(out), "--drafter", f"dlite={d}", "--concurrency", "1,3", "--requests", "4",
                        "--min-context", "1", "--max-context", "100000", "eval.max_new_tokens=12",
                        "eval.baselines=[prompt_lookup,suffix]", f"eval.hybrids=[{','.join(hybrids)}]",
                        f"tracking.uri={mlflow_server}", "tracking.experiment=throughput-cli"],
                       cwd=repo_root, capture_output=True, text=True, timeout=800)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    rep = json.loads(out.read_text())
    assert list(rep["methods"]) == ["plain", "dlite", "prompt_lookup", "suffix", *hybrids]
    assert rep["skipped_methods"] == []
    for name, by in rep["methods"].items():
        assert set(by) == {"1", "3"}
        assert all(row["lossless"] is True and row["requests"] == 4 for row in by.values()), name
    cal = rep["calibration"]
    assert cal["fitted_on"]["methods"] == ["calib_prompt_lookup", "calib_suffix"] and cal["cost"]["costs"][0] == 1.0
