"""A real working copy for the scripted agent (`dlite.corpus.agent`): one installed
pure-Python package copied into a temporary git repository, where commands really run
and files really change.

The agent sees the repository as `/testbed` (where SWE-bench puts it): commands are
written with that path, run with it mapped to the real temporary directory, and every
output has the real path mapped back. What would make two runs on one machine differ
is pinned or rewritten: `LC_ALL=C` (sort order), no bytecode, no pytest plugins or
cache, fixed git identity and dates, and the two things no command can pin -- pytest's
elapsed seconds and object addresses -- are rewritten from the session's own seed.
Installed files are only ever read; edits happen in the copy.
"""

import os
import random
import re
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path
from typing import Tuple

ROOT = "/testbed"
SITE = Path(sysconfig.get_paths()["purelib"])
_SKIP_DIRS = {"__pycache__", "tests", "test", "testing"}
_MAX_FILE_BYTES = 100_000
# Only pytest's summary lines and object reprs: file text shown by a command stays as is.
_SECONDS_RE = re.compile(r"^(=+ .*\bin )\d+\.\d\ds\b", re.M)
_ADDR_RE = re.compile(r"(?<= at )0x[0-9a-f]{6,}(?=>)")


def package_files(pkg: str) -> list:
    """The `.py` files of installed package `pkg` the agent may open, sorted (paths
    relative to site-packages, e.g. `click/core.py`)."""
    out = []
    for d, dirs, names in os.walk(SITE / pkg):
        dirs[:] = sorted(x for x in dirs if x not in _SKIP_DIRS)
        for n in names:
            p = Path(d, n)
            if n.endswith(".py") and p.stat().st_size <= _MAX_FILE_BYTES:
                out.append(p.relative_to(SITE).as_posix())
    return sorted(out)


def _env(home: Path) -> dict:
    # The interpreter running this code first on PATH, so `python -m pytest` inside a
    # session is this environment's (pytest and the package's dependencies installed).
    return {"PATH": f"{Path(sys.executable).parent}:/usr/local/bin:/usr/bin:/bin",
            "HOME": str(home), "LC_ALL": "C", "LANG": "C", "TERM": "dumb", "NO_COLOR": "1",
            "COLUMNS": "80", "PYTHONDONTWRITEBYTECODE": "1", "PYTHONHASHSEED": "0",
            "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1", "PYTEST_ADDOPTS": "-p no:cacheprovider",
            "GIT_CONFIG_NOSYSTEM": "1", "GIT_AUTHOR_NAME": "agent", "GIT_AUTHOR_EMAIL": "a@b",
            "GIT_COMMITTER_NAME": "agent", "GIT_COMMITTER_EMAIL": "a@b",
            "GIT_AUTHOR_DATE": "2024-01-01T00:00:00Z", "GIT_COMMITTER_DATE": "2024-01-01T00:00:00Z"}


class Workspace:
    """A temporary git repository holding a copy of one installed package."""

    def __init__(self, pkg: str, rng: random.Random, tmp_root=None):
        import tempfile
        self.tmp = Path(tempfile.mkdtemp(prefix="dlite-agent-", dir=tmp_root))
        self.dir, self.rng, self.pkg = self.tmp / "testbed", rng, pkg
        self.env = _env(self.tmp)
        # The whole package (data files and big modules too), so that it imports; only
        # `package_files` are ones the agent opens.
        shutil.copytree(SITE / pkg, self.dir / pkg, symlinks=True,
                        ignore=shutil.ignore_patterns("__pycache__", "*.pyc", *_SKIP_DIRS))
        rc, out = self.sh("git init -q && git add -A && git commit -q -m init")
        if rc != 0:
            raise RuntimeError(f"git repository for {pkg} not created: {out}")

    def close(self) -> None:
        shutil.rmtree(self.tmp, ignore_errors=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def path(self, rel: str) -> Path:
        return self.dir / rel

    def sh(self, command: str, timeout: float = 120) -> Tuple[int, str]:
        """Run `command` (written against /testbed) with bash in the repository:
        (exit code, stdout and stderr interleaved as a terminal shows them)."""
        real = command.replace(ROOT, str(self.dir))
        p = subprocess.run(["bash", "-c", real], cwd=self.dir, env=self.env, timeout=timeout,
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        return p.returncode, self.clean(p.stdout.decode("utf-8", "replace"))

    def clean(self, text: str) -> str:
        """The real path as /testbed; elapsed seconds and addresses from the seed."""
        text = text.replace(str(self.dir), ROOT).replace(str(self.tmp), "/root")
        text = _SECONDS_RE.sub(lambda m: f"{m.group(1)}{self.rng.uniform(0.05, 0.95):.2f}s", text)
        return _ADDR_RE.sub(lambda m: f"0x7f{self.rng.getrandbits(40):010x}", text)

    def read_lines(self, rel: str) -> list:
        # split("\n"), as `dlite.corpus.source.lines_of`: form feeds are not line breaks.
        text = self.path(rel).read_text(encoding="utf-8")
        return text[:-1].split("\n") if text.endswith("\n") else text.split("\n")


def clip(text: str, cap: int) -> Tuple[str, str, int]:
    """(head, tail, chars elided between them): an output over `cap` chars cut the way
    agent scaffolds cut it, the middle dropped at line boundaries; ("text", "", 0) when
    it fits."""
    if len(text) <= cap:
        return text, "", 0
    head, tail = text[:cap // 2], text[-(cap // 2):]
    head = head[:head.rfind("\n") + 1] or head
    tail = tail[tail.find("\n") + 1:] or tail
    return head, tail, len(text) - len(head) - len(tail)
