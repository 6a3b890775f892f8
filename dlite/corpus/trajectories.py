"""Built-in agent-trajectory corpus: deterministic coding-agent conversations.

Generates OpenAI-format multi-turn trajectories of an agent working on the real
Python standard library (list / read / search / edit / test tool calls). Used to
train the tiny target to COPY text seen earlier in its context (every `edit_file`
`old_str` is an exact copy of lines shown earlier, with the `cat -n` numbers
dropped; files are re-read after edits) and as demo/eval data with long histories.

Length proxy: `rendered_chars` (message text + tool-call and tool-schema JSON);
chars ~= 3.5 x tokens, so 16K tokens ~= 56K chars. The tool schemas, system prompt
and one complete edit cycle put the floor near 4K chars, so `max_chars` must be at
least ~5000 and `min_chars + 1000`. The same (seed, args) on the same Python version
gives byte-identical records: only `random.Random` instances are used, and every
listing is sorted. Stdlib access lives in `corpus_source`, the texts and edit tasks
in `corpus_tasks`; this module assembles trajectories and is the public API.
"""

import copy
import json
import os
import random
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator

from dlite.corpus import source as S
from dlite.corpus import tasks as T
from dlite.corpus.source import STDLIB, split_files, stdlib_files  # noqa: F401

SYSTEM_PROMPT = T.SYSTEM_PROMPT
TOOLS = T.TOOLS
_NUM_RE = re.compile(r"(?m)^ *\d+\t")


# ------------------------------------------------------------- rendering
def strip_line_numbers(text: str) -> str:
    """Drop `cat -n` prefixes, giving the file text an edit's old_str copies from."""
    return _NUM_RE.sub("", text)


def _numbered(lines, a, b) -> str:
    return "\n".join(f"{i + 1:5d}\t{lines[i]}" for i in range(a, b))


def _fit(lines, a, b, cap) -> int:
    """Largest end <= b whose numbered text from `a` fits in `cap` chars (>= 3 lines)."""
    used, e = 0, a
    while e < b and used + len(lines[e]) + 7 <= cap:
        used, e = used + len(lines[e]) + 7, e + 1
    return max(e, min(b, a + 3))


def _msg_chars(m) -> int:
    calls = m.get("tool_calls", ())
    return len(m["content"]) + 16 + sum(
        len(json.dumps(c["function"], ensure_ascii=False)) for c in calls)


def rendered_chars(record) -> int:
    """Size proxy of the rendered chat (messages + tool schemas), ~3.5 chars/token."""
    tools = len(json.dumps(record.get("tools", []), ensure_ascii=False))
    return tools + sum(_msg_chars(m) for m in record["messages"])


class _Conv:
    """Assistant/tool turns so far, their size, and the text the agent has seen."""

    def __init__(self, seen=()):
        self.msgs, self.seen, self.chars = [], list(seen), 0

    def call(self, thought, name, args, output):
        call = {"id": "", "type": "function", "function": {"name": name, "arguments": args}}
        pair = [{"role": "assistant", "content": thought, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "", "name": name, "content": output}]
        self.msgs += pair
        self.chars += sum(map(_msg_chars, pair))
        self.seen.append(strip_line_numbers(output))

    def pop(self):
        self.chars -= sum(map(_msg_chars, self.msgs[-2:]))
        del self.msgs[-2:], self.seen[-1]

    def visible(self, text) -> bool:
        return any(text in s for s in self.seen)

    def read(self, thought, rel, lines, a, b):
        whole = a == 0 and b >= len(lines)
        args = {"path": rel} if whole else {"path": rel, "start_line": a + 1, "end_line": b}
        self.call(thought, "read_file", args, _numbered(lines, a, b))

    def search(self, thought, pattern, path, sources, cap=2000):
        hits = [f"{rel}:{i + 1}: {lines[i]}" for rel, lines in sources
                for i in S.grep(lines, pattern)]
        keep = hits[:12]
        while len(keep) > 1 and sum(len(h) + 1 for h in keep) > cap:
            keep.pop()
        more = f"\n... ({len(hits) - len(keep)} more matches)" if len(hits) > len(keep) else ""
        out = "\n".join(keep) + more or "No matches found."
        self.call(thought, "search", {"pattern": pattern, "path": path}, out)


# ------------------------------------------------------------- trajectories
@dataclass
class _Target:
    """The file being changed: original text, working copy, and the chosen def."""
    path: Path
    rel: str
    orig: tuple
    lines: list
    d: S.Def


