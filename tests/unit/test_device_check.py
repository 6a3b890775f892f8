"""The torch-only device check (`dlite.bench.device`, `scripts/device_check.sh`, issue 32)
at its CPU smoke size: the script writes a report whose figures are all finite and
whose decoding is lossless; the module runs in a process where transformers,
safetensors, tokenizers, pyarrow, omegaconf, Ray, DeepSpeed and MLflow cannot be
imported (what a bare GPU box lacks); and its torch-only Qwen3 target computes what
transformers' Qwen3 computes, prefill and cached steps alike."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
BLOCKED = ("ray", "deepspeed", "mlflow", "omegaconf", "transformers", "safetensors", "tokenizers", "pyarrow")
KEYS = {"env", "budget", "target", "drafter", "target_decode_ms", "target_verify_ms", "draft", "lossless",
        "lossless_detail", "loss_memory", "train", "errors"}
# A child that refuses the packages a bare GPU box lacks, then runs the check's CLI.
BLOCKING_CHILD = """
import runpy, sys
BLOCKED = set(sys.argv[1].split(","))
class Refuse:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ImportError(f"{name} is blocked: the device check must not need it")
sys.meta_path.insert(0, Refuse())
sys.argv = ["dlite.bench.device", "--smoke", "--out", sys.argv[2]]
runpy.run_module("dlite.bench.device", run_name="__main__")
"""


def _env():
    return {**os.environ, "PYTHON": sys.executable, "PYTHONPATH": str(ROOT)}


def _check_report(r: dict) -> None:
    assert KEYS <= set(r) and r["smoke"] and r["errors"] == {}
    json.dumps(r, allow_nan=False)  # raises on any NaN / inf figure anywhere in the report
    assert r["lossless"] is True
    lengths = list(r["target_decode_ms"])
    assert len(lengths) == 3 and list(r["target_verify_ms"]) == lengths and r["verify_block"] == 8
    assert all(v > 0 for v in r["target_decode_ms"].values()) and all(v > 0 for v in r["target_verify_ms"].values())
    for dtype, d in r["lossless_detail"].items():
        # a varied greedy output, the rejection path (random DLite) and the acceptance path
        # (the target drafting for itself: every draft accepted) both taken
        assert d["plain_distinct_tokens"] > 1, dtype
        assert d["dlite"]["lossless_up_to_ties"] and d["target_as_drafter"]["mean_accepted"] > 1, dtype
    assert r["lossless_detail"]["float32"]["target_as_drafter"]["mean_accepted"] == 7  # gamma: all taken
    checks = r["draft"]["checks"]  # bytes are exact; the ms checks are timing, not asserted
    assert checks["dlite_cache_constant"] and checks["dspark_cache_grows"]
    assert set(r["draft"]["draft_ms"]) == {"dlite", "dspark", "dlite@128", "dspark@128"}
    mem = r["loss_memory"]
    assert mem["rows"] == 2 * 8 * 7 and {"chunked", "unchunked"} <= set(mem)
    assert r["train"]["samples_per_s"] > 0 and r["train"]["steps"] == 3
    assert r["budget"]["within_budget"] and set(r["budget"]["seconds"]) >= {"target_and_drafts", "lossless"}


def test_script_smoke_report(tmp_path):
    out = tmp_path / "device.json"
    p = subprocess.run(["bash", str(ROOT / "scripts" / "device_check.sh"), "--smoke", "--out", str(out)],
                       cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-4000:]
    _check_report(json.loads(out.read_text()))


def test_runs_without_transformers_ray_deepspeed_mlflow(tmp_path):
    out = tmp_path / "device.json"
    p = subprocess.run([sys.executable, "-c", BLOCKING_CHILD, ",".join(BLOCKED), str(out)],
                       cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-4000:]
    r = json.loads(out.read_text())
    _check_report(r)
    assert not set(BLOCKED) & set(r["env"]["third_party_modules"])


def test_torch_qwen3_matches_transformers():
    transformers = pytest.importorskip("transformers")
    from dlite.bench import qwen3
    from dlite.bench.shape_rehearsal import QWEN3_4B
    from dlite.decoding.decode import crop_cache, new_cache, target_forward
    shape = {**QWEN3_4B, "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
             "num_key_value_heads": 2, "head_dim": 16, "num_hidden_layers": 3, "initializer_range": 0.2}
    ours = qwen3.build(shape, dtype=torch.float32)
    hf = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**shape)).eval()
    missing, unexpected = hf.load_state_dict(ours.state_dict(), strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}  # tied to the embedding
    ids = torch.randint(0, 512, (40,), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = target_forward(hf, ids, 0, new_cache(hf))
        assert torch.allclose(target_forward(ours, ids, 0, new_cache(ours)), want, atol=1e-5)
        cache = new_cache(ours)  # the torch-only KVCache, through dlite's own cache helpers
        target_forward(ours, ids[:30], 0, cache)
        block = target_forward(ours, ids[30:38], 30, cache)  # a verification block
        crop_cache(cache, 31)
        step = target_forward(ours, ids[31:32], 31, cache)  # a decode step after the crop
        assert cache.get_seq_length() == 32
    assert torch.allclose(block, want[30:38], atol=1e-5) and torch.allclose(step, want[31:32], atol=1e-5)
    mask = torch.ones(2, 40, dtype=torch.long)
    mask[1, 30:] = 0  # a padded row, as collection batches are
    with torch.no_grad():
        a = ours.model(ids.repeat(2, 1), attention_mask=mask).last_hidden_state
        b = hf.model(input_ids=ids.repeat(2, 1), attention_mask=mask).last_hidden_state
    assert torch.allclose(a[:, :30], b[:, :30], atol=1e-5)
