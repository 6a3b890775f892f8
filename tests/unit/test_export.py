"""Unit tests for dlite.export: the drafter directory round-trips to identical outputs
for every architecture, stores no frozen target weights, carries its lineage in
config.json and a card, and refuses a target that does not fit."""

import dataclasses
import json

import pytest
import torch
from safetensors import safe_open

from dlite.export import load_drafter, save_drafter
from dlite.models import DrafterConfig, build_drafter

V, HT = 40, 24
CFG = DrafterConfig(gamma=4, target_layer_ids=[0, 1], hidden_size=32, num_layers=2, num_heads=4,
                    num_kv_heads=2, head_dim=8, intermediate_size=64, head_hidden=32, markov_rank=8)
EXTRA = {"target_fingerprint": "tiny-qwen3@abc123", "target_name": "tiny-qwen3",
         "target_layer_ids": [0, 1]}



@pytest.fixture(scope="module")
def vocab():
    g = torch.Generator().manual_seed(0)
    return torch.randn(V, HT, generator=g), torch.randn(V, HT, generator=g)


@pytest.mark.parametrize("arch,head", [("dlite", "gru"), ("dlite", "attn"), ("teacher", "gru"),
                                       ("dspark", "gru")])
def test_round_trip_gives_identical_outputs(tmp_path, vocab, arch, head):
    torch.manual_seed(0)
    model = build_drafter(dataclasses.replace(CFG, arch=arch, head=head), *vocab, V - 1).eval()
    save_drafter(model, tmp_path, EXTRA)
    loaded = load_drafter(tmp_path, *vocab)
    feats = torch.randn(9, 2 * HT)
    a = model.draft(model.new_state(), feats, 3, 9, 0.0)
    b = loaded.draft(loaded.new_state(), feats, 3, 9, 0.0)
    assert torch.equal(a[0], b[0]) and a[1] is None and b[1] is None
    a = model.draft(model.new_state(), feats, 3, 9, 1.0, torch.Generator().manual_seed(1))
    b = loaded.draft(loaded.new_state(), feats, 3, 9, 1.0, torch.Generator().manual_seed(1))
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    batch = {"features": torch.randn(1, 16, 2 * HT), "input_ids": torch.randint(0, V - 1, (1, 16)),
             "anchors": torch.tensor([[3, 8]])}
    assert torch.equal(model.forward_train(batch), loaded.forward_train(batch))
    assert all(p.requires_grad for p in loaded.parameters())


def test_artifact_contents(tmp_path, vocab):
    model = build_drafter(CFG, *vocab, V - 1)
    save_drafter(model, tmp_path, EXTRA, card_sections={"Evaluation": "| tau | 3.1 |"})
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["README.md", "config.json", "model.safetensors"]
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["architecture"] == "dlite" and config["gamma"] == 4
    assert config["target_fingerprint"] == EXTRA["target_fingerprint"]
    assert config["target_layer_ids"] == [0, 1] and config["vocab_size"] == V
    assert config["drafter_config"]["hidden_size"] == 32
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert keys == set(model.state_dict()) and not any("embed" in k or "lm_head" in k for k in keys)
    card = (tmp_path / "README.md").read_text()
    assert "not** stored" in card and "| tau | 3.1 |" in card and EXTRA["target_fingerprint"] in card


def test_refuses_mismatched_target_or_lineage(tmp_path, vocab):
    model = build_drafter(CFG, *vocab, V - 1)
    with pytest.raises(ValueError, match="target_layer_ids"):
        save_drafter(model, tmp_path, {**EXTRA, "target_layer_ids": [3, 4]})
    save_drafter(model, tmp_path, EXTRA)
    with pytest.raises(ValueError, match="do not match"):
        load_drafter(tmp_path, torch.randn(V + 1, HT), torch.randn(V + 1, HT))