def _pick_target(rng, files) -> _Target:
    for _ in range(100):
        p = rng.choice(files)
        defs = [d for d in S.defs(str(p)) if d.end - d.start < 200]
        if defs:
            d = rng.choice(defs)
            return _Target(p, S.rel(p), S.lines_of(str(p)), list(S.lines_of(str(p))), d)
    raise ValueError("no file with a usable def/class in this split")


def _opening(rng, t, plan, siblings, cap) -> _Conv:
    conv, dir_rel = _Conv(), (os.path.dirname(t.rel) or ".")
    listing = S.listing(t.path.parent)
    if rng.random() < 0.6 and len(listing) < cap / 2:
        conv.call(rng.choice(T.LIST), "list_files", {"path": dir_rel}, listing)
    if rng.random() < 0.7:
        conv.search(T.say(rng, T.SEARCH, t.d.name), t.d.name, dir_rel,
                    [(t.rel, t.orig)] + [(S.rel(p), S.lines_of(str(p))) for p in siblings[:3]],
                    cap / 2)
    n, d = len(t.orig), t.d
    a, b = max(0, d.start - rng.randint(0, 12)), min(n, d.end + rng.randint(0, 8))
    if rng.random() < 0.4:
        a, b = 0, n
    a, end = min(a, plan.s), b
    b = _fit(t.orig, a, end, cap)
    if b < plan.e + 2:  # too big to show from `a`: start just above the lines to edit
        a = max(0, plan.s - rng.randint(0, 5))
        b = max(_fit(t.orig, a, end, cap), min(n, plan.e + 2))
    conv.read(T.say(rng, T.READ, t.rel), t.rel, t.orig, a, b)
    return conv


def _filler(conv, rng, t, files, siblings, cap) -> None:
    """One exploration round: read a related file, re-read the target, search, list.
    Adds nothing when the listing would not fit."""
    kind = rng.choice(("sibling", "sibling", "other", "reread", "search", "list"))
    if kind in ("sibling", "other", "reread"):
        p = t.path if kind == "reread" else rng.choice(
            siblings if kind == "sibling" and siblings else files)
        lines, defs = S.lines_of(str(p)), S.defs(str(p))
        a = 0 if not defs or rng.random() < 0.5 else rng.choice(defs).start
        cap = min(cap, rng.choice((1500, 4000, 12000, cap)))
        b = _fit(lines, a, len(lines), cap)
        msg = {"reread": T.AGAIN, "sibling": T.READ, "other": T.OTHER}[kind]
        conv.read(T.say(rng, msg, S.rel(p)), S.rel(p), lines, a, b)
    elif kind == "search":
        name = rng.choice(S.defs(str(t.path))).name
        srcs = [(t.rel, t.orig)] + [(S.rel(p), S.lines_of(str(p))) for p in rng.sample(
            siblings, min(3, len(siblings)))]
        conv.search(T.say(rng, T.SEARCH, name), name, os.path.dirname(t.rel) or ".", srcs,
                    min(cap, 3000))
    elif len(S.listing(t.path.parent)) < cap:
        conv.call(rng.choice(T.LIST), "list_files", {"path": os.path.dirname(t.rel) or "."},
                  S.listing(t.path.parent))


def _edit(conv, rng, t, s, e, new, thought):
    """edit_file on lines [s, e) of the working copy, widened until old_str is unique."""
    # Count in the text as saved (final newline included): an old_str ending in a
    # blank line would otherwise look unique when the same lines end the file.
    text = "\n".join(t.lines) + "\n"
    s0, e0 = s, e
    while text.count("\n".join(t.lines[s:e])) > 1 and (s > 0 or e < len(t.lines)):
        s, e = (s, e + 1) if e < len(t.lines) else (s - 1, e)
    old = "\n".join(t.lines[s:e])
    new = t.lines[s:s0] + list(new) + t.lines[e0:e]
    if not conv.visible(old):  # the agent only copies what it has been shown
        a, b = max(0, s - 3), min(len(t.lines), e + 3)
        conv.read(rng.choice(T.LOOK), t.rel, t.lines, a, b)
    t.lines[s:e] = new
    a, b = max(0, s - 3), min(len(t.lines), s + len(new) + 3)
    out = f"{T.EDITED.format(path=t.rel)}\n{_numbered(t.lines, a, b)}"
    conv.call(thought, "edit_file", {"path": t.rel, "old_str": old, "new_str": "\n".join(new)},
              out)


