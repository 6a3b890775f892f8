"""Which built-in corpus the stages read (`data.corpus`), and the prompts added to it
(`data.extra_prompts`).

  builtin  `dlite.corpus.trajectories`: synthetic sessions with JSON tool calls over
           standard-library source (today's corpus)
  agent    `dlite.corpus.agent_run`: a scripted agent running real commands on copies of
           installed packages, saved as mini-swe-agent / SWE-agent / OpenHands runs
           (record i in layout i % 3; OpenHands ones alternate between its event
           stream and SWE-Gym messages); held-out sessions are on held-out packages
  mixed    the two interleaved: even records builtin, odd records agent

Record i never depends on n (each has its own seeded generator), so a held-out set of 3
is the first 3 of a held-out set of 8. Agent sessions run their commands in threads:
the time goes to subprocesses, not Python.

Extra prompts: a JSONL of `{"turns": [str, ...]}` (e.g. SWE-bench issue texts) becomes
conversations of one user turn, the prompt's first, for the regenerate stage to answer;
a line that is not such a prompt is passed on as it is, for the stage's reader to
quarantine with its reason.
"""

import hashlib
import json
import random
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Iterator, List, Optional

from dlite.corpus import agent_layouts as L
from dlite.corpus import agent_run
from dlite.corpus import trajectories

KINDS = ("builtin", "agent", "mixed")
THREADS = 4
AGENT_IDS = 2  # the agent sessions' id scheme, part of their input file's name


def _agent_one(split: str, seed: int, i: int, min_chars: int, max_chars: int) -> dict:
    rng = random.Random(f"dlite-agent:{split}:{seed}:{i}")
    layout = L.LAYOUTS[i % len(L.LAYOUTS)]
    pkg = rng.choice(agent_run.packages(split))
    # The package in the id, as SWE-bench names an instance by its repository
    # (`<owner>__<repo>-<number>`): `data.val_group` can then validate on packages the
    # training rows never read, as the held-out split does.
    sid = f"agent-{split}__{pkg}-{i:06d}"
    s = agent_run.run_session(rng, pkg, L.STYLE[layout], min_chars, max_chars, sid)
    return L.writer(layout, i)(s)


def agent_sessions(split: str, n: int, seed: int, min_chars: int, max_chars: int,
                   first: int = 0) -> List[dict]:
    """Records first..first+n-1 of the agent corpus, in their scaffolds' layouts."""
    if split not in ("train", "heldout"):
        raise ValueError(f"split must be 'train' or 'heldout', got {split!r}")
    with ThreadPoolExecutor(THREADS) as pool:
        return list(pool.map(lambda i: _agent_one(split, seed, i, min_chars, max_chars),
                             range(first, first + n)))


def generate(kind: str, split: str, n: int, seed: int, min_chars: int, max_chars: int) -> Iterator[dict]:
    """`n` raw records of corpus `kind` (builtin ones canonical, agent ones in layouts)."""
    if kind not in KINDS:
        raise ValueError(f"data.corpus must be one of {KINDS}, got {kind!r}")
    if kind == "builtin":
        yield from trajectories.generate(split, n, seed, min_chars, max_chars)
        return
    if kind == "agent":
        yield from agent_sessions(split, n, seed, min_chars, max_chars)
        return
    built = list(trajectories.generate(split, (n + 1) // 2, seed, min_chars, max_chars))
    agent = agent_sessions(split, n // 2, seed, min_chars, max_chars)
    for i in range(n):
        yield built[i // 2] if i % 2 == 0 else agent[i // 2]


def heldout_records(kind: str, n: int, seed: int, min_chars: int, max_chars: int) -> List[dict]:
    """The held-out split of corpus `kind` as canonical, validated records (what the
    evaluation replays), read through collection's own format layer; today's corpus
    exactly as `trajectories.generate` writes it (already canonical)."""
    from dlite.data import formats
    if kind == "builtin":
        return list(trajectories.generate("heldout", n, seed, min_chars, max_chars))
    out = []
    for i, raw in enumerate(generate(kind, "heldout", n, seed, min_chars, max_chars)):
        rec = formats.normalise(formats.to_canonical(raw, f"heldout#{i}"))
        out.append({k: rec[k] for k in ("id", "messages", "tools")})
    return out


# ------------------------------------------------------------------ extra prompts

def prompt_record(raw) -> Optional[dict]:
    """A `{"turns": [...]}` prompt as a one-user-turn conversation, or None."""
    if not isinstance(raw, dict) or not isinstance(raw.get("turns"), list) or not raw["turns"]:
        return None
    first = raw["turns"][0]
    if not isinstance(first, str) or not first.strip():
        return None
    rid = next((str(raw[k]) for k in ("id", "instance_id") if raw.get(k) not in (None, "")), None)
    return {"id": f"prompt-{rid}" if rid else None, "messages": [{"role": "user", "content": first}]}


def prompt_lines(path, limit: int = 0) -> List[str]:
    """JSONL lines for the prompts file (at most `limit`; 0: all): converted prompts, and
    anything else verbatim (quarantined downstream, with its reason)."""
    out = []
    for n, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines()):
        if not line.strip():
            continue
        if limit and len(out) >= limit:
            break
        try:
            rec = prompt_record(json.loads(line))
        except ValueError:
            rec = None
        if rec is not None:
            rec["id"] = rec["id"] or f"prompt-{n + 1}"
        out.append(line if rec is None else json.dumps(rec, ensure_ascii=False))
    return out


def input_file(root: Path, kind: str, split: str, n: int, seed: int, min_chars: int, max_chars: int,
               prompts: Optional[str] = None, limit: int = 0) -> Path:
    """The corpus (plus, for training, the extra prompts) written once as JSONL under
    `root`; the name holds everything that decides the content."""
    name = f"input-{split}-n{n}-s{seed}"  # today's name for today's corpus: old runs resume
    if kind != "builtin" or prompts:
        name = f"input-{kind}-{split}-n{n}-s{seed}-c{min_chars}-{max_chars}"
    if kind != "builtin":
        name += f"-ids{AGENT_IDS}"  # agent sessions' ids name their package since version 2
    if prompts:
        digest = hashlib.sha256(Path(prompts).read_bytes()).hexdigest()[:12]
        name += f"-p{digest}-{limit}"
    path = root / f"{name}.jsonl"
    if not path.exists():
        lines = [json.dumps(r, ensure_ascii=False)
                 for r in generate(kind, split, n, seed, min_chars, max_chars)]
        lines += prompt_lines(prompts, limit) if prompts else []
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text("".join(x + "\n" for x in lines), encoding="utf-8")
        tmp.replace(path)
    return path


def write_layout_files(records: List[dict], out_dir) -> List[Path]:
    """Each record in the file its scaffold writes: mini-swe-agent `<id>/<id>.traj.json`,
    SWE-agent `<id>/<id>.traj`, OpenHands lines of `output.jsonl`."""
    from dlite.data.formats import source_format
    out_dir, paths, oh = Path(out_dir), [], []
    for r in records:
        fmt, rid = source_format(r), r.get("instance_id") or r.get("id")
        if fmt.startswith("mini-swe-agent") or fmt.startswith("swe-agent"):
            p = out_dir / rid / (f"{rid}.traj.json" if fmt.startswith("mini") else f"{rid}.traj")
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_text(json.dumps(r, indent=2, ensure_ascii=False), encoding="utf-8")
            paths.append(p)
        else:
            oh.append(json.dumps(r, ensure_ascii=False))
    if oh:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "output.jsonl").write_text("".join(x + "\n" for x in oh), encoding="utf-8")
        paths.append(out_dir / "output.jsonl")
    return paths
