"""One scripted agent session from start to submission (`run_session`), and which
installed packages the sessions work on (`packages`, split train / held-out by package,
so held-out sessions are on code no training session opened).

The order of the turns is the one SWE-bench agents follow; how long the exploration
runs is set by the size asked for (`min_chars`..`max_chars` of history), so sessions
span the evaluation's 1-8K-token buckets. The thoughts are the scripted agent's own
short sentences (the regenerate stage replaces them with the target's answers).
"""

import hashlib
import importlib.util
import random
from typing import List

from dlite.corpus import agent as A
from dlite.corpus import source as S
from dlite.corpus.workspace import ROOT, SITE, Workspace, package_files

# Pure-Python packages of this environment that pytest itself never imports (so the
# copy under /testbed, first on sys.path, is the one a test imports).
CANDIDATES = ("alembic", "annotated_types", "attr", "blinker", "cachetools", "click", "cloudpickle",
              "dateutil", "docker", "dotenv", "einops", "filelock", "flask", "fsspec", "idna", "jinja2",
              "omegaconf", "requests", "tqdm", "werkzeug", "yaml")
HELDOUT_FRAC = 0.2
PROMPT_CHARS = 2000  # the scaffolds' system prompt + task, about

FIND = ["Let me start by exploring the repository structure.",
        "First I'll get an overview of the files in the repository.",
        "I'll begin by looking at how the package is laid out."]
LOCATE = ["Let me find where `{x}` is defined.", "I'll search for the definition of `{x}`.",
          "Now let me locate `{x}` in the code."]
OPEN = ["Let me look at `{x}` around the definition.", "I'll view the relevant part of `{x}`.",
        "Let me read the code in `{x}`."]
EXPLORE = ["Let me also look at `{x}` to understand the surrounding code.",
           "I want to see how `{x}` is organised before changing anything.",
           "Let me check `{x}` for related code."]
USES = ["Let me see where `{x}` is used.", "I'll check the call sites of `{x}`.",
        "Let me grep for `{x}` to see how it is used elsewhere."]
REPRO = ["Now I understand the code. Let me write a test that reproduces the issue.",
         "Before changing anything, I'll create a small test that captures the expected behaviour."]
RUN_FAIL = ["Let me run the test to confirm it fails.", "Let me run it to see the current behaviour."]
EDIT = ["Now I'll make the change.", "The fix is clear; let me edit the definition.",
        "I'll apply the edit now."]
BROKEN = ["The test run shows the file no longer imports; I got the indentation wrong. Let me fix it.",
          "That edit broke the module. Let me correct the indentation."]
REFS = ["Let me find the remaining references to `{x}` in this file.",
        "`{x}` is still referenced elsewhere in the file; let me list those lines."]
REPLACE = ["I'll update every reference in the file at once.", "Let me replace the old name throughout the file."]
CHECK = ["Let me view the edited lines to make sure they are right.", "Let me double-check the change."]
RUN_PASS = ["Now let me run the test again.", "Let me verify that the test passes now."]
DIFF = ["Let me review the full diff.", "Let me check the final changes with git diff."]
DONE = ["The change is complete and the test passes. I'll submit.", "Everything works; submitting the change."]


def say(rng, options, x="") -> str:
    return rng.choice(options).format(x=x)


def packages(split: str) -> List[str]:
    """The candidate packages installed here, held-out ones by a stable hash of the name."""
    have = [p for p in CANDIDATES if importlib.util.find_spec(p) is not None
            and (SITE / p).is_dir() and package_files(p)]
    ranked = sorted(have, key=lambda p: hashlib.sha256(p.encode()).hexdigest())
    held = set(ranked[:max(1, round(HELDOUT_FRAC * len(have)))])
    out = [p for p in have if (p in held) == (split == "heldout")]
    if not out:
        raise ValueError(f"no installed package for the {split!r} split of the agent corpus")
    return out


def _explore(ag: A._Agent, t, budget: int, ceiling: int) -> None:
    """Read-only turns until the history reaches `budget` chars; one that takes it past
    `ceiling` is taken back (it changed nothing)."""
    rng, files, misses = ag.rng, [f for f in package_files(t.rel.split("/")[0]) if f != t.rel], 0
    while ag.chars < budget and misses < 12:
        kind = rng.choice(("def", "def", "file", "head", "uses", "sizes"))
        rel = rng.choice(files) if files and kind in ("file", "head") else t.rel
        defs = S.defs(str(SITE / rel))
        if kind == "def" and defs:
            d = rng.choice(defs)
            step = ag.view(say(rng, EXPLORE, rel), rel, d.start + 1, min(d.end, d.start + 80))
        elif kind == "file":
            step = ag.show_file(say(rng, EXPLORE, rel), rel)
        elif kind == "head":
            step = ag.view(say(rng, EXPLORE, rel), rel, 1, rng.choice((40, 60, 100)))
        elif kind == "uses" and defs:
            name = rng.choice(defs).name
            step = ag.bash(say(rng, USES, name), f"grep -rn \"{name}\" {ROOT}/{t.rel.split('/')[0]} | head -n 25")
        else:
            step = ag.bash("Let me see how big the modules are.",
                           f"find {t.rel.split('/')[0]} -name '*.py' | sort | xargs wc -l | sort -n | tail -n 15")
        if ag.chars > ceiling or len(step.output) > 20_000:
            ag.undo(step)
            misses += 1


