"""The library stays engine-free: nothing under dlite/ imports ray, deepspeed or mlflow,
neither in its source nor transitively when every module is imported."""

import ast
import subprocess
import sys
from pathlib import Path

ENGINES = {"ray", "deepspeed", "mlflow"}
DLITE = Path(__file__).resolve().parents[2] / "dlite"


def _imported_roots(path: Path) -> set[str]:
    roots = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            roots |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            roots.add(node.module.split(".")[0])
    return roots


def test_no_engine_imports_in_source():
    offenders = {str(p): _imported_roots(p) & ENGINES for p in DLITE.rglob("*.py")}
    assert {p: e for p, e in offenders.items() if e} == {}


def test_no_engine_loaded_transitively():
    mods = sorted(".".join(p.relative_to(DLITE.parent).with_suffix("").parts)
                  for p in DLITE.rglob("*.py") if p.name != "__main__.py")
    code = ("import importlib, sys\n"
            f"for m in {mods!r}: importlib.import_module(m.removesuffix('.__init__'))\n"
            f"print(sorted(k for k in sys.modules if k.split('.')[0] in {sorted(ENGINES)!r}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=DLITE.parent, check=True).stdout.strip()
    assert out == "[]"


def _modules_imported(path: Path) -> set[str]:
    """Every absolute `dlite.*` module a file imports (function-local imports included)."""
    mods = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            mods.add(node.module)
        elif isinstance(node, ast.Import):
            mods |= {a.name for a in node.names}
    return {m for m in mods if m.startswith("dlite.")}


def test_data_never_imports_decoding():
    """The arrows run one way: decoding may read data formats, data never reaches into
    decoding (where the target's layers are found lives in dlite.target)."""
    back = {str(p.relative_to(DLITE.parent)): sorted(m for m in _modules_imported(p) if m.startswith("dlite.decoding"))
            for p in (DLITE / "data").rglob("*.py")}
    assert {p: m for p, m in back.items() if m} == {}


def test_an_unsupported_architecture_is_named():
    import pytest
    from transformers import GPT2Config, GPT2LMHeadModel
    from dlite.target.layers import UnsupportedTarget, decoder_layers
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=32, n_positions=16))
    with pytest.raises(UnsupportedTarget, match=r"GPT2LMHeadModel \(model_type 'gpt2'\).*\.model\.layers"):
        decoder_layers(model)
