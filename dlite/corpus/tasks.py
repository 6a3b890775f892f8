"""Text side of the built-in corpus (`dlite.corpus.trajectories`): tool schemas, the system
prompt, the agent's one-line thoughts, pytest-like outputs, and the edit tasks
(rename / docstring / comment / change a default) planned on a real stdlib def.

Kept apart from the generator so each file stays readable; nothing here touches the
file system or global random state.
"""

import re
import warnings
import zlib
from dataclasses import dataclass, field
from typing import Optional

from dlite.corpus.source import grep

SYSTEM_PROMPT = (
    "You are a coding agent working in a Python repository. Use the tools to explore, "
    "read and edit files and to run the tests. Before each tool call, say in one "
    "sentence what you are doing; make one tool call at a time. Read code before you "
    "edit it: edit_file needs old_str copied exactly from the file. When the task is "
    "done, reply with a short summary of the change.")


def _tool(name, description, props, required):
    return {"type": "function", "function": {"name": name, "description": description,
            "parameters": {"type": "object", "properties": props, "required": required}}}


def _arg(kind, description):
    return {"type": kind, "description": description}


TOOLS = [
    _tool("list_files", "List a directory; sub-directories end with '/'.",
          {"path": _arg("string", "Directory relative to the repository root.")}, ["path"]),
    _tool("read_file", "Show a file with line numbers, optionally only a line range.",
          {"path": _arg("string", "File relative to the repository root."),
           "start_line": _arg("integer", "First line to show (1-based)."),
           "end_line": _arg("integer", "Last line to show (inclusive).")}, ["path"]),
    _tool("search", "Find lines matching a regular expression, grep -n style.",
          {"pattern": _arg("string", "Regular expression to look for."),
           "path": _arg("string", "File or directory to search (default: all).")},
          ["pattern"]),
    _tool("edit_file", "Replace old_str, which must occur exactly once, with new_str.",
          {"path": _arg("string", "File to edit."),
           "old_str": _arg("string", "Exact text to replace, copied from the file."),
           "new_str": _arg("string", "Replacement text.")}, ["path", "old_str", "new_str"]),
    _tool("run_tests", "Run the tests with pytest, optionally only those for one path.",
          {"path": _arg("string", "File or directory whose tests to run.")}, []),
]

LIST = ["Let me see what is in this directory first.",
        "I'll start by listing the package contents.",
        "Let me check which files live next to this one."]
SEARCH = ["Let me find where `{x}` is used.", "I'll search for `{x}` to see its call sites.",
          "Searching for `{x}` to understand how it is used."]
READ = ["Let me read `{x}`.", "I'll open `{x}` to understand the surrounding code.",
        "Let me look at `{x}` for context.", "`{x}` looks related; let me read it."]
REREAD = ["Let me re-read `{x}` to check the current state.",
          "I'll read `{x}` again to confirm the change.",
          "Reading `{x}` once more before going on."]
AGAIN = ["Let me look at `{x}` again.", "I'll go back to `{x}` to check a detail.",
         "Let me re-read part of `{x}`."]
OTHER = ["Let me see how similar code is written in `{x}`.",
         "I'll check `{x}` for a comparable pattern."]
LOOK = ["Let me re-read those lines before editing them.",
        "I need the exact current text first, so let me view it again."]
EDIT = ["Now I'll make the change.", "I'll apply the edit to the definition.",
        "I have what I need; making the edit now."]
FIX = ["The tests show I got the indentation wrong; I'll fix those lines.",
       "That edit broke the file; let me correct the indentation."]
TEST = ["Let me run the tests.", "Running the tests to check the change.",
        "Let me make sure the tests still pass."]
CALLERS = ["Let me find the remaining references to `{x}`.",
           "`{x}` is still used elsewhere in the file; let me find every use."]
EDIT_REF = ["Updating this reference to the new name.", "This use needs the new name too."]
EDITED = "The file {path} has been edited. Here's the result of running `cat -n` on a snippet:"
_HEADER = (" test session starts ".center(80, "=")
           + "\nplatform linux -- Python 3, pytest-8.2.0, pluggy-1.5.0\nrootdir: /repo")
_DEF_RE = re.compile(r"^(\s*)(?:async )?(def|class) ([A-Za-z_]\w*)")


def say(rng, templates, x) -> str:
    return rng.choice(templates).format(x=x)


def _test_file(rel) -> str:
    return "tests/test_" + rel[:-3].replace("/", "_").strip("_") + ".py"


