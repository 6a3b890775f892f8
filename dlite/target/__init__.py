"""Loading a target model and its tokenizer from the config's `target` section, whatever
its family (Qwen3, Qwen2, Llama/SmolLM2, Mistral-style HF decoders) and source
(`dlite.target.sources`), and the target fingerprint every shard manifest, drafter
artifact and registry version carries (weights + tokenizer + chat template), so
features from one target are never mixed with another's."""

import hashlib
import json
from pathlib import Path

from dlite.target import sources
from dlite.target.gguf import TargetSourceError  # noqa: F401 (what every resolver raises)

# Files that define what the target computes and how text becomes tokens.
_WEIGHT_GLOBS = ("*.safetensors", "config.json")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
DTYPES = ("float32", "bfloat16", "float16")
# config.json keys that say where a checkpoint was made, not what it is: transformers
# writes the source path into `_name_or_path` (for a GGUF conversion, the package's
# site-packages dir), so one GGUF converted on two machines hashed apart.
_PLACE_KEYS = ("_name_or_path",)


def target_dir(target_cfg) -> Path:
    return sources.target_dir(target_cfg.path)


def tokenizer_dir(target_cfg) -> Path:
    return sources.tokenizer_dir(target_cfg.path)


def _hash_files(h, root: Path, names, raw=None) -> None:
    """Files `names` under `root` into `h`; `raw` (another hasher) gets the same bytes
    except config.json's as they are on disk (the id this code gave before)."""
    hashers = [x for x in (h, raw) if x is not None]
    for name in names:
        for f in sorted(root.glob(name)):
            for x in hashers:
                x.update(f.name.encode())
            if f.name == "config.json":
                data = f.read_bytes()
                h.update(_config_bytes(data))
                if raw is not None:
                    raw.update(data)
                continue
            with open(f, "rb") as fh:
                for chunk in iter(lambda: fh.read(1 << 20), b""):
                    for x in hashers:
                        x.update(chunk)


def _config_bytes(data: bytes) -> bytes:
    """config.json as hashed: its bytes, or, when it names where it was made, its keys
    without those (sorted). A config without them hashes as before, so the fingerprints
    already recorded for such targets stay valid."""
    cfg = json.loads(data)
    if not any(k in cfg for k in _PLACE_KEYS):
        return data
    return json.dumps({k: v for k, v in cfg.items() if k not in _PLACE_KEYS}, sort_keys=True).encode()


def fingerprint(target_cfg) -> dict:
    """Content hashes of the weights and the tokenizer (chat template included). A
    config.json naming where it was made also gets `also`: the id it had here before
    that was left out of the hash, so features and drafters recorded with it stay
    usable on this machine (`same_target`)."""
    tdir, kdir = target_dir(target_cfg), tokenizer_dir(target_cfg)
    if not (tdir / "config.json").exists():
        raise FileNotFoundError(f"target.path: no config.json under {tdir}")
    w, t = hashlib.sha256(), hashlib.sha256()
    config = (tdir / "config.json").read_bytes()
    legacy = hashlib.sha256() if _config_bytes(config) != config else None
    _hash_files(w, tdir, _WEIGHT_GLOBS, legacy)
    _hash_files(t, kdir, _TOKENIZER_FILES)
    weights, tok = w.hexdigest()[:16], t.hexdigest()[:16]
    out = {"name": target_cfg.name, "revision": target_cfg.revision or weights,
           "weights_sha": weights, "tokenizer_sha": tok, "id": f"{weights}-{tok}"}
    if legacy is not None:
        out["also"] = [f"{legacy.hexdigest()[:16]}-{tok}"]
    return out


def same_target(have: str, want) -> bool:
    """Does a recorded fingerprint id `have` name the target `want` (its fingerprint,
    or an id)? Its id, or one of its earlier ids (`also`)."""
    if isinstance(want, dict):
        return have == want["id"] or have in (want.get("also") or [])
    return have == want


def torch_dtype(target_cfg):
    """The experiment's one target dtype (collection, training features, evaluation)."""
    import torch
    name = getattr(target_cfg, "dtype", None) or "float32"
    if name not in DTYPES:
        raise ValueError(f"target.dtype must be one of {DTYPES}, got {name!r}")
    return getattr(torch, name)


def load_model(target_cfg, dtype=None):
    """The causal LM in the configured dtype and attention kernel, in eval mode, with
    few-row linear layers (`dlite.few_rows`)."""
    from transformers import AutoModelForCausalLM
    impl = getattr(target_cfg, "attn_implementation", None)
    if impl == "sdpa_packed_gqa":
        from dlite.target import attention  # noqa: F401 (registers it with transformers)
    kw = {"attn_implementation": impl} if impl else {}
    model = AutoModelForCausalLM.from_pretrained(target_dir(target_cfg), dtype=dtype or torch_dtype(target_cfg), **kw)
    from dlite import few_rows
    from dlite.target.layers import decoder_layers
    decoder_layers(model)  # an unsupported architecture fails here, named, not in a hook
    few_rows.install(model)  # few-row products on CPU: a decode step 51 -> 35 ms (SmolLM2, 1K)
    return model.eval()


def load_tokenizer(target_cfg):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(tokenizer_dir(target_cfg))


def load(target_cfg, dtype=None):
    """(model, tokenizer) for the config's target (`target.dtype` unless told otherwise)."""
    return load_model(target_cfg, dtype), load_tokenizer(target_cfg)


def eos_ids(model_or_config, tokenizer) -> tuple:
    """Every id that ends a turn: the tokenizer's EOS and all the generation config lists
    (Llama 3 / Qwen chat models stop on several)."""
    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    gen = getattr(model_or_config, "generation_config", None)
    listed = getattr(gen, "eos_token_id", None) if gen is not None else None
    ids.update([listed] if isinstance(listed, int) else (listed or []))
    return tuple(sorted(int(i) for i in ids))


def mask_token_id(model, tokenizer) -> int:
    """The frozen unused embedding row drafters use for MASK slots: `<|mask|>` when the
    tokenizer has it (the tiny target), else the first row past the tokenizer's vocab
    (Qwen3 pads its embedding to 151936 rows for 151669 tokens), else LEARNED_MASK:
    every row is a real token (SmolLM2: 49152 of 49152) and the drafter learns its own
    MASK embedding (`dlite.models.common.FrozenVocab`)."""
    tid = tokenizer.convert_tokens_to_ids("<|mask|>")
    if isinstance(tid, int) and tid != tokenizer.unk_token_id and tid is not None:
        return tid
    if len(tokenizer) < model.config.vocab_size:
        return len(tokenizer)
    from dlite.models import LEARNED_MASK
    return LEARNED_MASK


def shared_vocab(model, tokenizer) -> tuple:
    """(embed_weight, lm_head_weight, mask_token_id): what every drafter shares, frozen."""
    return (model.get_input_embeddings().weight.detach(),
            model.get_output_embeddings().weight.detach(), mask_token_id(model, tokenizer))
