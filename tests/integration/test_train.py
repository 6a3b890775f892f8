"""The training stages on real local Ray Train (2 CPU workers, gloo), real DeepSpeed on
CPU and a real `mlflow server` (the session's `mlflow_server`), over shards collected
from a real target checkpoint (the shipped tiny target when built, else the
random-weight one):

- teacher -> align: the teacher's best drafter is exported and seeds the student; the
  align run (through `jobs.train.main`) loses rank 1 mid-stage, resumes from its
  last checkpoint and ends with exactly the planned steps, logged to MLflow child runs
  of one parent, every step's loss exactly once;
- dspark: the baseline through the same loop, timed against the plain loop
  (engine_overhead), and on 1 worker (ZeRO-1, fp32) computing the same losses as the
  plain loop (same math);
- `anchors` shards train the DLite student (without the teacher) and nothing else;
- bad inputs fail before Ray starts."""

import json
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch

from dlite.config import TINY_TARGET_DIR, load_config

STEPS, EVAL_EVERY = 8, 4


def _target(random_target) -> tuple:
    if (TINY_TARGET_DIR / "config.json").exists() and list(TINY_TARGET_DIR.glob("*.safetensors")):
        return "builtin:tiny", "tiny"
    return random_target, "rand"


@pytest.fixture(scope="module")
def setup(ray_session, random_target, mlflow_server, tmp_path_factory):
    """(overrides, shard dir, MLflow uri): 24 records of 192 tokens, `full` mode."""
    from pipelines.stages.collect import collect
    tmp = tmp_path_factory.mktemp("train")
    path, name = _target(random_target)
    uri = mlflow_server
    over = [f"target.path={path}", f"target.name={name}", "data.n_train=24", "data.max_seq_len=192",
            "data.anchors_per_seq=8", "train.batch_size=2", f"train.steps_teacher={STEPS}",
            f"train.steps_align={STEPS}", f"train.steps_dspark={STEPS}", f"train.eval_every={EVAL_EVERY}",
            "train.zero_stage=2", f"tracking.uri={uri}"]
    cfg = load_config("configs/experiments/tiny.yaml", [*over, "cluster.num_workers=1"])
    collect(cfg, "builtin:train", str(tmp / "shards"))
    return over, str(tmp / "shards"), uri


def _client(uri):
    from mlflow import MlflowClient
    return MlflowClient(tracking_uri=uri)


def _parent_run(uri: str, experiment: str) -> str:
    c = _client(uri)
    exp = c.get_experiment_by_name(experiment)
    exp_id = exp.experiment_id if exp else c.create_experiment(experiment)
    return c.create_run(exp_id, run_name="pipeline").info.run_id


def _load(cfg, out: Path):
    from dlite.export import load_drafter
    from dlite.train.plan import load_vocab
    embed, lm_head, _ = load_vocab(cfg.target)
    meta = json.loads((out / "drafter" / "config.json").read_text())
    return load_drafter(out / "drafter", embed, lm_head), meta


def test_teacher_then_align_survives_a_worker_crash(setup, tmp_path, monkeypatch):
    from pipelines.stages.train import train_stage
    over, shards, uri = setup
    cfg = load_config("configs/experiments/tiny.yaml", over)
    parent = _parent_run(uri, cfg.tracking.experiment)
    teacher = train_stage(cfg, "teacher", shards, str(tmp_path / "teacher"), parent_run_id=parent)
    assert teacher["steps"] == STEPS and teacher["final"]["global_steps"] == STEPS
    model, meta = _load(cfg, tmp_path / "teacher")
    assert model.cfg.arch == "teacher" and meta["stage"] == "teacher"
    assert meta["val_tau"] == teacher["best"]["val_tau"] >= teacher["final"]["val_tau"] - 1e-9

    # The align job, through its command line; rank 1 exits after step 5.
    monkeypatch.setenv("DLITE_TRAIN_CRASH_AT_STEP", "5")
    from jobs.train import main
    assert main(["--config", "configs/experiments/tiny.yaml", "--stage", "align", "--input", shards, "--output", str(tmp_path / "align"),
                 "--teacher", str(tmp_path / "teacher"), "--parent-run-id", parent, *over,
                 "train.max_failures=1"]) == 0
    assert (tmp_path / "align" / ".crash-marker").exists()  # rank 1 did die once
    done = json.loads((tmp_path / "align" / "train.json").read_text())
    assert done["steps"] == STEPS and done["final"]["global_steps"] == STEPS  # not one step more
    student, meta = _load(cfg, tmp_path / "align")
    assert student.cfg.arch == "dlite" and meta["val_tau"] == done["best"]["val_tau"]
    _check_shared_validation(cfg, shards, student, done["best"])
    _check_tracking(uri, parent, done["run_id"])
    again = train_stage(cfg, "align", shards, str(tmp_path / "align"), teacher=str(tmp_path / "teacher"))
    assert again == done  # finished: returned as is, nothing retrained


