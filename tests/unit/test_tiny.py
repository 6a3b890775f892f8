"""The embedded default: the shipped tokenizer and target load offline with plain
transformers calls, the chat template renders agent trajectories Qwen3-style, the
copy metric counts what it should, and `python -m dlite.tiny info` reports real
held-out figures."""

import json
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from dlite import tiny
from dlite.corpus import trajectories as corpus
from dlite.tiny.build import TargetSpec, heldout_set
from dlite.tiny.copyeval import copy_mask, evaluate
from dlite.tiny.tokenizer import MASK_TOKEN, render


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(tiny.TOKENIZER_PATH)


@pytest.fixture(scope="module")
def record():
    return next(corpus.generate("heldout", 1, 0, 3000, 9000))


def test_copy_mask_counts_repeats_only():
    ids = [1, 2, 3, 4, 5, 6, 7, 9, 1, 2, 3, 4, 5, 6, 8]
    m = copy_mask(ids, start=0, n=3)
    assert [i for i, v in enumerate(m) if v] == [10, 11, 12, 13]
    assert not any(copy_mask(ids, start=14, n=3)[:14])


def test_chat_template_renders_tools_and_calls(tok, record):
    text = render(tok, record)
    assert text.startswith("<|im_start|>system\n") and "<tools>" in text
    assert "<tool_call>\n{\"name\": " in text and "<tool_response>\n" in text
    assert text.count("<|im_start|>assistant\n") == sum(m["role"] == "assistant" for m in record["messages"])
    gen = render(tok, {**record, "messages": record["messages"][:2]}, add_generation_prompt=True)
    assert gen.endswith("<|im_start|>assistant\n")


def test_assistant_mask_covers_only_assistant_text(tok, record):
    enc = tok.apply_chat_template(record["messages"], tools=record["tools"], tokenize=True,
                                  return_dict=True, return_assistant_tokens_mask=True)
    ids, mask = enc["input_ids"], enc["assistant_masks"]
    said = tok.decode([i for i, m in zip(ids, mask) if m])
    assert record["messages"][-1]["content"] in said
    assert "<tool_response>" not in said and "# Tools" not in said


def test_special_tokens_are_single_ids(tok):
    for t in ("<|im_start|>", "<|im_end|>", "<tool_call>", MASK_TOKEN):
        assert len(tok(t)["input_ids"]) == 1
    assert tok.convert_tokens_to_ids(MASK_TOKEN) < 8


def test_target_loads_offline_and_info_is_real(tok):
    model = AutoModelForCausalLM.from_pretrained(tiny.TARGET_PATH, dtype=torch.float32)
    assert type(model).__name__ == "Qwen3ForCausalLM"
    assert model.config.vocab_size == len(tok)
    out = subprocess.run([sys.executable, "-m", "dlite.tiny", "info"], capture_output=True,
                         text=True, check=True, env={"HF_HUB_OFFLINE": "1", "PATH": ""})
    info = json.loads(out.stdout)
    assert info["n_params"] == model.num_parameters()
    assert info["vocab_size"] == model.config.vocab_size
    for k in ("heldout_next_token_acc", "heldout_copy_acc", "repeat_probe_acc"):
        assert 0.0 <= info[k] <= 1.0


def test_info_figures_reproduce(tok):
    """info.json's held-out figures are re-measured on the shipped weights: same held-out
    windows, same probe, same numbers (they come from a real evaluation, not a claim)."""
    built = json.loads(tiny.INFO_PATH.read_text())
    spec = TargetSpec(**built["spec"])
    wins, starts, probe = heldout_set(tok, spec)
    m = evaluate(tiny.load_target(), wins, starts, probe)
    for k in ("heldout_next_token_acc", "heldout_copy_acc", "heldout_copy_fraction", "repeat_probe_acc"):
        assert m[k] == pytest.approx(built[k], abs=2e-3), k
    assert m["heldout_tokens"] == built["heldout_tokens"]
