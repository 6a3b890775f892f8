"""The authors' published DLite design (`drafter.arch: dlite_v1`) on the tiny built-in
target: its context reads what HF's `hidden_states[id + 1]` holds (post-norm for the
last layer) from our pre-norm capture, draft() agrees with teacher-forced training,
greedy speculative decoding is lossless, it trains through the shared loop, and its
checkpoints round-trip through the authors' layout (`python -m jobs.export`) with
identical logits and drafts; each bad field of their config.json is refused by name."""

import json

import pytest
import torch
from omegaconf import OmegaConf
from safetensors.torch import load_file

from dlite import target as tgt
from dlite.config import ConfigError, load_config
from dlite.corpus import trajectories as corpus
from dlite.decoding.capture import LayerCapture
from dlite.decoding.decode import plain_generate, speculative_generate
from dlite.decoding.lookup import HybridDrafter, PromptLookupDrafter
from dlite.export import ArtifactError, check_artifact, load_drafter, save_drafter
from dlite.losses import gather_block_rows
from dlite.models import build_drafter
from dlite.models.dlite_v1 import published_layer_ids
from dlite.train.data import collate, epoch_batches, inprocess_rows
from dlite.train.loop import LoopConfig, train_loop
from dlite.train.optim import PlainEngine
from dlite.train.step import compute_loss
from jobs import export as export_job

TINY = "configs/experiments/tiny.yaml"
V1 = ["drafter.arch=dlite_v1", "train.skip_teacher=true", "drafter.num_layers=2", "drafter.sequential_rank=32",
      "drafter.intermediate_size=256"]


@pytest.fixture(scope="module")
def tiny():
    cfg = load_config(TINY, V1)
    model, tok = tgt.load(cfg.target)
    return cfg, model, tok, tgt.shared_vocab(model, tok), model.model.norm.weight.detach()


def _drafter(tiny, seed=0):
    cfg, _, _, vocab, norm = tiny
    torch.manual_seed(seed)
    return build_drafter(OmegaConf.to_object(cfg.drafter), *vocab, final_norm_weight=norm).eval()


def _batch(seed=1, L=40, A=4):
    g = torch.Generator().manual_seed(seed)
    return {"features": torch.randn(2, L, 2 * 128, generator=g),
            "input_ids": torch.randint(0, 4000, (2, L), generator=g),
            "anchors": torch.randint(1, L - 8, (2, A), generator=g)}


def test_published_layer_selection():
    assert published_layer_ids(36, 7) == [0, 1, 9, 17, 26, 34, 35]  # Qwen3-4B / 8B, their default
    assert published_layer_ids(28, 7) == [0, 1, 7, 13, 20, 26, 27]
    assert published_layer_ids(2, 2) == [0, 1]


def test_context_is_hf_hidden_states_at_the_pivot(tiny):
    """Our capture hooks decoder-layer outputs (pre-norm for the last layer); the model
    rebuilds exactly HF's hidden_states[id + 1], whose last entry is post-norm."""
    _, model, _, _, _ = tiny
    d = _drafter(tiny)
    ids = torch.tensor([[5, 17, 99, 3, 42, 8, 61, 7]])
    with LayerCapture(model, d.target_layer_ids) as cap, torch.no_grad():
        hs = model(input_ids=ids, output_hidden_states=True).hidden_states
        feats = cap.features()
        ours = d.context(feats[-1:])
    theirs = torch.stack([hs[i + 1][0, -1] for i in d.target_layer_ids])[None]
    theirs = d.context_norm(theirs + d.layer_depth_embedding(torch.tensor(d.target_layer_ids)))
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(feats[-1, 128:], hs[2][0, -1])  # the last one is post-norm


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_draft_matches_teacher_forced_training(tiny, temperature):
    """Round 2's pivot (the last draft round 1 accepted) comes from the drafter's state;
    its block equals forward_train on the drafted continuation."""
    d, b = _drafter(tiny), _batch()
    feats, ids = b["features"][0], b["input_ids"][0].clone()
    state, g = d.new_state(), torch.Generator().manual_seed(5)
    first, _, state = d.draft(state, feats[:7], int(ids[7]), 7, temperature, g)
    ids[8:11] = first[:3]  # 3 of round 1's drafts accepted, then the anchor at 11
    tokens, probs, state = d.draft(state, feats[7:11], int(ids[11]), 11, temperature, g)
    ids[12:12 + d.gamma] = tokens
    logits = d.forward_train({"features": feats, "input_ids": ids, "anchors": torch.tensor([11])})[0]
    if temperature == 0:
        assert probs is None and torch.equal(tokens, logits.argmax(-1))
        return
    torch.testing.assert_close(torch.softmax(logits, -1), probs, rtol=1e-4, atol=1e-6)