def _check_shared_validation(cfg, shards: str, model, best: dict) -> None:
    """The 2 ranks split each validation (batches and replay-walk rows) and all-reduce the
    totals: the figures the stage recorded for its best checkpoint are those of one
    process scoring every row with that checkpoint's drafter."""
    from dlite.data.shards import read_manifest
    from dlite.train.plan import heldout_rows, val_batches
    from dlite.train.step import validate
    from pipelines.stages.train_inputs import split_inputs
    rows = heldout_rows(**split_inputs(cfg, shards, None, read_manifest(shards)).val)
    assert len(rows) >= 2  # at least one row for each rank to walk
    got = validate(model, val_batches(rows, cfg.train.batch_size), cfg.eval.draft_stop_prob, rows)
    for k in ("val_tau", "val_loss", "val_tau_greedy", "val_tau_replay"):
        assert got[k] == pytest.approx(best[k], rel=1e-5), k


def _check_tracking(uri: str, parent: str, align_run: str) -> None:
    """One child run per stage; the align run resumed from step 4 (its last checkpoint
    is after step 3), not from scratch, and logged every step's loss exactly once
    (log_every=1): steps 4-5, trained before the crash and again after it, are logged
    from one of the two passes only."""
    c = _client(uri)
    exp = c.get_run(parent).info.experiment_id
    children = c.search_runs([exp], f"tags.mlflow.parentRunId = '{parent}'")
    assert sorted(r.data.tags["dlite.stage"] for r in children) == ["align", "teacher"]
    assert all(r.info.status == "FINISHED" for r in children)
    steps = sorted(m.step for m in c.get_metric_history(align_run, "loss"))
    assert steps == list(range(STEPS)), Counter(steps)
    run = c.get_run(align_run)
    for key in ("loss_at_k_1", "lr", "tokens_per_s", "samples_per_s", "val_tau", "val_accept_at_k_1"):
        assert key in run.data.metrics, key
    distil = {m.step: m.value for m in c.get_metric_history(align_run, "distilling")}
    assert [distil[s] for s in range(STEPS)] == [1.0] * (STEPS // 2) + [0.0] * (STEPS // 2)
    assert run.data.params["train.steps_align"] == str(STEPS)


def test_dspark_same_math_and_engine_overhead(setup, tmp_path):
    from pipelines.benchmarks.train import engine_overhead
    over, shards, _ = setup
    cfg = load_config("configs/experiments/tiny.yaml", over)
    report = engine_overhead(cfg, shards, tmp_path, stage="dspark")
    (tmp_path / "train_bench.json").write_text(json.dumps(report, indent=2))
    print(json.dumps({k: v for k, v in report.items() if k not in ("config", "env")}, indent=2))
    sm = report["same_math"]
    assert sm["ok"], sm
    assert sm["loss_rel_diff"] <= sm["rtol"] and sm["val_loss_rel_diff"] <= sm["rtol"]
    assert 0 < report["engine_overhead"] < 50 and report["samples_per_s_plain"] > 0
    assert report["workers"] == 2 and len(report["samples_per_s_plain_runs"]) == 2
    assert len(report["samples_per_s_parallel_plain"]) == 2 and report["engine_overhead_cpu"] > 0


def test_bad_inputs_fail_before_ray(setup, tmp_path, random_target):
    from dlite.data.shards import ShardError
    from pipelines.stages.train_inputs import TrainError
    from pipelines.stages.train import train_stage
    over, shards, _ = setup
    cfg = load_config("configs/experiments/tiny.yaml", over)
    with pytest.raises(TrainError, match="--teacher"):
        train_stage(cfg, "align", shards, str(tmp_path / "a"))
    with pytest.raises(TrainError, match="train.batch_size"):
        train_stage(load_config("configs/experiments/tiny.yaml", [*over, "train.batch_size=64"]),
                    "dspark", shards, str(tmp_path / "b"))
    other = tmp_path / "other_target"
    shutil.copytree(random_target, other)
    (other / "config.json").write_text((other / "config.json").read_text() + "\n")  # new fingerprint
    with pytest.raises(ShardError, match="recollect"):
        train_stage(load_config("configs/experiments/tiny.yaml", [*over, f"target.path={other}"]),
                    "teacher", shards, str(tmp_path / "c"))
    assert not any((tmp_path / d).exists() for d in ("a", "b", "c"))


def test_anchor_shards_train_the_student_only(setup, tmp_path):
    """An `anchors` collection (features at the anchors only) trains the DLite student
    against the target through Ray Train + DeepSpeed; the teacher stage refuses it
    before Ray, naming the storage mode and the way out."""
    from pipelines.stages.collect import collect
    from pipelines.stages.train_inputs import TrainError
    from pipelines.stages.train import train_stage
    over, _, _ = setup
    over = [*over, "data.n_train=8", "cluster.num_workers=1", "train.steps_align=3", "train.eval_every=0"]
    cfg = load_config("configs/experiments/tiny.yaml", [*over, "data.storage_mode=anchors"])
    collect(cfg, "builtin:train", str(tmp_path / "anchors"))
    with pytest.raises(TrainError, match="storage_mode 'anchors'.*data.storage_mode=full"):
        train_stage(cfg, "teacher", str(tmp_path / "anchors"), str(tmp_path / "t"))
    every = load_config("configs/experiments/tiny.yaml", [*over, "train.skip_teacher=true", "train.supervise=all"])
    with pytest.raises(TrainError, match="train.supervise='all'.*data.storage_mode=full"):
        train_stage(every, "align", str(tmp_path / "anchors"), str(tmp_path / "e"))
    assert not (tmp_path / "e").exists()
    skip = load_config("configs/experiments/tiny.yaml", [*over, "train.skip_teacher=true"])
    done = train_stage(skip, "align", str(tmp_path / "anchors"), str(tmp_path / "a"))
    assert done["final"]["global_steps"] == 3 and 1.0 <= done["best"]["val_tau"] <= 8.0
    model, meta = _load(skip, tmp_path / "a")
    assert model.cfg.arch == "dlite" and meta["skip_teacher"] is True


def test_published_design_and_recipe_through_the_stages(setup, tmp_path):
    """The published design's own teacher (a dlite_v1 with a 512-window history) through
    the teacher stage, then the published recipe's align stage on Ray Train + DeepSpeed
    ZeRO-2: all steps stage 1 (KL, head copied and frozen) leaves the student's head
    exactly the teacher's -- no optimizer or weight-decay drift under ZeRO -- while the
    rest of the student is its own (from scratch, not the teacher's weights)."""
    from pipelines.stages.train import train_stage
    over, shards, _ = setup
    v1 = [*over, "cluster.num_workers=1", "drafter.arch=dlite_v1", "drafter.sequential_rank=32",
          "drafter.history_window=512", "train.steps_align=3", "train.eval_every=0", "train.recipe=published",
          "train.distill_frac=1.0", "train.blend_frac=0.0", "train.loss_decay=null"]
    cfg = load_config("configs/experiments/tiny.yaml", v1)
    train_stage(cfg, "teacher", shards, str(tmp_path / "teacher"))
    teacher, meta = _load(cfg, tmp_path / "teacher")
    assert (teacher.cfg.arch, teacher.cfg.v1_teacher, teacher.cfg.history_window) == ("dlite_v1", True, 512)
    done = train_stage(cfg, "align", shards, str(tmp_path / "align"), teacher=str(tmp_path / "teacher"))
    assert done["final"]["global_steps"] == 3 and done["final"]["teacher_share"] == 1.0
    student, _ = _load(cfg, tmp_path / "align")
    assert student.cfg.arch == "dlite_v1" and not student.cfg.v1_teacher
    s, t = student.state_dict(), teacher.state_dict()
    head = [n for n in s if n.startswith("sequential_head.")]
    assert head and all(torch.equal(s[n], t[n].to(s[n].dtype)) for n in head)
    assert not torch.equal(s["layer_depth_embedding.weight"], t["layer_depth_embedding.weight"])


def test_jobs_train_dry_run(repo_root, tmp_path):
    p = subprocess.run([sys.executable, "-m", "jobs.train", "--config", "configs/experiments/tiny.yaml", "--dry-run", "--stage", "dspark", "--input",
                        "x", "--output", str(tmp_path / "o")], cwd=repo_root, capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 0 and "dspark" in p.stdout and not (tmp_path / "o").exists()


def test_engine_settings_come_from_our_config():
    from omegaconf import OmegaConf
    from pipelines.stages.engine import EngineSettings, ds_config, resolve
    cfg = load_config("configs/experiments/tiny.yaml", ["train.batch_size=3", "train.grad_accum=2",
                                                        "train.zero_stage=2", "train.grad_clip=0.5"])
    s = resolve(cfg.train, on_gpu=False)
    assert (s.zero_stage, s.precision) == (2, "fp32")
    d = ds_config(cfg.train, s, world_size=4)
    assert (d["train_batch_size"], d["zero_optimization"]["stage"], d["gradient_clipping"]) == (24, 2, 0.5)
    auto = OmegaConf.create({"zero_stage": None, "precision": None})
    assert resolve(auto, on_gpu=True) == EngineSettings(2, "bf16")
    assert resolve(auto, on_gpu=False) == EngineSettings(0, "fp32")


def test_cpu_training_skips_deepspeeds_shm_comm_kernel():
    """Training all-reduces through torch.distributed; DeepSpeed's shared-memory kernel
    (JIT-built once per venv, ~50 s here) serves only its tensor-parallel inference, so
    the CPU engine tells DeepSpeed's backend not to build it."""
    import deepspeed
    from deepspeed.comm.torch import build_shm_op
    from pipelines.stages.engine import _skip_shm_comm_build
    _skip_shm_comm_build()
    assert deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] is False
    assert build_shm_op() is None
