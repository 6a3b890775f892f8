"""Standard-library source for the built-in corpus (`dlite.corpus.trajectories`): which
files are used, the train/held-out split, cached file text and directory listings,
`def`/`class` locations, and a whole-word grep.

Everything here is cached (`functools.lru_cache`) because a corpus run reads the
same few hundred files thousands of times; nothing here is random.
"""

import functools
import hashlib
import os
import re
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

STDLIB = Path(sysconfig.get_paths()["stdlib"])
_EXCLUDED_DIRS = {"test", "tests", "idlelib", "site-packages", "lib2to3", "turtledemo",
                  "__pycache__"}
_MAX_FILE_BYTES = 100_000  # bigger files (generated tables, pydoc topics) teach little
_DEF_RE = re.compile(r"^( {0,4})(?:async )?(def|class) ([A-Za-z_]\w*)")


# ----------------------------------------------------------------- source files
@functools.lru_cache(maxsize=None)
def lines_of(path: str) -> tuple:
    # split("\n") rather than splitlines(): stdlib files contain form feeds, which
    # splitlines() would treat as line breaks and so shift every line number.
    text = Path(path).read_text(encoding="utf-8")
    return tuple(text[:-1].split("\n") if text.endswith("\n") else text.split("\n"))


@functools.lru_cache(maxsize=1)
def _all_files() -> tuple:
    out = []
    for d, dirs, names in os.walk(STDLIB):
        dirs[:] = [x for x in dirs if x not in _EXCLUDED_DIRS]
        for name in names:
            p = Path(d, name)
            if not name.endswith(".py") or p.stat().st_size > _MAX_FILE_BYTES:
                continue
            try:
                lines_of(str(p))
            except UnicodeDecodeError:
                continue
            out.append(p)
    return tuple(sorted(out, key=rel))


def stdlib_files() -> list:
    """The usable `.py` files of this interpreter's standard library, sorted."""
    return list(_all_files())


@functools.lru_cache(maxsize=None)
def rel(p: Path) -> str:
    try:
        return p.relative_to(STDLIB).as_posix()
    except ValueError:
        return p.name


def split_files(files, heldout_frac: float = 0.1) -> tuple:
    """(train, heldout) by a stable hash of each path relative to the stdlib root."""
    def heldout(p):
        h = hashlib.sha256(rel(Path(p)).encode()).digest()
        return int.from_bytes(h[:8], "big") / 2 ** 64 < heldout_frac
    files = list(files)
    return [p for p in files if not heldout(p)], [p for p in files if heldout(p)]


@functools.lru_cache(maxsize=8)
def by_dir(files: tuple) -> dict:
    index = {}
    for p in files:
        index.setdefault(p.parent, []).append(p)
    return index


@functools.lru_cache(maxsize=None)
def listing(d: Path) -> str:
    names = (n + "/" * (d / n).is_dir() for n in os.listdir(d) if n != "__pycache__")
    return "\n".join(sorted(names))


# ------------------------------------------------------------- definitions
@dataclass(frozen=True)
class Def:
    """One `def`/`class` in a file: 0-based line indexes, `end` exclusive."""
    name: str
    kind: str
    indent: str
    start: int
    sig_end: int
    body: int      # first statement after the signature and any docstring
    end: int
    has_doc: bool


def _sig_end(lines, i) -> Optional[int]:
    depth = 0
    for j in range(i, min(i + 12, len(lines))):
        code = lines[j].split("#")[0].rstrip()
        depth += sum(code.count(c) for c in "([{") - sum(code.count(c) for c in ")]}")
        if depth <= 0:
            return j if code.endswith(":") else None
    return None


def _doc_end(lines, i) -> Optional[int]:
    s = lines[i].strip().lstrip("rRbBuU")
    if not s[:1] in ("'", '"'):
        return None
    q = s[:3] if s[:3] in ('"""', "'''") else s[0]
    if s.count(q) >= 2 or len(q) == 1:
        return i
    return next((j for j in range(i + 1, len(lines)) if q in lines[j]), None)


@functools.lru_cache(maxsize=None)
def defs(path: str) -> tuple:
    lines, out = lines_of(path), []
    for i, line in enumerate(lines):
        m = _DEF_RE.match(line)
        sig = _sig_end(lines, i) if m else None
        if sig is None or sig + 1 >= len(lines):
            continue
        ind = m.group(1)
        first = lines[sig + 1]
        if len(first) - len(first.lstrip()) <= len(ind) or not first.strip():
            continue
        end = next((j for j in range(sig + 1, len(lines)) if lines[j].strip()
                    and not lines[j].lstrip().startswith("#")
                    and len(lines[j]) - len(lines[j].lstrip()) <= len(ind)), len(lines))
        doc = _doc_end(lines, sig + 1)
        body = sig + 1 if doc is None else doc + 1
        if body < end and lines[body].strip():
            out.append(Def(m.group(3), m.group(2), ind, i, sig, body, end, doc is not None))
    return tuple(out)


def grep(lines, name) -> list:
    """0-based indexes of the lines that contain `name` as a whole word."""
    # str.find over the joined text is much faster than a `\b` regex (which defeats
    # the regex engine's literal-prefix scan); names are identifiers, so a word
    # boundary is "neighbour is not alphanumeric or _".
    text, out, pos, line = "\n".join(lines), [], 0, 0
    i = text.find(name)
    while i >= 0:
        j = i + len(name)
        if not _is_word(text[i - 1:i]) and not _is_word(text[j:j + 1]):
            line, pos = line + text.count("\n", pos, i), i
            if not out or out[-1] != line:
                out.append(line)
        i = text.find(name, j)
    return out


def _is_word(c) -> bool:
    return c.isalnum() or c == "_"