def _unique(lines, s: int, e: int) -> tuple:
    """[s, e) widened, a line at a time, until its text occurs once in the file (as an
    agent widens an `old_str` the tool refused as not unique)."""
    text = "\n".join(lines) + "\n"
    while text.count("\n".join(lines[s:e])) > 1 and (s > 0 or e < len(lines)):
        s, e = (s, e + 1) if e < len(lines) else (s - 1, e)
    return s, e


def _edit_phase(ag: A._Agent, t, plan) -> None:
    rng, lines = ag.rng, list(t.orig)
    a, b = _unique(lines, plan.s, plan.e)
    around = lambda mid: "\n".join(lines[a:plan.s] + list(mid) + lines[plan.e:b])  # noqa: E731
    old, new = around(lines[plan.s:plan.e]), around(plan.new)
    if plan.bad is not None:  # a first try whose indentation is wrong: the test shows it
        ag.edit(say(rng, EDIT), t.rel, old, around(plan.bad))
        ag.bash(say(rng, RUN_PASS), f"python -m pytest -x {A.TEST_FILE}")
        ag.edit(say(rng, BROKEN), t.rel, around(plan.bad), new)
    else:
        ag.edit(say(rng, EDIT), t.rel, old, new)
    if plan.new_name:
        ag.bash(say(rng, REFS, t.d.name), f"grep -n '\\b{t.d.name}\\b' {t.rel}")
        ag.bash(say(rng, REPLACE), f"sed -i 's/\\b{t.d.name}\\b/{plan.new_name}/g' {t.rel} && "
                                   f"grep -n '\\b{plan.new_name}\\b' {t.rel}")
    n = len(ag.ws.read_lines(t.rel))
    ag.view(say(rng, CHECK), t.rel, max(1, plan.s - 2), min(n, plan.s + len(plan.new) + 3))


def run_session(rng: random.Random, pkg: str, style: str, min_chars: int, max_chars: int,
                sid: str, tmp_root=None) -> A.Session:
    """One session on a fresh copy of `pkg`; its history is about min..max chars."""
    t, plan = A.pick_task(rng, pkg)
    target = rng.randint(min_chars, max(min_chars, max_chars))
    s = A.Session(sid, pkg, plan.prompt, plan.summary)
    with Workspace(pkg, rng, tmp_root) as ws:
        ag = A._Agent(ws, rng, style, s)
        if style == "editor":
            ag.show_file(say(rng, FIND), pkg)  # the editor's view of a directory
        else:
            ag.bash(say(rng, FIND), rng.choice((f"find {ROOT}/{pkg} -type f -name '*.py' | sort",
                                                f"ls {ROOT}/{pkg}", f"ls -R {pkg} | head -n 80")))
        kw = "class" if t.d.kind == "class" else "def"
        ag.bash(say(rng, LOCATE, t.d.name), rng.choice((f"grep -rn \"{kw} {t.d.name}\" {ROOT}/{pkg}",
                                                        f"grep -n \"{t.d.name}\" {t.rel}",
                                                        f"git grep -n \"{kw} {t.d.name}\"")))
        n = len(t.orig)
        ag.view(say(rng, OPEN, t.rel), t.rel, max(1, t.d.start + 1 - rng.randint(0, 10)),
                min(n, t.d.end + rng.randint(0, 10)))
        room = A.TAIL_CHARS + PROMPT_CHARS  # what the prompts and the closing turns add
        _explore(ag, t, target - room, max_chars - room)
        ag.create(say(rng, REPRO), A.TEST_FILE, A.test_text(t, plan))
        ag.bash(say(rng, RUN_FAIL), f"python -m pytest -x {A.TEST_FILE}")
        _edit_phase(ag, t, plan)
        ag.bash(say(rng, RUN_PASS), f"python -m pytest -x {A.TEST_FILE}")
        ag.bash(say(rng, DIFF), f"git diff -- {pkg}")
        _, diff = ws.sh("git add -A && git diff --cached")
        s.steps.append(A.Step(say(rng, DONE), "submit", {}, diff))
    return s
