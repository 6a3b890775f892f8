"""Unit tests for dlite.export: the drafter directory round-trips to identical outputs
for every architecture, stores no frozen target weights, carries its lineage in
config.json and a card, and refuses a target that does not fit; `check_artifact` refuses
a truncated, altered or incomplete directory and a drafter of another target in one
line naming the file (or both fingerprints), and still accepts a format 1 directory. A
SpecForge DFlash export is checked, loaded and drafts; one our replay cannot run, and a
layout nobody reads, are refused in one line (the latter listing the known layouts)."""

import dataclasses
import hashlib
import json

import pytest
import torch
from safetensors import safe_open

from dlite.export import FORMAT_VERSION, ArtifactError, check_artifact, load_drafter, save_drafter
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


@pytest.fixture
def artifact(tmp_path, vocab):
    torch.manual_seed(0)
    return save_drafter(build_drafter(CFG, *vocab, V - 1), tmp_path / "drafter", EXTRA)


def refused(path, match: str, fingerprint=None) -> str:
    with pytest.raises(ArtifactError, match=match) as e:
        check_artifact(path, fingerprint)
    assert "\n" not in str(e.value)  # one line for the job's stderr
    return str(e.value)


def test_checksums_recorded_and_checked(artifact):
    config = json.loads((artifact / "config.json").read_text())
    weights = (artifact / "model.safetensors").read_bytes()
    assert config["format_version"] == FORMAT_VERSION == 2
    assert config["files"] == {"model.safetensors": {"sha256": hashlib.sha256(weights).hexdigest(),
                                                     "bytes": len(weights)}}
    assert config["files"]["model.safetensors"]["sha256"] in (artifact / "README.md").read_text()
    assert check_artifact(artifact, EXTRA["target_fingerprint"]) == \
        "sha256 of model.safetensors ok; target fingerprint ok"
    assert check_artifact(artifact, {"id": EXTRA["target_fingerprint"]}).endswith("target fingerprint ok")
    assert check_artifact(artifact).endswith("target fingerprint not compared")


def test_refuses_truncated_altered_or_missing_weights(artifact):
    weights = artifact / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[:-100])
    msg = refused(artifact, "model.safetensors: .* bytes, but config.json records")
    assert str(weights) in msg and "truncated" in msg
    weights.write_bytes(data[:-50] + bytes([data[-50] ^ 1]) + data[-49:])  # same size, one bit off
    refused(artifact, r"model.safetensors: sha256 .* does not match config.json's")
    weights.unlink()
    refused(artifact, r"model.safetensors: missing")


def test_refuses_what_is_not_a_drafter(artifact, tmp_path):
    refused(tmp_path / "nowhere", "no such directory")
    (tmp_path / "empty").mkdir()
    refused(tmp_path / "empty", "config.json: missing: .* is not a dlite-drafter directory")
    (artifact / "config.json").write_text('{"format": "gguf"}')
    refused(artifact, "format='gguf'")
    (artifact / "config.json").write_text('{"format": "dlite-dr')
    refused(artifact, "config.json: not valid JSON")
    (artifact / "config.json").write_text(json.dumps({"format": "dlite-drafter", "format_version": 99}))
    refused(artifact, "format_version 99")


def as_format_1(path) -> None:
    """What a format 1 export wrote: no `files`, format_version 1."""
    config = json.loads((path / "config.json").read_text())
    del config["files"]
    (path / "config.json").write_text(json.dumps({**config, "format_version": 1}))


def test_format_1_still_loads_and_truncation_is_still_caught(artifact, vocab):
    as_format_1(artifact)
    assert check_artifact(artifact, EXTRA["target_fingerprint"]) == \
        "no checksums recorded (format_version 1); model.safetensors size ok; target fingerprint ok"
    assert load_drafter(artifact, *vocab).cfg.gamma == CFG.gamma
    weights = artifact / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[:-1])
    refused(artifact, "model.safetensors: .* bytes, but its safetensors header describes")
    weights.write_bytes(data[:20])
    refused(artifact, "too short for its safetensors header")


def test_refuses_a_drafter_of_another_target(artifact):
    msg = refused(artifact, "drafter trained for target_fingerprint", fingerprint="qwen3-8b@ffff")
    assert str(artifact / "config.json") in msg
    assert EXTRA["target_fingerprint"] in msg and "qwen3-8b@ffff" in msg
    config = json.loads((artifact / "config.json").read_text())
    del config["target_fingerprint"]
    (artifact / "config.json").write_text(json.dumps(config))
    assert check_artifact(artifact, "qwen3-8b@ffff").endswith("no target fingerprint recorded")


