"""`python -m jobs.benchmark` as a user runs it: the draft-cost report has the DLITE.md
§4 metric names for both drafters and the published-shape parameter counts; the train
report has the engine overhead, a passing same-math check and the teacher ablation."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from tests.report_checks import check_figures


def _ratio(a, b):
    return None if a is None or not b else round(a / b, 4)


def test_draft_cost_report(repo_root, tmp_path):
    out = tmp_path / "draft_cost.json"
    r = subprocess.run([sys.executable, "-m", "jobs.benchmark", "draft_cost", "--out", str(out),
                        "--config", "configs/experiments/tiny.yaml",
                        "--rounds", "4", "--context-lengths", "64", "512"],
                       cwd=repo_root, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    rep = json.loads(out.read_text())
    assert set(rep["draft_ms"]) == {"dlite", "dspark"}
    assert set(rep["draft_ms"]["dlite"]) == {"64", "512"}
    assert rep["draft_cache_bytes"]["dlite"] == {"64": 0, "512": 0}
    assert rep["draft_cache_bytes"]["dspark"]["512"] > rep["draft_cache_bytes"]["dspark"]["64"]
    counts = rep["param_counts"]
    assert 0.4e9 < counts["dlite_qwen3_4b"]["trainable_params"] < 0.8e9
    assert rep["config"]["run"]["drafter"]["gamma"] == 7


def test_unknown_benchmark_is_refused(repo_root):
    r = subprocess.run([sys.executable, "-m", "jobs.benchmark", "nope"], cwd=repo_root,
                       capture_output=True, text=True)
    assert r.returncode == 2 and "usage" in r.stderr


@pytest.mark.timeout(2700)  # 7 Ray Train runs: over the suite's 900 s on a loaded machine
def test_train_report(repo_root, tmp_path):
    """The whole `train` benchmark at its smallest: 8 records of <=256 tokens, 3 steps
    per run, so each of its 7 training runs is mostly Ray start-up."""
    out = tmp_path / "train.json"
    sizes = ["data.n_train=8", "data.n_heldout=1", "data.max_seq_len=256", "train.batch_size=2",
             "train.steps_teacher=3", "train.steps_align=3", "train.steps_dspark=3", "train.eval_every=0"]
    r = subprocess.run([sys.executable, "-m", "jobs.benchmark", "train", "--config", "configs/experiments/tiny.yaml", "--out", str(out),
                        "--work-dir", str(tmp_path / "work"), *sizes],
                       cwd=repo_root, capture_output=True, text=True, timeout=2700)
    assert r.returncode == 0, r.stderr[-3000:]
    rep = json.loads(out.read_text())
    assert {"engine_overhead", "same_math", "teacher_ablation", "config", "env"} <= set(rep)
    assert rep["same_math"]["ok"], rep["same_math"]
    sm = rep["same_math"]
    for k in ("loss", "val_loss"):
        a, b = sm[f"{k}_plain"], sm[f"{k}_engine"]
        assert sm[f"{k}_rel_diff"] == pytest.approx(abs(a - b) / max(abs(a), abs(b)))
    # The overhead figures are the ratios of the rates they are built from: the plain
    # reference is the mean of its two runs, the engine's rate is per worker.
    runs, par = rep["samples_per_s_plain_runs"], rep["samples_per_s_parallel_plain"]
    solo, worker = sum(runs) / len(runs), rep["samples_per_s_per_worker"]
    assert rep["workers"] == 2 and len(runs) == 2 and len(par) == 2 and min(runs) > 0
    assert rep["samples_per_s_plain"] == pytest.approx(solo)
    assert rep["engine_overhead"] == pytest.approx(solo / worker)
    assert rep["samples_per_s_total"] == pytest.approx(2 * worker)
    assert rep["parallel_plain_share"] == pytest.approx(solo / (sum(par) / 2))
    assert rep["engine_overhead_vs_parallel_plain"] == pytest.approx(sum(par) / 2 / worker)
    ab = rep["teacher_ablation"]
    assert (ab["with_teacher"]["steps"], ab["no_teacher_same_student_steps"]["steps"],
            ab["no_teacher_same_total_steps"]["steps"], ab["teacher"]["steps"]) == (3, 3, 6, 3)
    for arm in ("teacher", "with_teacher", "no_teacher_same_student_steps", "no_teacher_same_total_steps"):
        # eval_every=0: one validation, at the last step, so the best checkpoint is the last
        assert ab[arm]["val_tau_best"] == pytest.approx(ab[arm]["val_tau_last"]), arm
    for other in ("same_student_steps", "same_total_steps"):
        want = ab["with_teacher"]["val_tau_best"] - ab[f"no_teacher_{other}"]["val_tau_best"]
        assert ab[f"delta_val_tau_vs_{other}"] == pytest.approx(want)
    assert rep["config"]["data"]["n_train"] == 8 and rep["env"]["deepspeed"]
    # The stages' MLflow runs went to the work dir's store, not the repo's default one.
    assert (tmp_path / "work" / "mlflow.db").is_file()


@pytest.mark.timeout(2700)  # 6 DAG stages + an ablation's align and evaluate, each starting Ray
def test_quality_report_with_an_ablation(repo_root, tmp_path, smoke_pipeline):
    """The headline benchmark at smoke size, held-out histories kept short: every
    method's DLITE.md §4 metrics, the same step budget, the plots, and one ablation that
    changes alignment only (so it reuses the benchmark's collection and teacher)."""
    out = tmp_path / "quality.json"
    sizes = [*smoke_pipeline, "eval.n_trajectories=1", "eval.min_chars=3000", "eval.max_chars=6000",
             f"run.output_dir={tmp_path / 'runs'}", f"tracking.uri=sqlite:///{tmp_path / 'mlflow.db'}"]
    r = subprocess.run([sys.executable, "-m", "jobs.benchmark", "quality", "--config", "configs/experiments/tiny.yaml", "--out", str(out),
                        "--budget", "8", "--ablations", "distill_none",
                        "--prompts", "tests/fixtures/prompts.jsonl", "--n-prompts", "2", *sizes],
                       cwd=repo_root, capture_output=True, text=True, timeout=2700)
    assert r.returncode == 0, r.stderr[-3000:]
    rep = json.loads(out.read_text())
    assert set(rep["methods"]) == {"dlite", "dlite_no_teacher", "dspark"} and rep["lossless"] is True
    for name, m in rep["methods"].items():
        for key in ("tau", "accept_at_k", "tau_by_bucket", "speedup_vs_ar", "draft_ms_by_bucket",
                    "draft_cache_bytes_by_bucket"):
            assert m.get(key) is not None, (name, key)
        assert len(m["accept_at_k"]) == 7 and set(m["by_temperature"]) == {"0.0", "1.0"}
        assert m["lossless"] is True and m["n_tokens"]["spec"] == m["n_tokens"]["plain"] > 0
        for r in m["by_temperature"].values():
            check_figures(r)
    assert rep["steps"] == {"teacher": 4, "align": 4, "align_no_teacher": 8, "dspark": 8}
    cmp = rep["comparison"]
    cache = cmp["draft_cache_bytes_by_bucket"]
    assert all(v == 0 for v in cache["dlite"].values()) and all(v > 0 for v in cache["dspark"].values())
    # The ratios and goals are the comparisons they claim, recomputed from the report.
    dl, ds, nt = (rep["methods"][n] for n in ("dlite", "dspark", "dlite_no_teacher"))
    by = cmp["dlite_over_dspark_tau_by_bucket"]
    assert by == {b: _ratio(v, ds["tau_by_bucket"].get(b)) for b, v in dl["tau_by_bucket"].items()}
    longest = [b for b in rep["bucket_labels"] if b in by][-1]
    assert cmp["longest_bucket"] == longest
    assert cmp["goal_long_tau_ratio_ge_1_3"] == ((by[longest] or 0) >= 1.3)
    short = [b for b in ("<1K",) if b in by]  # buckets wholly inside the 1536-token window
    assert cmp["goal_short_tau_ratio_ge_0_97"] == (all((by[b] or 0) >= 0.97 for b in short) if short else None)
    assert cmp["goal_speedup_ge_1_5"] == (dl["speedup_vs_ar"] >= 1.5) and rep["training_window"] == 1536
    assert cmp["teacher_effect_tau"] == _ratio(dl["tau"], nt["tau"])
    assert cmp["goal_teacher_effect_ge_1"] == (cmp["teacher_effect_tau"] >= 1.0)
    step_ms = 1000.0 / dl["tokens_per_s"]["plain"]
    assert cmp["draft_over_target_step"]["dlite"] == pytest.approx(dl["time_split"]["draft_ms"] / step_ms, abs=1e-4)
    assert cmp["draft_vocab_coverage"]["dlite"] == dl["draft_vocab_coverage"]
    # In-training estimate next to the held-out figure, per learned method.
    for stage, name in (("align", "dlite"), ("align_no_teacher", "dlite_no_teacher"), ("dspark", "dspark")):
        v = rep["val_vs_heldout"][name]
        assert (v["val_tau"], v["heldout_tau"]) == (rep["best_val_tau"][stage], rep["methods"][name]["tau"])
        assert v["val_over_heldout"] == _ratio(v["val_tau"], v["heldout_tau"])
        assert v["val_tau_greedy"] == rep["best_val_tau_greedy"][stage]
        assert v["greedy_over_heldout"] == _ratio(v["val_tau_greedy"], v["heldout_tau"])
        assert v["val_tau_replay"] == rep["best_val_tau_replay"][stage]
        assert v["replay_over_heldout"] == _ratio(v["val_tau_replay"], v["heldout_tau"])
    # The same drafters on prompts nobody here wrote: 2 of the 3 in the file, answered by the target.
    pr = rep["prompts"]
    assert pr["n_prompts"] == 2 and set(pr["methods"]) == set(rep["methods"])
    assert len(Path(pr["sample"]).read_text().splitlines()) == 2
    assert all(m["lossless"] is True and m["n_rounds"] > 0 for m in pr["methods"].values())
    probe = rep["target_by_bucket"]
    assert probe and set(probe) <= set(rep["bucket_labels"])
    assert all(b["tokens"] > 0 and 0 <= b["next_token_acc"] <= 1 for b in probe.values())
    for png in ("tau_by_bucket", "accept_at_k", "tau_vs_context", "ablations_tau_by_bucket"):
        assert (tmp_path / f"quality-{png}.png").stat().st_size > 1000, png
    ab = rep["ablations"]
    row = ab["rows"]["distill_none"]
    assert row["overrides"] == {"train.distill_frac": 0.0} and row["lossless"] is True
    assert row["tau_over_dlite"] == _ratio(row["tau"], dl["tau"])
    val = ab["val_tau_align"]
    assert val == {"dlite (benchmark)": rep["best_val_tau"]["align"], "distill_none": row["best_val_tau"]["align"]}
    assert ab["chosen_by_validation"] == max(val, key=val.get)
    assert row["reused"] == ["collect", "teacher"]  # only alignment changed
    stages = tmp_path / "runs" / "stages"
    assert len(list(stages.glob("teacher-*"))) == 1 and len(list(stages.glob("collect-*"))) == 1
    assert len(list(stages.glob("align-*"))) == 2 and row["stage_dirs"]["teacher"].startswith(str(stages))
    import mlflow
    c = mlflow.MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    parent = c.get_run(rep["mlflow_run"])
    assert parent.data.metrics["ablation.distill_none.tau"] == pytest.approx(row["tau"])
    assert c.get_run(row["mlflow_run"]).data.tags["mlflow.parentRunId"] == rep["mlflow_run"]
