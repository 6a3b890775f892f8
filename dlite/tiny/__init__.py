"""The embedded default: a tiny Qwen3-architecture target with its own tokenizer, built
by this project from its own agent-trajectory corpus (`python -m dlite.tiny build`) and
shipped in `dlite/tiny/artifacts/`, so everything runs offline with no model hub."""

import json
from pathlib import Path

ARTIFACTS = Path(__file__).resolve().parent / "artifacts"
TARGET_PATH = ARTIFACTS / "target"
TOKENIZER_PATH = ARTIFACTS / "tokenizer"
INFO_PATH = ARTIFACTS / "info.json"
BUILTIN = "builtin:tiny"


def resolve(path: str | None) -> Path:
    """Map the config's target path (`builtin:tiny` or a directory) to a directory."""
    return TARGET_PATH if path in (None, BUILTIN) else Path(path)


def load_target(path: str | None = None, dtype=None):
    """Load a causal LM in fp32 by default (the tiny one ships fp16 weights to stay small)."""
    import torch
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(resolve(path), dtype=dtype or torch.float32)
    return model.eval()


def load_tokenizer(path: str | None = None):
    from transformers import AutoTokenizer
    src = TOKENIZER_PATH if path in (None, BUILTIN) else Path(path)
    return AutoTokenizer.from_pretrained(src)


def info() -> dict:
    """What `python -m dlite.tiny info` prints: paths plus the measured build figures."""
    if not INFO_PATH.exists():
        raise FileNotFoundError(f"{INFO_PATH} missing: run `python -m dlite.tiny build`")
    built = json.loads(INFO_PATH.read_text())
    keys = ("n_params", "vocab_size", "heldout_next_token_acc", "heldout_copy_acc",
            "heldout_copy_fraction", "repeat_probe_acc", "heldout_tokens", "build_s")
    return {"target_path": str(TARGET_PATH), "tokenizer_path": str(TOKENIZER_PATH),
            **{k: built[k] for k in keys if k in built}}
