"""A peer's drafter end to end on CPU (issue 31), small: a real collection (local Ray, a
random-weight target) in `storage_mode: full`, converted to SpecForge's offline layout
with the same ids, loss masks and feature rows; SpecForge's own trainer (`specforge
train`, its CLI, gloo / NO_SHARD / sdpa) runs 3 optimiser steps on it and its exporter
writes the drafter; `load_drafter` reads that export and greedy speculative decoding with
it is token-identical to plain decoding. Skipped without specforge (the `peers` extra)."""

import json

import numpy as np
import pytest
import torch

pytest.importorskip("specforge", reason="specforge not installed (pip install specforge==0.2.0 --no-deps)")

from dlite.config import load_config  # noqa: E402
from dlite.corpus import trajectories as corpus  # noqa: E402
from dlite.data.shards import iter_records  # noqa: E402
from dlite.data.specforge_features import convert_shards  # noqa: E402

pytestmark = pytest.mark.integration


def _cfg(target):
    return load_config("configs/experiments/tiny.yaml", [
        f"target.path={target}", "target.name=rand", "data.max_seq_len=256", "data.storage_mode=full",
        "data.anchors_per_seq=4", "cluster.num_workers=1", "drafter.hidden_size=64", "drafter.num_layers=1",
        "drafter.num_heads=2", "drafter.num_kv_heads=1", "drafter.head_dim=32",
        "drafter.intermediate_size=128", "drafter.target_layer_ids=[0,2]", "drafter.gamma=3",
        "train.steps_dspark=3", "train.batch_size=2"])


def test_specforge_trains_on_our_collection_and_replays_losslessly(ray_session, random_target, tmp_path):
    from transformers import AutoConfig, AutoModelForCausalLM
    from dlite import tiny
    from dlite.decoding.decode import plain_generate, speculative_generate
    from dlite.export import load_drafter
    from pipelines.benchmarks.peers_train import train
    from pipelines.stages.collect import collect
    cfg = _cfg(random_target)
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.jsonl").write_text("".join(json.dumps(t) + "\n" for t in
                                                    corpus.generate("train", 4, 0, 3000, 5000)))
    collect(cfg, str(tmp_path / "in"), str(tmp_path / "shards"))

    summary = convert_shards(str(tmp_path / "shards"), tmp_path / "features")
    recs = list(iter_records(str(tmp_path / "shards")))
    assert summary["sequences"] == len(recs) >= 4 and summary["layer_ids"] == [0, 2]
    for i, rec in enumerate(recs):  # the same ids, mask and rows, in SpecForge's dtypes
        f = torch.load(tmp_path / "features" / f"data_{i:05d}.ckpt", weights_only=False)
        assert f["input_ids"].dtype == torch.long and f["input_ids"].tolist() == rec["input_ids"].tolist()
        assert f["loss_mask"].tolist() == rec["loss_mask"].tolist() and f["hidden_states"].dtype == torch.float32
        assert np.array_equal(f["hidden_states"].numpy(), rec["features"].astype(np.float32))

    tc, tok = AutoConfig.from_pretrained(random_target), tiny.load_tokenizer()
    info = train(cfg, str(tmp_path / "shards"), tmp_path / "dflash", random_target, tok,
                 tc.num_hidden_layers, tc.vocab_size, (tok.eos_token_id,))
    assert info["steps"] == 3 and info["last_logged"].get("step") in (None, 3)
    sf_conf = json.loads((tmp_path / "dflash" / "export" / "config.json").read_text())
    assert sf_conf["architectures"] == ["DFlashDraftModel"] and sf_conf["block_size"] == 4
    assert sf_conf["dflash_config"]["target_layer_ids"] == [0, 2]

    target = AutoModelForCausalLM.from_pretrained(random_target).eval()
    drafter = load_drafter(info["export"], target.get_input_embeddings().weight, target.lm_head.weight)
    prompt = recs[0]["input_ids"][:120].tolist()
    plain, _ = plain_generate(target, prompt, 16)
    out, rounds = speculative_generate(target, drafter, prompt, 16)
    assert out == plain and rounds and all(r["drafted"] == 3 for r in rounds)
    assert rounds[-1]["cache_bytes"] > 0  # DFlash keeps the history: its cache grows
