"""A scripted coding agent that works like the SWE-bench agents: one thought and one
command per turn, against a real copy of an installed package (`workspace.Workspace`),
every output the real output of the command.

A session: look around the repository (`find`, `grep -n`, a numbered view of the
definition), explore related code until the history is long enough, write a test that
reproduces the task and run it with `python -m pytest -x` (it fails, for real), edit
the file (a `python -` heredoc or `sed -i` for a shell-only agent, the editor's
`str_replace` for one that has it; sometimes a first attempt that does not compile,
which the next test run shows), view the edited lines again, run the test again, and
`git diff`. The tasks are `dlite.corpus.tasks`' (rename / docstring / comment / change a
default) planned on a real definition of the copied package.

`style` "bash" is mini-swe-agent's (shell only); "editor" is SWE-agent's and OpenHands'
(shell + `str_replace_editor`). Steps come out layout-free; `agent_layouts` writes them.
"""

import random
import re
from dataclasses import dataclass, field
from typing import Optional

from dlite.corpus import editor
from dlite.corpus import source as S
from dlite.corpus import tasks as T
from dlite.corpus.trajectories import _Target
from dlite.corpus.workspace import ROOT, SITE, Workspace, package_files

TEST_FILE = "tests/test_issue.py"
TAIL_CHARS = 4500  # what the test / edit / diff turns add, about: the exploration budget leaves room
_DEFAULT_RE = re.compile(r"default of `(\w+)` in `\w+` \(`[^`]+`\) from `[^`]+` to `([^`]+)`")


@dataclass
class Step:
    """One turn: what the agent says, the tool it calls, and what came back."""
    thought: str
    tool: str    # "bash" | "str_replace_editor" | "submit"
    args: dict
    output: str = ""
    rc: int = 0


@dataclass
class Session:
    id: str
    package: str
    task: str
    summary: str
    steps: list = field(default_factory=list)


class _Agent:
    def __init__(self, ws: Workspace, rng: random.Random, style: str, session: Session):
        self.ws, self.rng, self.style, self.s, self.chars = ws, rng, style, session, 0

    def _add(self, step: Step) -> Step:
        self.s.steps.append(step)
        self.chars += len(step.thought) + len(str(step.args)) + min(len(step.output), 10_000) + 80
        return step

    def undo(self, step: Step) -> None:  # only for turns that changed nothing on disk
        self.s.steps.remove(step)
        self.chars -= len(step.thought) + len(str(step.args)) + min(len(step.output), 10_000) + 80

    def bash(self, thought: str, command: str) -> Step:
        rc, out = self.ws.sh(command)
        return self._add(Step(thought, "bash", {"command": command}, out, rc))

    def _editor(self, thought: str, out: str, **args) -> Step:
        return self._add(Step(thought, "str_replace_editor", args, out))

    def view(self, thought: str, rel: str, a: int, b: int) -> Step:
        """Lines a..b (1-based, inclusive), numbered."""
        if self.style == "editor":
            return self._editor(thought, editor.view(self.ws, rel, [a, b]), command="view",
                                path=f"{ROOT}/{rel}", view_range=[a, b])
        cmd = self.rng.choice((f"nl -ba {rel} | sed -n '{a},{b}p'", f"cat -n {rel} | sed -n '{a},{b}p'",
                               f"sed -n '{a},{b}p' {rel}"))
        return self.bash(thought, cmd)

    def show_file(self, thought: str, rel: str) -> Step:
        if self.style == "editor":
            return self._editor(thought, editor.view(self.ws, rel), command="view", path=f"{ROOT}/{rel}")
        return self.bash(thought, self.rng.choice((f"cat {rel}", f"cat -n {rel}", f"nl -ba {rel}")))

    def edit(self, thought: str, rel: str, old: str, new: str) -> Step:
        if self.style == "editor":
            return self._editor(thought, editor.str_replace(self.ws, rel, old, new), command="str_replace",
                                path=f"{ROOT}/{rel}", old_str=old, new_str=new)
        # repr() writes any text as an exact Python literal, quotes and backslashes included.
        script = (f"python - <<'EOF'\nfrom pathlib import Path\np = Path({rel!r})\ns = p.read_text()\n"
                  f"old = {old!r}\nnew = {new!r}\nassert s.count(old) == 1, s.count(old)\n"
                  "p.write_text(s.replace(old, new))\nprint('edited')\nEOF")
        return self.bash(thought, script)

    def create(self, thought: str, rel: str, text: str) -> Step:
        if self.style == "editor":
            return self._editor(thought, editor.create(self.ws, rel, text), command="create",
                                path=f"{ROOT}/{rel}", file_text=text)
        return self.bash(thought, f"mkdir -p {rel.rsplit('/', 1)[0]} && cat <<'EOF' > {rel}\n{text}EOF")