def test_greedy_speculative_decoding_is_lossless(tiny):
    """Alone, and in a hybrid with prompt lookup (whose rounds it does not see)."""
    _, model, _, _, _ = tiny
    d = _drafter(tiny)
    for prompt in ([5, 17, 99, 3, 42, 8, 61], list(range(30, 90)) * 2):
        plain, _ = plain_generate(model, prompt, 40)
        spec, rounds = speculative_generate(model, d, prompt, 40)
        assert spec == plain and rounds and all(r["cache_bytes"] == 0 for r in rounds)
        hybrid = HybridDrafter(d, PromptLookupDrafter(prompt, 4096, gamma=7), min_match=2)
        assert speculative_generate(model, hybrid, prompt, 40)[0] == plain


def test_the_first_round_knows_the_token_before_the_anchor(tiny):
    """The decoding loop hands a `reads_prompt` drafter the prompt, so the first round's
    G=2 query is [prompt's last token, anchor] as in training; others get new_state()."""
    from dlite.decoding.decode import _new_state
    d = _drafter(tiny)
    assert _new_state(d, torch.tensor([5, 17, 99])) == {"pos": 2, "anchor": 99, "draft": []}
    assert d._pivot(_new_state(d, [5, 17, 99]), anchor_pos=3) == 99
    lookup = PromptLookupDrafter([5, 17, 99], 4096, gamma=7)
    assert _new_state(lookup, [5, 17, 99]).ids == lookup.new_state().ids


def test_trains_through_the_shared_loop(tiny):
    cfg, model, tok, _, _ = tiny
    recs = list(corpus.generate("train", 4, 0, 3000, 6000))
    rows = inprocess_rows(model, tok, recs, list(cfg.drafter.target_layer_ids), 512, "truncate", 16, 0)
    d = _drafter(tiny).train()
    fixed = collate(rows[:2])
    with torch.no_grad():
        before = compute_loss(d, fixed)[1]["loss"]
    engine = PlainEngine(d, lr=3e-3, weight_decay=0.0, grad_clip=1.0)
    loop = LoopConfig(steps=12, lr=3e-3, warmup_frac=0.1)
    last = train_loop(engine, epoch_batches(rows, 2, 16, seed=0), loop)
    d.eval()
    with torch.no_grad():
        after = compute_loss(d, fixed)[1]["loss"]
        # `anchors` storage (reference rows per block, features at a-1) gives the same loss
        blocks = {k: v for k, v in fixed.items() if k != "ref_hidden"}
        blocks["ref_hidden_blocks"] = gather_block_rows(fixed["ref_hidden"], fixed["anchors"], d.gamma)
        assert compute_loss(d, blocks)[0].item() == pytest.approx(after, rel=1e-5)
    assert torch.isfinite(torch.tensor([before, after, last["loss"]])).all()
    assert after < before
    prompt = rows[0]["input_ids"][:200]
    assert speculative_generate(model, d, prompt, 24)[0] == plain_generate(model, prompt, 24)[0]


EXPECTED_KEYS = {"norm.weight", "layer_depth_embedding.weight", "context_norm.weight",
                 "sequential_head.prev_token_embedding.weight", "sequential_head.output_proj.weight",
                 "sequential_head.state_proj.weight", "sequential_head.state_proj.bias",
                 "sequential_head.state_hidden_mlp.weight", "sequential_head.state_hidden_mlp.bias"}


@pytest.fixture(scope="module")
def exported(tiny, tmp_path_factory):
    root = tmp_path_factory.mktemp("v1")
    d = _drafter(tiny, seed=3)
    save_drafter(d, root / "ours", {"target_name": "tiny"})
    rc = export_job.main(["--config", TINY, "--format", "dlite_v1", "--drafter", str(root / "ours"),
                          "--out", str(root / "theirs")])
    assert rc == 0
    return d, root


