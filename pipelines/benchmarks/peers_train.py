"""Train SpecForge's DFlash with SpecForge's own trainer and exporter, on CPU, on our
collection (issue 31): `specforge train -c run.yaml` (offline mode: the `.ckpt` files
`dlite.data.specforge_features` writes; gloo on CPU, `fsdp_sharding: NO_SHARD` -> DDP,
sdpa attention), then `specforge export --to hf`. Both run as SpecForge's CLI in a
subprocess: nothing of ours is in its training loop.

The drafter is sized as ours for the same target (`cfg.drafter`: layers, width, heads,
gamma = block_size - 1, the same captured layers), its run as our baseline's (steps
`train.steps_dspark`, `train.batch_size` sequences a step, `train.lr`, fp32);
`num_anchors` is DFlash's own knob (64: its default 512 makes a CPU step very slow).
MASK: SpecForge falls back to the pad / EOS id when the tokenizer has none (SmolLM2: 2 =
`<|im_end|>`), and `spec_generate` fills the unfilled output with MASK and stops when a
stop id appears there; so `mask_token_id` is an unused special token, given explicitly."""

import json
import re
import subprocess
import sys
import time
from pathlib import Path

from dlite.data.specforge_features import convert_shards, read_summary

NUM_ANCHORS = 64


def draft_config(cfg, num_target_layers: int, vocab_size: int, mask_token_id: int) -> dict:
    """A DFlashDraftModel config.json (a Qwen3 config + DFlash's fields) of our drafter's size."""
    d = cfg.drafter
    return {"architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": d.hidden_size,
            "num_hidden_layers": d.num_layers, "num_attention_heads": d.num_heads,
            "num_key_value_heads": d.num_kv_heads, "head_dim": d.head_dim,
            "intermediate_size": d.intermediate_size, "hidden_act": "silu",
            "rms_norm_eps": d.rms_norm_eps, "rope_theta": d.rope_theta,
            "max_position_embeddings": 32768, "vocab_size": vocab_size, "attention_bias": False,
            "attention_dropout": 0.0, "tie_word_embeddings": False, "num_target_layers": num_target_layers,
            "block_size": d.gamma + 1, "layer_types": ["full_attention"] * d.num_layers,
            "use_sliding_window": False, "sliding_window": None, "pad_token_id": 0,
            "dflash_config": {"target_layer_ids": list(d.target_layer_ids), "mask_token_id": mask_token_id}}


def run_config(cfg, target_path: str, features: Path, draft_json: Path, out: Path, steps: int) -> dict:
    """SpecForge's typed run config (its `specforge.config.Config` schema)."""
    return {"model": {"target_model_path": target_path, "draft_model_config": str(draft_json),
                      "torch_dtype": "float32", "mask_token_id": json.loads(draft_json.read_text())
                      ["dflash_config"]["mask_token_id"]},
            "data": {"hidden_states_path": str(features), "max_length": int(cfg.data.max_seq_len),
                     "dataloader_num_workers": 0},
            "training": {"strategy": "dflash", "num_epochs": 10_000, "max_steps": steps,
                         "batch_size": int(cfg.train.batch_size), "fsdp_sharding": "NO_SHARD",
                         "attention_backend": "sdpa", "learning_rate": float(cfg.train.lr),
                         "warmup_ratio": float(cfg.train.warmup_frac), "num_anchors": NUM_ANCHORS,
                         "log_interval": 10, "seed": int(cfg.run.seed)},
            "output_dir": str(out / "runs"), "run_id": "dflash"}


def unused_special_id(tokenizer, features: Path, stop_ids=()) -> int:
    """The last special token that never occurs in the training ids and is no stop, pad
    or BOS id (the MASK row; the last: the first ones are the chat's own markers)."""
    import torch
    seen = set()
    for f in sorted(features.glob("*.ckpt")):
        seen.update(torch.load(f, weights_only=False, mmap=True)["input_ids"].unique().tolist())
    taken = {tokenizer.eos_token_id, tokenizer.pad_token_id, tokenizer.bos_token_id, *stop_ids}
    for tid in sorted(set(tokenizer.all_special_ids) | set(getattr(tokenizer, "added_tokens_decoder", {})), reverse=True):
        if tid not in seen and tid not in taken:
            return int(tid)
    raise ValueError("no special token is free to serve as DFlash's MASK row")


def _specforge(args, log: Path) -> None:
    cli = str(Path(sys.executable).with_name("specforge"))
    with open(log, "a") as fh:
        rc = subprocess.run([cli, *args], stdout=fh, stderr=subprocess.STDOUT).returncode
    if rc:
        tail = log.read_text().splitlines()[-15:]
        raise RuntimeError(f"specforge {args[0]} exited {rc}; last lines of {log}:\n" + "\n".join(tail))


def train(cfg, shards: str, work: Path, target_path: str, tokenizer, num_target_layers: int,
          vocab_size: int, stop_ids=()) -> dict:
    """Features -> SpecForge train -> SpecForge export; reuses a finished export in `work`."""
    work.mkdir(parents=True, exist_ok=True)
    done = work / "train.json"
    if done.is_file() and (work / "export" / "config.json").is_file():
        return json.loads(done.read_text())
    features = work / "features"
    data = read_summary(features) or convert_shards(shards, features)
    steps = int(cfg.train.steps_dspark)
    dj = work / "draft_config.json"
    dj.write_text(json.dumps(draft_config(cfg, num_target_layers, vocab_size,
                                          unused_special_id(tokenizer, features, stop_ids)), indent=2))
    rc = work / "run.yaml"
    rc.write_text(json.dumps(run_config(cfg, target_path, features, dj, work, steps), indent=2))
    log = work / "specforge.log"
    log.write_text("")
    t0 = time.time()
    _specforge(["train", "-c", str(rc)], log)
    minutes = (time.time() - t0) / 60
    ckpt = work / "runs" / f"dflash-step{steps}"
    _specforge(["export", "--to", "hf", "--checkpoint", str(ckpt), "--draft-config", str(dj),
                "--output-dir", str(work / "export")], log)
    seen = steps * int(cfg.train.batch_size)
    info = {"steps": steps, "batch_size": int(cfg.train.batch_size), "num_anchors": NUM_ANCHORS,
            "train_minutes": round(minutes, 2), "sequences_seen": seen,
            "tokens_seen": round(seen / max(data["sequences"], 1) * data["tokens"]),
            "corpus": data, "last_logged": _last_step(log), "export": str(work / "export")}
    done.write_text(json.dumps(info, indent=2))
    return info


def _last_step(log: Path) -> dict:
    """SpecForge's last logged step line: its loss and (block-slot) accuracy."""
    lines = [x for x in log.read_text().splitlines() if re.match(r"step \d+: ", x)]
    if not lines:
        return {}
    m = re.match(r"step (\d+): .*'acc': ([0-9.e-]+), 'loss': ([0-9.e-]+)", lines[-1])
    return {"step": int(m.group(1)), "acc": float(m.group(2)), "loss": float(m.group(3))} if m else {}


def stamp_lineage(export: Path, lineage: dict) -> None:
    """Add our lineage fields (target fingerprint, ...) to the export's config.json, so
    `check_artifact` compares the target as for ours; HF loaders keep unknown fields."""
    f = export / "config.json"
    conf = json.loads(f.read_text())
    if any(conf.get(k) != v for k, v in lineage.items()):
        f.write_text(json.dumps({**conf, **lineage}, indent=2, sort_keys=True))
