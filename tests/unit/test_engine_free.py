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
