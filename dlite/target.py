"""Loading a target model and its tokenizer from the config's `target` section, and the
target fingerprint every shard manifest, drafter artifact and registry version carries
(weights + tokenizer + chat template), so features from one target are never mixed
with another's."""

import hashlib
from pathlib import Path

from dlite import tiny

# Files that define what the target computes and how text becomes tokens.
_WEIGHT_GLOBS = ("*.safetensors", "config.json")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def target_dir(target_cfg) -> Path:
    return tiny.resolve(target_cfg.path)


def tokenizer_dir(target_cfg) -> Path:
    """The tiny target keeps its tokenizer beside it; a real checkpoint holds both."""
    return tiny.TOKENIZER_PATH if target_cfg.path == tiny.BUILTIN else Path(target_cfg.path)


def _hash_files(h, root: Path, names) -> None:
    for name in names:
        for f in sorted(root.glob(name)):
            h.update(f.name.encode())
            with open(f, "rb") as fh:
                for chunk in iter(lambda: fh.read(1 << 20), b""):
                    h.update(chunk)


def fingerprint(target_cfg) -> dict:
    """Content hashes of the weights and the tokenizer (chat template included)."""
    tdir, kdir = target_dir(target_cfg), tokenizer_dir(target_cfg)
    if not (tdir / "config.json").exists():
        raise FileNotFoundError(f"target.path: no config.json under {tdir}")
    w, t = hashlib.sha256(), hashlib.sha256()
    _hash_files(w, tdir, _WEIGHT_GLOBS)
    _hash_files(t, kdir, _TOKENIZER_FILES)
    weights, tok = w.hexdigest()[:16], t.hexdigest()[:16]
    return {"name": target_cfg.name, "revision": target_cfg.revision or weights,
            "weights_sha": weights, "tokenizer_sha": tok, "id": f"{weights}-{tok}"}


def load(target_cfg, dtype=None):
    """(model, tokenizer) for the config's target, fp32 on CPU unless told otherwise."""
    return tiny.load_target(str(target_dir(target_cfg)), dtype), tiny.load_tokenizer(str(tokenizer_dir(target_cfg)))


def mask_token_id(model, tokenizer) -> int:
    """The frozen unused embedding row drafters use for MASK slots: `<|mask|>` when the
    tokenizer has it (the tiny target), else the first row past the tokenizer's vocab
    (Qwen3 pads its embedding to 151936 rows for 151669 tokens)."""
    tid = tokenizer.convert_tokens_to_ids("<|mask|>")
    if isinstance(tid, int) and tid != tokenizer.unk_token_id and tid is not None:
        return tid
    if len(tokenizer) < model.config.vocab_size:
        return len(tokenizer)
    raise ValueError("target has no unused embedding row for MASK; add a <|mask|> token")


def shared_vocab(model, tokenizer) -> tuple:
    """(embed_weight, lm_head_weight, mask_token_id): what every drafter shares, frozen."""
    return (model.get_input_embeddings().weight.detach(),
            model.get_output_embeddings().weight.detach(), mask_token_id(model, tokenizer))
