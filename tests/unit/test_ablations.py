"""The quality benchmark's ablation switches: names checked before any work, each
ablation's config = the benchmark's plus exactly its overrides (DLite stages only)."""

import pytest

from dlite.config import load_config
from pipelines.benchmarks import ablations
from pipelines.benchmarks.quality import bench_config


def test_parse_names():
    assert ablations.parse("all") == list(ablations.ABLATIONS)
    assert ablations.parse("head_none, window_4096") == ["head_none", "window_4096"]
    with pytest.raises(ValueError, match="nope"):
        ablations.parse("head_none,nope")


@pytest.mark.parametrize("name", list(ablations.ABLATIONS))
def test_ablation_config_changes_only_its_switch(name):
    cfg = load_config("configs/experiments/tiny.yaml")
    acfg = ablations.ablation_config(cfg, name, 1536)
    base = bench_config(cfg, 1536)
    over = ablations.ABLATIONS[name][0]
    assert list(acfg.run.stages) == ["collect", "teacher", "align", "evaluate"]
    assert list(acfg.eval.temperatures) == [0.0] and acfg.eval.speed_trajectories == 1
    assert acfg.data.max_seq_len == over.get("window", 1536)
    from omegaconf import OmegaConf
    for key, value in over.items():
        if key != "window":
            assert OmegaConf.select(acfg, key) == value and OmegaConf.select(base, key) != value
    # Everything the benchmark fixes stays: held-out lengths, budget, split policy.
    for key in ("eval.min_chars", "eval.max_chars", "eval.turn_pick", "train.steps_teacher",
                "train.steps_align", "data.length_policy", "drafter.gamma"):
        assert OmegaConf.select(acfg, key) == OmegaConf.select(base, key), key