def test_export_writes_the_published_layout(exported):
    d, root = exported
    c = json.loads((root / "theirs" / "config.json").read_text())
    assert c["architectures"] == ["DLiteDraftModel"] and c["model_type"] == "qwen3"
    assert (c["block_size"], c["num_target_layers"], c["hidden_size"], c["vocab_size"]) == (8, 2, 128, 4096)
    assert c["dlite_config"] == {"architecture_version": "dlite_v1", "model_role": "pivot_q_student",
                                 "anchor_group_size": 2, "chs_num_layers": 2, "target_layer_ids": [0, 1],
                                 "sequential_head": "rnn", "sequential_rank": 32,
                                 "mask_token_id": d.vocab.mask_token_id}
    state = load_file(str(root / "theirs" / "model.safetensors"))
    layer = {k for k in state if k.startswith("layers.")}
    assert set(state) - layer == EXPECTED_KEYS and len(layer) == 2 * 11
    assert state["sequential_head.prev_token_embedding.weight"].shape == (4096, 32)
    assert state["sequential_head.output_proj.weight"].shape == (4096, 32)
    assert state["sequential_head.state_proj.weight"].shape == (64, 64)
    from dlite.export import ArtifactError
    from dlite.models.dlite_v1_io import export_published
    before = (root / "ours" / "model.safetensors").read_bytes()
    for out in (root / "ours", root / "theirs"):  # never over a drafter (ours would be destroyed)
        with pytest.raises(ArtifactError, match="already holds a drafter"):
            export_published(root / "ours", out)
    assert (root / "ours" / "model.safetensors").read_bytes() == before
    assert state["sequential_head.state_hidden_mlp.weight"].shape == (32, 32 + 128)
    assert state["layer_depth_embedding.weight"].shape == (2, 128)
    assert "published dlite_v1 layout" in check_artifact(root / "theirs")


def test_published_layout_loads_back_identically(tiny, exported):
    _, _, _, vocab, norm = tiny
    d, root = exported
    back = load_drafter(root / "theirs", vocab[0], vocab[1], final_norm_weight=norm)
    ours = load_drafter(root / "ours", vocab[0], vocab[1])  # stores the norm weight itself
    b = _batch(seed=4)
    with torch.no_grad():
        want = d.forward_train(b)
        assert torch.equal(back.forward_train(b), want) and torch.equal(ours.forward_train(b), want)
    feats = b["features"][0, :9]
    runs = [m.draft(m.new_state(list(range(1, 10))), feats, 11, 9, 0.0)[0] for m in (d, back, ours)]
    assert torch.equal(runs[0], runs[1]) and torch.equal(runs[0], runs[2])
    with pytest.raises(ArtifactError, match="final_norm_weight"):
        load_drafter(root / "theirs", vocab[0], vocab[1])


BAD_FIELDS = {
    "dlite_config.architecture_version": lambda c: c["dlite_config"].update(architecture_version="dlite_v2"),
    "dlite_config.model_role": lambda c: c["dlite_config"].update(model_role="swa_teacher"),
    "dlite_config.target_layer_ids": lambda c: c["dlite_config"].update(target_layer_ids=[0, 2]),
    "dlite_config.sequential_head": lambda c: c["dlite_config"].update(sequential_head="markov"),
    "dlite_config.mask_token_id": lambda c: c["dlite_config"].update(mask_token_id=4096),
}


@pytest.mark.parametrize("field", [*BAD_FIELDS, "count"])
def test_bad_published_config_field_is_named(tiny, exported, tmp_path, field):
    _, _, _, vocab, norm = tiny
    _, root = exported
    for f in ("config.json", "model.safetensors"):
        (tmp_path / f).write_bytes((root / "theirs" / f).read_bytes())
    c = json.loads((tmp_path / "config.json").read_text())
    if field == "count":  # three ids where chs_num_layers says two
        field, _ = "dlite_config.target_layer_ids", c["dlite_config"].update(target_layer_ids=[0, 1, 1])
    else:
        BAD_FIELDS[field](c)
    (tmp_path / "config.json").write_text(json.dumps(c))
    with pytest.raises(ArtifactError, match=field.replace(".", r"\.")):
        load_drafter(tmp_path, vocab[0], vocab[1], final_norm_weight=norm)
    if field != "dlite_config.mask_token_id":  # the one field that needs the target
        with pytest.raises(ArtifactError, match=field.replace(".", r"\.")):
            check_artifact(tmp_path)


def test_only_dlite_v1_exports_and_config_checks_its_keys(tiny, tmp_path, capsys):
    cfg, _, _, vocab, _ = tiny
    dcfg = OmegaConf.to_object(load_config(TINY).drafter)  # our default design
    save_drafter(build_drafter(dcfg, *vocab), tmp_path / "dlite", {})
    rc = export_job.main(["--config", TINY, "--format", "dlite_v1", "--drafter", str(tmp_path / "dlite"),
                          "--out", str(tmp_path / "out")])
    assert rc == 2 and "architecture 'dlite'" in capsys.readouterr().err
    assert not (tmp_path / "out" / "config.json").exists()
    for bad, key in (("drafter.hidden_size=64", "drafter.hidden_size"),
                     ("drafter.target_layer_ids=[1]", "drafter.target_layer_ids"),
                     ("drafter.anchor_group_size=3", "drafter.anchor_group_size")):
        with pytest.raises(ConfigError, match=key):
            load_config(TINY, [*V1, bad])
