"""OpenHands trajectories: the saved event list and the evaluation output.jsonl record
(tests/fixtures/trajectories/openhands_*) become exact chat messages, calls paired with
their results; events saved without the model's call, old [action, observation] pairs,
the quarantines; detection leaves every other fixture's format as it was; and files of
OpenHands records go through plan_input / read_spec / to_canonical like any input."""

import json
from pathlib import Path

import pytest

from dlite.data import formats
from dlite.data.formats import Quarantine

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "trajectories"
TASK = "Please fix the typo in hello.py: it prints 'helo world'."
DONE = "Fixed: hello.py now prints 'hello world'."
EDIT = {"command": "str_replace", "path": "/workspace/hello.py", "old_str": "helo",
        "new_str": "hello"}
EDITED = ("The file /workspace/hello.py has been edited. Here's the result of running `cat -n` "
          "on a snippet of /workspace/hello.py:\n     1\tprint('hello world')\n")
OK = "\n[The command completed with exit code 0.]"


def _call(cid, name, args):
    return {"id": cid, "type": "function", "function": {"name": name, "arguments": args}}


def _canon(raw, where="x", keep_reasoning=False):
    return formats.normalise(formats.to_canonical(raw, where, keep_reasoning))


def _reason(raw) -> str:
    with pytest.raises(Quarantine) as e:
        _canon(raw)
    return e.value.reason


def _fixture(name):
    specs, _ = formats.plan_input(str(FIXTURES / name), per_shard=10)
    return [raw for s in specs for _, _, raw in formats.read_spec(s)]


def test_saved_event_list_becomes_exact_messages():
    """System prompt and tools from the system action; recall, state changes dropped;
    each call read from the model's response; finish kept as the call it was."""
    (raw,) = _fixture("openhands_trajectory.json")
    rec = _canon(raw, "openhands_trajectory.json")
    assert (rec["id"], rec["source_format"]) == ("openhands_trajectory.json", "openhands")
    assert rec["messages"] == [
        {"role": "system", "content": "You are OpenHands agent, a helpful AI assistant that can "
                                      "interact with a computer to solve tasks."},
        {"role": "user", "content": TASK},
        {"role": "assistant", "content": "Let me look at the file first.",
         "tool_calls": [_call("toolu_01", "execute_bash", {"command": "cat hello.py"})]},
        {"role": "tool", "content": "print('helo world')" + OK, "tool_call_id": "toolu_01"},
        {"role": "assistant", "content": "Found it: one letter is missing.",
         "tool_calls": [_call("toolu_02", "str_replace_editor", EDIT)]},
        {"role": "tool", "content": EDITED, "tool_call_id": "toolu_02"},
        {"role": "assistant", "content": "", "tool_calls": [
            _call("toolu_03", "finish", {"message": DONE, "task_completed": "true"})]}]
    assert [t["function"]["name"] for t in rec["tools"]] == ["execute_bash", "str_replace_editor",
                                                             "finish"]


def test_eval_output_record_joins_the_calls_of_one_response():
    """output.jsonl: two calls of one model response (run one by one, results between)
    make one assistant turn followed by both results, in call order."""
    (raw,) = _fixture("openhands_output.jsonl")
    rec = _canon(raw)
    assert (rec["id"], rec["source_format"], rec["tools"]) == ("fix-typo-openhands-eval",
                                                               "openhands", [])
    assert rec["messages"] == [
        {"role": "user", "content": TASK},
        {"role": "assistant", "content": "Let me look at the file and run it.", "tool_calls": [
            _call("toolu_11", "execute_bash", {"command": "cat hello.py"}),
            _call("toolu_12", "execute_bash", {"command": "python hello.py"})]},
        {"role": "tool", "content": "print('helo world')" + OK, "tool_call_id": "toolu_11"},
        {"role": "tool", "content": "helo world" + OK, "tool_call_id": "toolu_12"},
        {"role": "assistant", "content": "Found it: one letter is missing.",
         "tool_calls": [_call("toolu_13", "str_replace_editor", EDIT)]},
        {"role": "tool", "content": EDITED, "tool_call_id": "toolu_13"},
        {"role": "assistant", "content": DONE}]


def _ev(i, **kw):
    return {"id": i, "source": "agent", **kw}


def test_events_without_saved_calls_pairs_and_the_instruction():
    """A non-function-calling run in the old [action, observation] pair layout: the call
    is named by the action type with its arguments, results found by `cause`; with no
    user message the record's `instruction` is the task; an error with no cause is a
    notice to the model (user); reasoning from the model response kept on request."""
    pairs = [
        [_ev(1, action="run", args={"command": "ls", "thought": "Look first.", "blocking": False,
                                    "is_input": False, "hidden": False}),
         _ev(2, cause=1, observation="run", content="hello.py",
             extras={"command": "ls", "metadata": {"exit_code": 0}})],
        [_ev(3, action="edit", args={"path": "hello.py", "command": "str_replace",
                                     "old_str": "helo", "new_str": "hello", "file_text": None,
                                     "thought": "Fix it.", "impl_source": "oh_aci"}),
         _ev(4, cause=3, observation="error", content="old_str not found")],
        [_ev(5, source="environment", observation="error", content="Agent got stuck in a loop"),
         _ev(6, source="environment", observation="agent_state_changed", content="",
             extras={"agent_state": "error"})]]
    rec = _canon({"instance_id": "old-1", "instruction": "Fix hello.py", "history": pairs,
                  "test_result": {}})
    assert rec["messages"] == [
        {"role": "user", "content": "Fix hello.py"},
        {"role": "assistant", "content": "Look first.",
         "tool_calls": [_call("openhands-1", "run", {"command": "ls"})]},
        {"role": "tool", "content": "hello.py", "tool_call_id": "openhands-1"},
        {"role": "assistant", "content": "Fix it.", "tool_calls": [_call("openhands-3", "edit", {
            "command": "str_replace", "path": "hello.py", "old_str": "helo", "new_str": "hello"})]},
        {"role": "tool", "content": "old_str not found", "tool_call_id": "openhands-3"},
        {"role": "user", "content": "Agent got stuck in a loop"}]
    think = {"id": "r1", "choices": [{"message": {"role": "assistant", "content": "Hm.",
                                                  "reasoning_content": "Which file?",
                                                  "tool_calls": []}}]}
    events = [{"id": 0, "source": "user", "action": "message", "args": {"content": "go"}},
              _ev(1, action="think", args={"thought": "Plan: read, fix."},
                  tool_call_metadata={"function_name": "think", "tool_call_id": "t1",
                                      "model_response": think}),
              _ev(2, cause=1, observation="think", content="Your thought has been logged.")]
    msgs = _canon(events, keep_reasoning=True)["messages"]
    assert msgs[1] == {"role": "assistant", "content": "Hm.", "reasoning_content": "Which file?",
                       "tool_calls": [_call("t1", "think", {"thought": "Plan: read, fix."})]}
    assert "reasoning_content" not in _canon(events)["messages"][1]