# ---------------------------------------------------------------- other trainers' layouts

def dflash_export(path, layer_types=("full_attention",), **dflash) -> None:
    """A directory in SpecForge's DFlash export layout (`specforge export --to hf`), written
    here by hand (the core tests run without specforge; tests/unit/test_peer_dflash.py
    reads one SpecForge wrote itself): a Qwen3 config + block_size / dflash_config, and
    fc / hidden_norm / layers / norm tensors."""
    from safetensors.torch import save_file
    path.mkdir(parents=True)
    conf = {"architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": HT,
            "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 6,
            "intermediate_size": 48, "rms_norm_eps": 1e-6, "vocab_size": V, "block_size": 4,
            "num_target_layers": 3, "layer_types": list(layer_types),
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
            "dflash_config": {"target_layer_ids": [0, 1], "mask_token_id": V - 1, **dflash}}
    g = torch.Generator().manual_seed(0)
    shapes = {"fc.weight": (HT, 2 * HT), "hidden_norm.weight": (HT,), "norm.weight": (HT,),
              "layers.0.input_layernorm.weight": (HT,), "layers.0.post_attention_layernorm.weight": (HT,),
              "layers.0.self_attn.q_proj.weight": (24, HT), "layers.0.self_attn.k_proj.weight": (12, HT),
              "layers.0.self_attn.v_proj.weight": (12, HT), "layers.0.self_attn.o_proj.weight": (HT, 24),
              "layers.0.self_attn.q_norm.weight": (6,), "layers.0.self_attn.k_norm.weight": (6,),
              "layers.0.mlp.gate_proj.weight": (48, HT), "layers.0.mlp.up_proj.weight": (48, HT),
              "layers.0.mlp.down_proj.weight": (HT, 48)}
    save_file({k: torch.randn(s, generator=g) for k, s in shapes.items()}, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(conf))


def test_a_specforge_dflash_export_checks_loads_and_drafts(tmp_path, vocab):
    dflash_export(tmp_path / "dflash")
    assert check_artifact(tmp_path / "dflash", "any@1").startswith("DFlashDraftModel export, model.safetensors size ok")
    d = load_drafter(tmp_path / "dflash", *vocab)
    assert d.gamma == 3 and d.needs_history and d.target_layer_ids == [0, 1]
    state = d.new_state()
    tokens, probs, state = d.draft(state, torch.randn(5, 2 * HT), 7, 5, 0.0)
    assert tokens.shape == (3,) and probs is None and state.length == 5 and d.cache_bytes(state) > 0
    tokens, probs, state = d.draft(state, torch.randn(2, 2 * HT), 9, 7, 1.0, torch.Generator().manual_seed(0))
    assert probs.shape == (3, V) and torch.allclose(probs.sum(-1), torch.ones(3)) and state.length == 7
    with pytest.raises(ValueError, match="history cache holds 7 positions"):  # a gap in the positions
        d.draft(state, torch.randn(1, 2 * HT), 9, 20, 0.0)


@pytest.mark.parametrize("change,match", [
    ({"mask_token_id": None}, "mask_token_id is missing"),
    ({"target_layer_ids": [0, 2]}, "last layer"),
    ({"layer_types": ("sliding_attention",)}, "only full_attention"),
])
def test_a_dflash_export_this_replay_cannot_run_is_refused(tmp_path, change, match):
    dflash_export(tmp_path / "d", **change)
    refused(tmp_path / "d", match)


def test_an_unknown_layout_lists_the_known_ones(tmp_path, vocab):
    (tmp_path / "llama").mkdir()
    (tmp_path / "llama" / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    for call in (lambda: check_artifact(tmp_path / "llama"), lambda: load_drafter(tmp_path / "llama", *vocab)):
        with pytest.raises(ArtifactError, match="LlamaForCausalLM.*known layouts") as e:
            call()
        assert "\n" not in str(e.value)
        assert all(k in str(e.value) for k in ("dlite-drafter", "DLiteDraftModel", "DFlashDraftModel"))
    dflash_export(tmp_path / "stray")
    from safetensors.torch import load_file, save_file
    t = load_file(str(tmp_path / "stray" / "model.safetensors"))
    save_file({**t, "lm_head.weight": torch.zeros(V, HT)}, str(tmp_path / "stray" / "model.safetensors"))
    with pytest.raises(ArtifactError, match="'lm_head.weight' has no place in DFlashDraftModel"):
        load_drafter(tmp_path / "stray", *vocab)
