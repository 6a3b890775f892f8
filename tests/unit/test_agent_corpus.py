"""The agent-like corpus (`data.corpus: agent`, dlite/corpus/agent*.py): its commands
really run on a copy of a real package (grep line numbers and numbered views match the
file, the test fails before the edit and passes after, git diff shows the edit), the
installed package is never touched, sessions are deterministic, and each scaffold layout
is read back by collection's own reader; a broken session is quarantined with a reason."""

import hashlib
import json
import random
import re

import pytest

from dlite.config import ConfigError, load_config
from dlite.corpus import agent_layouts as L
from dlite.corpus import agent_run, build
from dlite.corpus.workspace import SITE, Workspace
from dlite.data import formats
from pipelines.stages.collect import _prepare

GREP_HIT = re.compile(r"^(?:/testbed/)?([\w/.]+\.py):(\d+):(.*)$")
NUMBERED = re.compile(r"^ *(\d+)\t(.*)$")


@pytest.fixture(scope="module")
def sessions():
    """Sessions on two packages in both styles (seeds whose final test passes)."""
    out = {}
    for pkg, style in (("click", "bash"), ("jinja2", "editor")):
        out[style] = agent_run.run_session(random.Random(f"t:{pkg}"), pkg, style, 6000, 12000, f"s-{pkg}")
    return out


def _cmd(step):
    return step.args.get("command", "")


def test_grep_and_views_quote_the_real_file(sessions):
    checked = 0
    for s in sessions.values():
        edit_at = next(i for i, st in enumerate(s.steps) if st.args.get("command") == "str_replace"
                       or _cmd(st).startswith("python - <<"))
        for st in s.steps[:edit_at]:  # before the edit the copy equals the installed file
            for line in st.output.splitlines():
                m = GREP_HIT.match(line)
                if st.tool == "bash" and _cmd(st).startswith(("grep", "git grep")) and m:
                    rel, n, text = m.group(1).removeprefix("/testbed/"), int(m.group(2)), m.group(3)
                    assert (SITE / rel).read_text().split("\n")[n - 1] == text
                    checked += 1
            path = st.args.get("path", "").removeprefix("/testbed/")
            if st.args.get("command") == "view" and path.endswith(".py"):
                lines = (SITE / path).read_text().split("\n")
                for line in st.output.splitlines()[1:]:
                    n, text = NUMBERED.match(line).groups()
                    assert lines[int(n) - 1] == text
                    checked += 1
    assert checked > 20


def test_the_test_fails_before_the_edit_and_passes_after(sessions):
    for s in sessions.values():
        runs = [st for st in s.steps if _cmd(st).startswith("python -m pytest -x")]
        assert len(runs) >= 2
        assert runs[0].rc != 0 and ("1 failed" in runs[0].output or "error" in runs[0].output)
        assert runs[-1].rc == 0 and "1 passed in" in runs[-1].output and "rootdir: /testbed" in runs[-1].output
        diff = s.steps[-1].output
        assert diff.startswith("diff --git") and "tests/test_issue.py" in diff
        assert re.search(r"^\+(?!\+\+)", diff.split("tests/test_issue.py")[0], re.M)  # the source edit


def test_installed_files_are_never_edited():
    rel = "click/utils.py"
    before = hashlib.sha256((SITE / rel).read_bytes()).hexdigest()
    with Workspace("click", random.Random(0)) as ws:
        rc, out = ws.sh(f"sed -i 's/def /def  /' {rel} && git diff --stat")
        assert rc == 0 and "click/utils.py" in out
        assert ws.path(rel).read_bytes() != (SITE / rel).read_bytes()
        tmp = ws.tmp
    assert hashlib.sha256((SITE / rel).read_bytes()).hexdigest() == before
    assert not tmp.exists()  # the copy is removed


def test_only_timings_and_addresses_are_rewritten():
    with Workspace("idna", random.Random(0)) as ws:
        text = "MASK = 0xffffffff  # ran in 2.00s\n"
        assert ws.clean(text) == text  # file text as the file has it
        out = ws.clean(f"== 1 passed in 3.14s ==\n<function f at 0x7f00deadbeef>\n{ws.dir}/a.py")
        assert "3.14s" not in out and "0x7f00deadbeef" not in out and out.endswith("\n/testbed/a.py")


def test_sessions_are_deterministic_and_independent_of_n():
    a = build.agent_sessions("train", 3, 7, 3000, 8000)
    b = build.agent_sessions("train", 2, 7, 3000, 8000)
    assert json.dumps(a[:2]) == json.dumps(b)
    assert len({json.dumps(r) for r in a}) == 3


def test_held_out_sessions_use_held_out_packages():
    train, held = set(agent_run.packages("train")), set(agent_run.packages("heldout"))
    assert train and held and not train & held
    recs = build.heldout_records("agent", 2, 0, 6000, 9000)
    text = json.dumps(recs)
    assert any(f"{p}/" in text for p in held)