def test_a_user_speaking_during_a_call_keeps_the_result_with_its_call():
    events = [{"id": 0, "source": "user", "action": "message", "args": {"content": "go"}},
              _ev(1, action="run", args={"command": "sleep 9", "thought": ""}),
              {"id": 2, "source": "user", "action": "message", "args": {"content": "hurry"}},
              _ev(3, cause=1, observation="run", content="done")]
    assert [m["role"] for m in _canon(events)["messages"]] == ["user", "assistant", "tool", "user"]


USER = {"id": 0, "source": "user", "action": "message", "args": {"content": "go"}}
RUN = _ev(1, action="run", args={"command": "ls"})


@pytest.mark.parametrize("raw, reason", [
    ([USER, RUN, _ev(2, cause=99, observation="run", content="x")], "tool_without_call"),
    ([USER, _ev(2, observation="run", content="orphan")], "tool_without_call"),
    ([USER, _ev(1, action="message", args={"content": "hi"}),
      _ev(2, cause=1, observation="run", content="x")], "tool_without_call"),
    ([RUN, _ev(2, cause=1, observation="run", content="x")], "no_user_task"),
    ({"instance_id": "i", "instruction": "  ", "history": [RUN], "test_result": {}},
     "no_user_task"),
    ({"instance_id": "i", "instruction": "go", "history": [], "test_result": {}, "error": "boom"},
     "no_assistant_turn"),
    ([USER, RUN, "not an event"], "bad_record"),
    ([USER, _ev(1, action="run", args="ls")], "bad_record"),
    ([{**USER, "args": {"content": "see", "image_urls": ["data:image/png;base64,AA"]}}, RUN],
     "non_text_content"),
    ([USER, RUN, _ev(2, cause=1, observation="run", content=[{"type": "image"}])],
     "non_text_content"),
])
def test_quarantine_reasons(raw, reason):
    assert _reason(raw) == reason


# Every other fixture, as detected before OpenHands was read.
BEFORE = {"anthropic_messages.json": "anthropic", "mini_swe_agent_bare.traj.json": "mini-swe-agent",
          "mini_swe_agent_responses.traj.json": "mini-swe-agent/responses",
          "mini_swe_agent_toolcall.traj.json": "mini-swe-agent", "openai_chat.jsonl": "openai",
          "responses_api.json": "responses", "sharegpt.json": "sharegpt",
          "swe_agent.traj": "swe-agent"}


def test_detection_leaves_the_other_formats_alone():
    names = sorted(p.name for p in FIXTURES.iterdir() if not p.name.startswith("openhands_"))
    assert names == sorted(BEFORE)
    for name in names:
        assert {formats.source_format(raw) for raw in _fixture(name)} == {BEFORE[name]}, name
    # SWE-agent steps carry `action` and `observation` too, but no `source`: not events.
    steps = {"trajectory": [{"action": "ls", "observation": "a.py", "thought": "t"}]}
    assert formats.source_format(steps) == "swe-agent"
    assert formats.source_format({"messages": [USER], "history": [USER]}) == "openai"
    # An evaluation output whose run failed before any event is still OpenHands'.
    failed = {"instance_id": "i", "history": [], "test_result": {}}
    assert formats.source_format(failed) == "openhands"


def test_openhands_files_are_planned_read_and_counted(tmp_path):
    """A JSONL file of output records, and one saved event list (compact, as OpenHands
    writes it, or pretty-printed): each list is one record, never one per event."""
    (raw,) = _fixture("openhands_output.jsonl")
    d = tmp_path / "in"
    d.mkdir()
    (d / "a_output.jsonl").write_text("".join(
        json.dumps({**raw, "instance_id": f"r{i}"}) + "\n" for i in range(3)))
    (events,) = _fixture("openhands_trajectory.json")
    (d / "b_session.json").write_text(json.dumps(events))
    (d / "c_session.json").write_text(json.dumps(events, indent=2))
    specs, _ = formats.plan_input(str(d), per_shard=2)
    got = [(w, _canon(raw, w)) for s in specs for _, w, raw in formats.read_spec(s)]
    assert [(w, r["id"]) for w, r in got] == [
        ("a_output.jsonl:1", "r0"), ("a_output.jsonl:2", "r1"), ("a_output.jsonl:3", "r2"),
        ("b_session.json", "b_session.json"), ("c_session.json", "c_session.json")]
    assert all(len(r["messages"]) == 7 for _, r in got)
    assert formats.count_formats(specs) == {"openhands": 5}