# ------------------------------------------------------------------ the task

def _module(rel: str) -> str:
    parts = rel[:-3].split("/")
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _owner(lines, d: S.Def) -> Optional[str]:
    """Python path of the object holding def `d` ("" for the module), None when it sits
    somewhere a test cannot reach by name (inside a function or an `if`)."""
    if not d.indent:
        return ""
    for j in range(d.start - 1, -1, -1):
        ln = lines[j]
        if ln.strip() and not ln.lstrip().startswith(("#", "@")) and len(ln) - len(ln.lstrip()) < len(d.indent):
            m = re.match(r"class (\w+)", ln)
            return m.group(1) if m and not ln[0].isspace() else None
    return None


def _kind(plan: T.Plan) -> str:
    if plan.new_name:
        return "rename"
    for prefix, kind in (("Add a docstring", "docstring"), ("Change the default", "default")):
        if plan.prompt.startswith(prefix):
            return kind
    return "comment"


def test_text(t: _Target, plan: T.Plan) -> str:
    """A pytest file that fails before the task is done and passes after."""
    mod, owner, name, kind = _module(t.rel), _owner(t.orig, t.d), t.d.name, _kind(plan)
    added = next((ln for ln in plan.new if ln not in t.orig[plan.s:plan.e]), plan.new[0]).strip()
    head = [f'"""Reproduces: {plan.prompt}"""', "import inspect", "import pathlib", "",
            f"import {mod} as target", "", ""]
    if owner is None:  # not reachable by name: check the source text itself
        body = ["def test_issue():", "    src = pathlib.Path(target.__file__).read_text()",
                f"    assert {added!r} in src"]
    elif kind == "rename":
        where = f"vars(target.{owner})" if owner else "vars(target)"
        body = ["def test_issue():", f"    assert {plan.new_name!r} in {where}", f"    assert {name!r} not in {where}"]
    else:
        where = f"vars(target.{owner})" if owner else "vars(target)"
        check = {"docstring": f"obj.__doc__ == {added.strip(chr(34))!r}",
                 "comment": f"{added!r} in inspect.getsource(obj)"}.get(kind)
        if kind == "default":
            arg, value = _DEFAULT_RE.search(plan.prompt).groups()
            check = f"inspect.signature(obj).parameters[{arg!r}].default == {value}"
        body = ["def _obj():", f"    obj = {where}[{name!r}]",
                "    return getattr(obj, 'fget', None) or getattr(obj, '__func__', obj)", "", "",
                "def test_issue():", "    obj = _obj()", f"    assert {check}"]
    return "\n".join(head + body) + "\n"


def _others_use(pkg_files, t: _Target, name: str) -> bool:
    return any(rel != t.rel and S.grep(S.lines_of(str(SITE / rel)), name) for rel in pkg_files)


def pick_task(rng: random.Random, pkg: str):
    """(target, plan) on a definition of `pkg` whose task is self-contained (a rename
    never breaks another file of the package)."""
    files = [f for f in package_files(pkg) if S.defs(str(SITE / f))]
    for _ in range(60):
        rel = rng.choice(files)
        defs = [d for d in S.defs(str(SITE / rel)) if d.end - d.start < 150]
        if not defs:
            continue
        lines = S.lines_of(str(SITE / rel))
        t = _Target(SITE / rel, rel, lines, list(lines), rng.choice(defs))
        plan = T.make_plan(rng, t)
        if plan is not None and not (plan.new_name and _others_use(files, t, t.d.name)):
            return t, plan
    raise ValueError(f"no usable definition in package {pkg!r}")