def test_each_layout_is_read_by_collects_reader(tmp_path):
    recs = build.agent_sessions("train", 3, 1, 3000, 8000)
    paths = build.write_layout_files(recs, tmp_path)
    assert sorted(p.name.split(".", 1)[-1] for p in paths) == ["jsonl", "traj", "traj.json"]
    specs, _ = formats.plan_input(str(tmp_path), per_shard=8)
    assert formats.count_formats(specs) == {"mini-swe-agent": 1, "openhands": 1, "swe-agent": 1}
    got = [json.loads(p) for p in _prepare({"spec": [json.dumps(s) for s in specs]}, [], True)["payload"]]
    assert sum(g["read"] for g in got) == 3 and not any(g["quarantine"] for g in got)
    by_id = {r["id"]: r for g in got for r in g["records"]}
    for raw in recs:
        rec = by_id[raw.get("instance_id")]
        asst = [m for m in rec["messages"] if m["role"] == "assistant"]
        fmt = formats.source_format(raw)
        if fmt == "mini-swe-agent":  # outputs are user turns; the thought and ```bash block the assistant's
            assert all(m["content"].startswith("THOUGHT: ") and "```bash\n" in m["content"] for m in asst)
            assert rec["messages"][-1]["content"].endswith(f"```bash\n{L.SUBMIT}\n```")  # exit record dropped
        else:  # one tool call per assistant turn, each answered by its tool result
            assert all(len(m["tool_calls"]) == 1 for m in asst)
            tools = [m for m in rec["messages"] if m["role"] == "tool"]
            assert len(tools) >= len(asst) - 1 and all(m["content"] for m in tools)
            root = "/workspace/" if fmt == "openhands" else "/testbed"
            assert root in json.dumps(rec)


def test_both_openhands_saves_of_a_run_read_as_one_conversation(sessions):
    """OpenHands records alternate between the shared chat messages (SWE-Gym) and its own
    event stream: collection's readers give the same conversation from either (the event
    stream's tool results carry no tool name; nothing renders it)."""
    s = sessions["editor"]
    msgs, events = L.openhands(s), L.openhands_events(s)
    assert (formats.source_format(msgs), formats.source_format(events)) == ("openai", "openhands")
    a, b = (formats.normalise(formats.to_canonical(r, "x")) for r in (msgs, events))
    plain = lambda ms: [{k: v for k, v in m.items() if k != "name"} for m in ms]  # noqa: E731
    assert plain(a["messages"]) == plain(b["messages"]) and a["tools"] == b["tools"]
    assert [e.get("observation") for e in events["history"] if "observation" in e].count("run") >= 1
    assert [L.writer("openhands", i) for i in (2, 5, 8)] == [L.openhands_events, L.openhands, L.openhands_events]


def test_a_broken_session_is_quarantined_with_its_reason(tmp_path):
    recs = build.agent_sessions("train", 2, 2, 3000, 6000)
    swe = json.loads(json.dumps(recs[1]))
    swe["instance_id"] = "broken-swe"
    swe["history"][3]["tool_call_ids"] = ["call_none"]  # a result answering no call
    mini = {**recs[0], "instance_id": "broken-mini", "messages": [{"role": "wizard", "content": "x"}]}
    (tmp_path / "runs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in (recs[0], swe, mini))
                                         + '{"history": [truncated\n')
    specs, _ = formats.plan_input(str(tmp_path), per_shard=8)
    got = json.loads(_prepare({"spec": [json.dumps(specs[0])]}, [], True)["payload"][0])
    assert got["read"] == 4 and len(got["records"]) == 1
    assert sorted(q["reason"] for q in got["quarantine"]) == ["bad_json", "tool_without_call", "unknown_role"]


def test_corpus_kinds_and_input_file(tmp_path):
    mixed = list(build.generate("mixed", "train", 3, 0, 3000, 6000))
    assert [formats.source_format(r) for r in mixed] == ["openai", "mini-swe-agent", "openai"]
    assert mixed[0]["id"] == "train-000000" and mixed[1]["instance_id"].startswith("agent-train__")
    # The package in the id, as SWE-bench's <owner>__<repo>-<number>: a training package
    from dlite.corpus import agent_run
    from dlite.train.plan import record_group
    assert record_group(mixed[1]["instance_id"], r"^(.+)-\d+$")[len("agent-train__"):] in agent_run.packages("train")
    p = build.input_file(tmp_path, "agent", "heldout", 2, 0, 3000, 6000)
    assert p.name == "input-agent-heldout-n2-s0-c3000-6000-ids2.jsonl" and len(p.read_text().splitlines()) == 2
    assert build.input_file(tmp_path, "builtin", "train", 1, 0, 3000, 6000).name == "input-train-n1-s0.jsonl"
    with pytest.raises(ValueError, match="data.corpus"):
        list(build.generate("bogus", "train", 1, 0, 3000, 6000))
    # today's held-out split is unchanged by the switch
    from dlite.corpus import trajectories
    assert build.heldout_records("builtin", 2, 0, 3000, 6000) == list(trajectories.generate("heldout", 2, 0, 3000, 6000))


def test_config_names_the_bad_corpus_key():
    assert load_config("configs/experiments/tiny.yaml", ["data.corpus=agent"]).data.corpus == "agent"
    with pytest.raises(ConfigError, match="data.corpus"):
        load_config("configs/experiments/tiny.yaml", ["data.corpus=agents"])


def test_stages_built_on_the_old_agent_ids_are_not_reused(tmp_path, monkeypatch):
    """The agent corpus's ids name their package since id scheme 2 (what data.val_group
    reads): regeneration and collection on a built agent corpus hash the scheme, so a
    run finished on the old ids is redone; the built-in corpus's hashes do not move."""
    from dlite.config import load_config
    from pipelines.orchestration import dag
    out = [f"run.output_dir={tmp_path}"]
    for corpus, moves in (("agent", ["collect"]), ("builtin", [])):
        cfg = load_config("configs/experiments/tiny.yaml", out + [f"data.corpus={corpus}"])
        now = {s.name: s.hash for s in dag.plan(cfg)}
        monkeypatch.setattr(build, "AGENT_IDS", 1)
        old = {s.name: s.hash for s in dag.plan(cfg)}
        monkeypatch.undo()
        assert [k for k in ("collect", "teacher") if now[k] != old[k]][:1] == moves
