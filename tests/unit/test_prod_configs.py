"""The production experiments (Qwen3-4B / 8B on SWE trajectories, H800 x 8 x 2): they
compose and validate without weights or network, carry the published DLite design at
the released drafters' shapes and the published training recipe, read their locations
from the environment, and the main job's `--dry-run` accepts them."""

import json
import os
import subprocess
import sys

import pytest
import torch
from omegaconf import OmegaConf

from dlite.config import ConfigError, load_config
from dlite.models import build_drafter, param_count
from dlite.models.dlite_v1 import published_layer_ids

PROD = {"qwen3_4b": "configs/experiments/qwen3_4b_swe.yaml",
        "qwen3_8b": "configs/experiments/qwen3_8b_swe.yaml"}
# target hidden size and the published drafter size (DLITE.md §6), in parameters
SHAPES = {"qwen3_4b": (2560, 0.6e9), "qwen3_8b": (4096, 1.0e9)}
QWEN3_VOCAB = 151936
ENV_KEYS = ("DLITE_TARGET_PATH", "DLITE_TRAIN_DATA", "DLITE_HELDOUT_DATA", "DLITE_OUTPUT_DIR",
            "DLITE_STORAGE_URI")
FAKE_MLFLOW = "http://mlflow.invalid:5000"


@pytest.fixture
def clean_env(monkeypatch):
    """No DLITE_* location variables, a tracking server that is never contacted."""
    for k in [k for k in os.environ if k.startswith("DLITE_")]:
        monkeypatch.delenv(k)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", FAKE_MLFLOW)
    return monkeypatch


@pytest.mark.parametrize("name", sorted(PROD))
def test_recipe(name, clean_env):
    cfg = load_config(PROD[name])
    d, t = cfg.drafter, cfg.target
    assert d.arch == "dlite_v1" and d.gamma == 7  # block 8, as the released drafters
    assert list(d.target_layer_ids) == published_layer_ids(36, 7) and t.num_layers == 36
    assert t.hidden_size == SHAPES[name][0] == d.hidden_size  # 5 layers at the target's width
    assert (d.num_layers, d.anchor_group_size, d.sequential_rank, d.markov_rank) == (5, 2, 256, 256)
    assert d.draft_vocab_size is None and d.history_window == 512  # their 512-token teacher window
    r = cfg.train
    assert (r.recipe, r.kl_weight, r.ce_weight, r.tv_weight, r.loss_decay, r.ce_labels) == \
        ("published", 1.0, 1.0, 1.0, None, "target_argmax")
    assert r.distill_frac > 0 and r.blend_frac > 0 and not r.skip_teacher
    assert (cfg.train.zero_stage, cfg.train.precision) == (2, "bf16")
    assert cfg.train.lr == pytest.approx(6e-4) and cfg.train.warmup_frac == pytest.approx(0.04)
    assert (cfg.data.max_seq_len, cfg.data.anchors_per_seq) == (4096, 512)
    assert cfg.data.regenerate and cfg.data.train_path.startswith("s3://")
    assert cfg.gate.min_tau >= 2.0 and cfg.gate.min_speedup > 1.0


@pytest.mark.parametrize("name", sorted(PROD))
def test_cluster_storage_and_tracking(name, clean_env):
    cfg = load_config(PROD[name])
    c = cfg.cluster
    assert (c.num_workers, c.gpus_per_worker, c.backend, c.accelerator) == (16, 1, "nccl", "gpu")
    assert c.use_gpu and c.address == "auto"
    assert c.storage_uri.startswith("s3://")
    assert cfg.tracking.uri == FAKE_MLFLOW
    short = name.replace("_", "-")
    assert cfg.tracking.experiment == f"dlite-{short}" == cfg.tracking.registered_model


@pytest.mark.parametrize("name", sorted(PROD))
def test_locations_come_from_the_environment(name, clean_env, tmp_path):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    hidden = SHAPES[name][0]
    (ckpt / "config.json").write_text(json.dumps({"num_hidden_layers": 36, "hidden_size": hidden}))
    env = {"DLITE_TARGET_PATH": str(ckpt), "DLITE_TRAIN_DATA": "s3://b/train/",
           "DLITE_HELDOUT_DATA": "/d/heldout.jsonl", "DLITE_OUTPUT_DIR": "/nfs/runs",
           "DLITE_STORAGE_URI": "s3://b/runs"}
    for k, v in env.items():
        clean_env.setenv(k, v)
    cfg = load_config(PROD[name])
    got = (cfg.target.path, cfg.data.train_path, cfg.data.heldout_path, cfg.run.output_dir,
           cfg.cluster.storage_uri)
    assert got == tuple(env[k] for k in ENV_KEYS)


@pytest.mark.parametrize("name", sorted(PROD))
def test_mounted_checkpoint_of_another_size_is_refused(name, clean_env, tmp_path):
    # The explicit hidden_size is what catches a 4B config pointed at an 8B checkpoint.
    other = {2560: 4096, 4096: 2560}[SHAPES[name][0]]
    (tmp_path / "config.json").write_text(
        json.dumps({"num_hidden_layers": 36, "hidden_size": other}))
    clean_env.setenv("DLITE_TARGET_PATH", str(tmp_path))
    with pytest.raises(ConfigError, match=r"^target\.hidden_size: .*config\.json says"):
        load_config(PROD[name])


@pytest.mark.parametrize("name", sorted(PROD))
def test_drafter_size_near_published(name, clean_env):
    cfg = load_config(PROD[name])
    dcfg = OmegaConf.to_object(cfg.drafter)
    with torch.device("meta"):  # shapes only: no memory, no weights
        vocab_w = torch.empty(QWEN3_VOCAB, cfg.target.hidden_size)
        ids = torch.arange(dcfg.draft_vocab_size, device="cpu") if dcfg.draft_vocab_size else None
        norm = {"final_norm_weight": torch.empty(cfg.target.hidden_size)} if dcfg.arch == "dlite_v1" else {}
        n = param_count(build_drafter(dcfg, vocab_w, vocab_w, QWEN3_VOCAB - 1, draft_vocab=ids, **norm))
    published = SHAPES[name][1]
    assert abs(n - published) / published < 0.15, f"{name}: {n / 1e9:.3f}B parameters"


def test_the_two_recipes_differ_only_in_model_and_names(clean_env):
    a, b = (OmegaConf.to_container(load_config(PROD[k])) for k in sorted(PROD))
    for cfg in (a, b):
        for key in ("target", "drafter", "tracking"):
            cfg.pop(key)
        cfg["run"].pop("name")
        cfg["cluster"].pop("storage_uri")
    assert a == b


@pytest.mark.parametrize("name", sorted(PROD))
def test_pipeline_dry_run(name, repo_root, tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("DLITE_")}
    env["MLFLOW_TRACKING_URI"] = FAKE_MLFLOW
    out = tmp_path / "runs"
    r = subprocess.run([sys.executable, "-m", "jobs.pipeline", "--config", PROD[name],
                        "--dry-run", f"run.output_dir={out}"],
                       cwd=repo_root, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert f"{name}_swe" in r.stdout
    assert not out.exists() or not any(out.iterdir()), "a dry run must not write anything"
