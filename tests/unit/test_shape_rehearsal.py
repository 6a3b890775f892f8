"""The shape rehearsal (`dlite.bench.shape_rehearsal`) at a toy size: the same code
path as the Qwen3-4B run (capture, one bf16 train step, one speculative round, export
round trip, memory figures), shrunk through its arguments so it cannot rot unnoticed."""

import dataclasses
import json

import pytest
import torch

from dlite.bench.draft_cost import CONFIG_DIR, load_drafter_yaml
from dlite.bench.shape_rehearsal import map_layer_ids, run


def test_layer_ids_map_by_relative_depth():
    assert map_layer_ids([1, 9, 17, 25, 33], 36, 2) == [0, 0, 0, 1, 1]
    assert map_layer_ids([1, 9, 17, 25, 33], 36, 36) == [1, 9, 17, 25, 33]


def test_rehearsal_at_a_toy_shape():
    # the production yaml, shrunk: same arch, head, gamma, layer ids, draft vocabulary
    cfg = dataclasses.replace(load_drafter_yaml(CONFIG_DIR / "dlite_qwen3_4b.yaml"), hidden_size=64,
                              num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                              intermediate_size=96, head_hidden=32, draft_vocab_size=256)
    shape = dict(vocab_size=1024, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16)
    out = run(seq_len=96, anchors=8, layers=2, threads=1, drafter_cfg=cfg, target_shape=shape)
    json.dumps(out)  # written as a JSON report as is
    assert out["layer_map"]["used"] == [0, 0, 0, 1, 1] and out["shapes"]["anchors_sampled"] == 8
    assert out["train"]["finite"] and out["train"]["stepped"]
    mem, train = out["memory_arithmetic_bytes"], out["train"]
    assert mem["params"] == out["params"]["drafter_trainable"] and out["params"]["vocab_shared_with_target"]
    assert train["grad_bytes"] == mem["grads"] and train["optimizer_state_bytes"] == mem["adamw_states_here"]
    d = out["draft"]
    assert d["drafted"] == cfg.gamma and d["valid_ids"] and 0 <= d["accepted"] <= cfg.gamma
    assert out["export"]["bitwise_equal"]
    assert out["export"]["dtypes"] == [str(torch.bfloat16), str(torch.int64)]  # weights, draft ids
    phases = {"build_target", "capture_features", "build_drafter", "train_step", "draft_round",
              "export_reload"}
    assert set(out["seconds"]) == set(out["rss_peak_bytes"]) == phases
    assert all(v > 0 for v in out["rss_peak_bytes"].values())


def test_rehearsal_of_the_published_design_at_a_toy_shape():
    """The released drafters' design (configs/drafter/dlite_v1_qwen3_4b.yaml), shrunk:
    its 7 context slots keep a target of at least 7 layers, the published selection
    over those, the target's final norm, the full vocabulary."""
    cfg = dataclasses.replace(load_drafter_yaml(CONFIG_DIR / "dlite_v1_qwen3_4b.yaml"), hidden_size=64,
                              num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                              intermediate_size=96, sequential_rank=16)
    shape = dict(vocab_size=1024, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16)
    out = run(seq_len=96, anchors=8, layers=2, threads=1, drafter_cfg=cfg, target_shape=shape)
    assert out["layer_map"]["used"] == list(range(7)) and out["layer_map"]["of_layers_here"] == 7
    assert out["train"]["finite"] and out["train"]["stepped"]
    assert out["draft"]["drafted"] == cfg.gamma and out["draft"]["valid_ids"]
    assert out["export"]["bitwise_equal"] and out["shapes"]["drafter"]["arch"] == "dlite_v1"


def test_each_production_drafter_is_rehearsed_against_its_own_qwen3():
    """The 8B yamls (both designs) get Qwen3-8B's shape (4096 wide, untied lm_head), the
    4B ones Qwen3-4B's; a width no Qwen3 here has is refused naming the key."""
    from dlite.bench.shape_rehearsal import QWEN3_4B, target_shape_for
    for name in ("dlite_qwen3_8b", "dlite_v1_qwen3_8b"):
        shape = target_shape_for(load_drafter_yaml(CONFIG_DIR / f"{name}.yaml"))
        assert shape["hidden_size"] == 4096 and shape["intermediate_size"] == 12288
        assert shape["tie_word_embeddings"] is False and shape["vocab_size"] == QWEN3_4B["vocab_size"]
    for name in ("dlite_qwen3_4b", "dlite_v1_qwen3_4b"):
        assert target_shape_for(load_drafter_yaml(CONFIG_DIR / f"{name}.yaml")) is QWEN3_4B
    toy = dataclasses.replace(load_drafter_yaml(CONFIG_DIR / "dlite_qwen3_4b.yaml"), hidden_size=64)
    with pytest.raises(ValueError, match="drafter.hidden_size"):
        target_shape_for(toy)