def _n_tests(rel) -> int:
    # Fixed per file (crc32 is stable across runs) so repeated test runs agree.
    return 3 + zlib.crc32(rel.encode()) % 38


def passed(rng, rel) -> str:
    k = _n_tests(rel)
    return "\n".join([_HEADER, f"collected {k} items", "",
                      f"{_test_file(rel)} {'.' * k} [100%]", "",
                      f" {k} passed in {rng.uniform(0.05, 2):.2f}s ".center(80, "=")])


def name_error(rng, rel, lines, r, name) -> str:
    """A failing test run whose traceback quotes the stale reference on line r."""
    ind = len(lines[r]) - len(lines[r].lstrip())
    enc = next((m.group(3) for j in range(r - 1, -1, -1) if (m := _DEF_RE.match(lines[j]))
                and len(m.group(1)) < ind), "<module>")
    k, test = _n_tests(rel), "test_" + enc.strip("_<>")
    err = f"NameError: name '{name}' is not defined"
    return "\n".join([
        _HEADER, f"collected {k} items", "", f"{_test_file(rel)} {'.' * (k - 1)}F [100%]",
        "", " FAILURES ".center(80, "="), f" {test} ".center(80, "_"), "",
        f"{rel}:{r + 1}: in {enc}", f"    {lines[r].strip()}", f"E   {err}",
        " short test summary info ".center(80, "="), f"FAILED {_test_file(rel)}::{test} - {err}",
        f" 1 failed, {k - 1} passed in {rng.uniform(0.05, 2):.2f}s ".center(80, "=")])


def collect_error(rng, rel, lineno, kind, msg, text) -> str:
    """A pytest collection error for a file that no longer compiles."""
    return "\n".join([
        _HEADER, "collected 0 items / 1 error", "", " ERRORS ".center(80, "="),
        f" ERROR collecting {rel} ".center(80, "_"), f'E     File "{rel}", line {lineno}',
        f"E       {text}", f"E   {kind}: {msg}", " short test summary info ".center(80, "="),
        f"ERROR {rel}", " Interrupted: 1 error during collection ".center(80, "!"),
        f" 1 error in {rng.uniform(0.05, 0.6):.2f}s ".center(80, "=")])


@dataclass
class Plan:
    """One edit task: replace lines [s, e) of the original file with `new`."""
    prompt: str
    summary: str
    s: int
    e: int
    new: list
    bad: Optional[list] = None        # a first, broken attempt (fixed after the tests)
    error: Optional[tuple] = None     # (lineno, kind, msg, text) the broken attempt raises
    refs: list = field(default_factory=list)  # other lines naming a renamed def
    new_name: str = ""


def block_error(t, s, e, new) -> Optional[tuple]:
    """Compile the target def with lines [s, e) replaced; the error, or None."""
    lines = list(t.orig[:s]) + list(new) + list(t.orig[e:])
    end = t.d.end + len(lines) - len(t.orig)
    # Compiling only the def keeps this cheap; methods get a dummy class around them.
    pre = "class _:\n" if t.d.indent else ""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            compile(pre + "\n".join(lines[t.d.start:end]) + "\n", t.rel, "exec",
                    dont_inherit=True)
    except SyntaxError as err:
        off = t.d.start - bool(pre)
        msg = re.sub(r"on line (\d+)", lambda m: f"on line {int(m.group(1)) + off}", err.msg)
        return (err.lineno or 1) + off, type(err).__name__, msg, (err.text or "").strip()
    return None


def _words(name) -> str:
    return " ".join(w.lower() for w in re.findall(r"[A-Z]?[a-z0-9]+|[A-Z]+(?![a-z])", name))


def _indent(line) -> str:
    return line[:len(line) - len(line.lstrip())]


def _trim(lines, s, e) -> int:
    """Drop trailing blank lines from the span [s, e) so old_str ends on code."""
    while e > s + 1 and not lines[e - 1].strip():
        e -= 1
    return e


def _rename(rng, t) -> Optional[Plan]:
    d, text = t.d, "\n".join(t.orig)
    stem = d.name.lstrip("_")
    options = ([f"{d.name}Impl", f"Base{stem}", f"{d.name}V2"] if d.kind == "class"
               else [f"{d.name}_impl", f"{d.name}_v2", f"_{stem}_helper", f"do_{stem}"])
    new = rng.choice(options)
    rx = re.compile(rf"\b{re.escape(d.name)}\b")
    s, e = d.start, _trim(t.orig, d.sig_end, min(d.end, d.sig_end + 1 + rng.randint(0, 2)))
    refs = [i for i in grep(t.orig, d.name) if not s <= i < e]
    if new in text or len(refs) > 4 or d.name.startswith("__"):
        return None
    also = (f" and updated its {len(refs)} other reference{'s' * (len(refs) > 1)} there"
            if refs else "")
    return Plan(f"Rename `{d.name}` to `{new}` in `{t.rel}` and update its callers in "
                "that file.", f"I renamed `{d.name}` to `{new}` in `{t.rel}`{also}; the "
                "tests pass.", s, e, [rx.sub(new, ln) for ln in t.orig[s:e]],
                refs=refs, new_name=new)