def _edit_phase(rng, t, plan, seen, cap) -> _Conv:
    conv, d = _Conv(seen), t.d
    if plan.bad is not None:
        _edit(conv, rng, t, plan.s, plan.e, plan.bad, rng.choice(T.EDIT))
        conv.call(rng.choice(T.TEST), "run_tests", {"path": t.rel},
                  T.collect_error(rng, t.rel, *plan.error))
        _edit(conv, rng, t, plan.s, plan.s + len(plan.bad), plan.new, rng.choice(T.FIX))
    else:
        _edit(conv, rng, t, plan.s, plan.e, plan.new, rng.choice(T.EDIT))
    if plan.refs:
        rx = re.compile(rf"\b{re.escape(d.name)}\b")
        if rng.random() < 0.5:
            r = plan.refs[0]
            conv.call(rng.choice(T.TEST), "run_tests", {"path": t.rel},
                      T.name_error(rng, t.rel, t.lines, r, d.name))
        conv.search(T.say(rng, T.CALLERS, d.name), d.name, t.rel, [(t.rel, t.lines)], cap)
        for r in plan.refs:
            _edit(conv, rng, t, r, r + 1, [rx.sub(plan.new_name, t.lines[r])],
                  rng.choice(T.EDIT_REF))
    conv.call(rng.choice(T.TEST), "run_tests", {"path": t.rel}, T.passed(rng, t.rel))
    end = d.end + len(t.lines) - len(t.orig)
    conv.read(T.say(rng, T.REREAD, t.rel), t.rel, t.lines, d.start,
              _fit(t.lines, d.start, end, cap))
    return conv


def _compulsory(rng, files, min_chars, max_chars):
    """Task, opening reads and edit phase for a target whose turns fit in max_chars."""
    by_dir = S.by_dir(files)
    for _ in range(30):  # a target whose compulsory turns do not fit: try another
        t = _pick_target(rng, files)
        plan = T.make_plan(rng, t)
        if plan is None:
            continue
        siblings = [p for p in by_dir.get(t.path.parent, []) if p is not t.path]
        head = [{"role": "system", "content": SYSTEM_PROMPT},
                {"role": "user", "content": plan.prompt}]
        base = rendered_chars({"tools": TOOLS, "messages": head})
        # Size the compulsory reads from min_chars so short trajectories stay short;
        # exploration rounds make up the rest.
        cap = min(0.3 * (max_chars - base), max(600, 0.35 * (min_chars - base)))
        opening = _opening(rng, t, plan, siblings, cap)
        edits = _edit_phase(rng, t, plan, opening.seen, max(300, cap / 2))
        base += opening.chars + edits.chars
        if base <= max_chars:
            return t, plan, siblings, head + opening.msgs, edits.msgs, base
    raise ValueError(f"max_chars={max_chars} is too small for a trajectory")


def make_trajectory(rng: random.Random, files, min_chars: int, max_chars: int,
                    traj_id: str) -> dict:
    """One trajectory; its text before the final answer is in [min_chars, max_chars]."""
    if max_chars < min_chars + 1000:
        raise ValueError("max_chars must be at least min_chars + 1000")
    files = tuple(files)
    t, plan, siblings, head, tail, base = _compulsory(rng, files, min_chars, max_chars)
    fill, misses = _Conv(), 0
    while base + fill.chars < min_chars and misses < 50:
        before = fill.chars
        _filler(fill, rng, t, files, siblings, max_chars - base - before - 300)
        if base + fill.chars > max_chars:
            fill.pop()
        misses += fill.chars == before
    msgs = head + fill.msgs + tail
    for k, i in enumerate(range(2, len(msgs), 2), start=1):  # ids in final order
        msgs[i]["tool_calls"][0]["id"] = msgs[i + 1]["tool_call_id"] = f"call_{k}"
    final = {"role": "assistant", "content": T.final_answer(plan, t)}
    return {"id": traj_id, "tools": copy.deepcopy(TOOLS), "messages": msgs + [final]}


def generate(split: str, n: int, seed: int, min_chars: int, max_chars: int) -> Iterator[dict]:
    """`n` trajectories over the "train" or "heldout" files; record i is independent of n."""
    if split not in ("train", "heldout"):
        raise ValueError(f"split must be 'train' or 'heldout', got {split!r}")
    train, heldout = split_files(stdlib_files())
    files = train if split == "train" else heldout
    for i in range(n):
        rng = random.Random(f"dlite-corpus:{split}:{seed}:{i}")
        yield make_trajectory(rng, files, min_chars, max_chars, f"{split}-{i:06d}")


def write_jsonl(records: Iterable[dict], path) -> int:
    """Write records one JSON per line (temp file + rename); returns the count."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp, count = path.with_name(path.name + ".tmp"), 0
    with open(tmp, "w", encoding="utf-8") as f:
        for rec in records:
            f.write(json.dumps(rec, ensure_ascii=False) + "\n")
            count += 1
    os.replace(tmp, path)
    return count