def _docstring(rng, t) -> Optional[Plan]:
    d = t.d
    if d.has_doc:
        return None
    e = _trim(t.orig, d.start, min(d.end, d.sig_end + 1 + rng.randint(1, 3)))
    what = rng.choice(["Represent a {w}.", "Hold the state of a {w}."] if d.kind == "class"
                      else ["Handle the {w} step.", "Return the result of {w}.",
                            "Helper that implements {w}."]).format(w=_words(d.name))
    head, rest = list(t.orig[d.start:d.sig_end + 1]), list(t.orig[d.sig_end + 1:e])
    new = head + [_indent(rest[0]) + f'"""{what}"""'] + rest
    bad = head + [d.indent + f'"""{what}"""'] + rest if rng.random() < 0.4 else None
    return Plan(f"Add a docstring to `{d.name}` in `{t.rel}`.",
                f"I added a docstring to `{d.name}` in `{t.rel}`; the tests pass.",
                d.start, e, new, bad)


def _comment(rng, t) -> Optional[Plan]:
    d = t.d
    s = max(d.start, d.body - rng.randint(1, 3))
    e = _trim(t.orig, d.body, min(d.end, d.body + rng.randint(1, 3)))
    note = rng.choice(["# Kept small on purpose: {w} sits on a hot path.",
                       "# Callers rely on {w} having no side effects.",
                       "# See the module docstring for where {w} is used."])
    line = _indent(t.orig[d.body]) + note.format(w=_words(d.name))
    new = list(t.orig[s:d.body]) + [line] + list(t.orig[d.body:e])
    return Plan(f"Add a short comment at the start of the body of `{d.name}` in `{t.rel}` "
                "explaining its purpose.", f"I added a comment to `{d.name}` in "
                f"`{t.rel}`; the tests pass.", s, e, new)


def _default(rng, t) -> Optional[Plan]:
    d, rx = t.d, re.compile(r"(?<![\w.])(\w+)=(True|False|\d+)(?=\s*[,)])")
    found = [(j, m) for j in range(d.start, d.sig_end + 1) for m in rx.finditer(t.orig[j])]
    if not found:
        return None
    j, m = rng.choice(found)
    name, old = m.groups()
    value = {"True": "False", "False": "True"}.get(old) or str(int(old) * 2 or 1)
    e = _trim(t.orig, d.sig_end, min(d.end, d.sig_end + 1 + rng.randint(0, 2)))
    new = list(t.orig[d.start:e])
    line = new[j - d.start]
    new[j - d.start] = line[:m.start()] + f"{name}={value}" + line[m.end():]
    bad = ["  " + new[0]] + new[1:] if rng.random() < 0.4 else None
    return Plan(f"Change the default of `{name}` in `{d.name}` (`{t.rel}`) from `{old}` to "
                f"`{value}`.", f"I changed the default of `{name}` in `{d.name}` "
                f"(`{t.rel}`) from `{old}` to `{value}`; the tests pass.",
                d.start, e, new, bad)


_PLANS = {"rename": _rename, "docstring": _docstring, "comment": _comment,
          "default": _default}


def make_plan(rng, t) -> Optional[Plan]:
    """A task for target `t` (kinds tried in random order) whose edit compiles, or None."""
    kinds = sorted(_PLANS)
    rng.shuffle(kinds)
    for kind in kinds:
        plan = _PLANS[kind](rng, t)
        if plan is None or block_error(t, plan.s, plan.e, plan.new) is not None:
            continue
        if plan.bad is not None:
            plan.error = block_error(t, plan.s, plan.e, plan.bad)
            plan.bad = plan.bad if plan.error else None
        return plan
    return None


def final_answer(plan, t) -> str:
    """Summary plus the changed lines, quoted from the final file (refs included)."""
    quoted = "\n".join(plan.new + [t.lines[r] for r in plan.refs])
    return (f"{plan.summary}\n\nThe changed lines in `{t.rel}` now read:\n\n"
            f"```python\n{quoted}\n```")
