"""A scripted session (`dlite.corpus.agent.Session`) written in the layout a real agent
scaffold saves, so that collection reads it through the same readers as real runs
(`dlite.data.formats`):

  mini-swe-agent  {"trajectory_format", "info", "messages"}: the thought and one
                  ```bash block per assistant turn, outputs as user turns
                  `<returncode>..</returncode><output>..</output>` (cut past 10,000
                  chars with head / elided / tail), closed by the `exit` record
  swe-agent       a `.traj`: `history` (assistant turns with `tool_calls`, tool results
                  `OBSERVATION:` text parts naming their call in `tool_call_ids`),
                  `trajectory` steps (thought / action / observation), `info`
  openhands       two saves of one run, alternating between records: the chat messages
                  its function-calling runs are shared as (SWE-Gym: {"instance_id",
                  "messages", "tools", "git_patch"}), or its own event stream as the
                  evaluation harness writes it (an output.jsonl line {"instance_id",
                  "instruction", "history": [events], "test_result"}); tools
                  `execute_bash`, `str_replace_editor`, `finish`; bash results end
                  with the exit code

The prompts are this project's own words in each scaffold's shape; only the shapes are
the scaffolds'.
"""

import json

from dlite.corpus.agent import Session, Step
from dlite.corpus.workspace import ROOT, clip

LAYOUTS = ("mini-swe-agent", "swe-agent", "openhands")
STYLE = {"mini-swe-agent": "bash", "swe-agent": "editor", "openhands": "editor"}
MINI_CAP = 10_000
SUBMIT = "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT && git add -A && git diff --cached"

MINI_SYSTEM = (
    "You are a helpful assistant that can interact with a computer shell to solve programming tasks.\n\n"
    "Every response must contain exactly ONE bash code block with ONE command (or commands joined "
    "with && or ||). Start with a THOUGHT section explaining your reasoning, then the command:\n\n"
    "<format_example>\nTHOUGHT: why this command is the next step.\n\n```bash\nyour_command_here\n```\n"
    "</format_example>\n\nResponses in any other format are rejected.")
MINI_TASK = (
    "<pr_description>\nPlease solve this issue:\n{task}\n</pr_description>\n\n<instructions>\n"
    "You are working in the repository at {root}. Make the change to the non-test source files so "
    "that the issue is resolved, in a way that is general and consistent with the codebase.\n\n"
    "Suggested workflow:\n1. Find and read the relevant code\n2. Write a test or script that "
    "reproduces the issue\n3. Edit the source code\n4. Check that the test passes now\n"
    "5. Think about edge cases\n\nEach command runs in a new subshell: directory changes do not "
    "persist. When you are done, submit with exactly:\n\n```bash\n{submit}\n```\n\n"
    "You cannot continue working after submitting.\n</instructions>")
EDITOR_SYSTEM = (
    "You are an autonomous programmer working in a repository. You solve the task by calling the "
    "tools you have, one call per response, after a short explanation of what you are doing. The "
    "shell does not keep state between calls. `str_replace_editor` views, creates and edits files: "
    "`str_replace` needs `old_str` copied exactly (whitespace included) and occurring once.")
EDITOR_TASK = (
    "<uploaded_files>\n{root}\n</uploaded_files>\nI've uploaded a python code repository in the "
    "directory {root}. Consider the following issue description:\n\n<issue_description>\n{task}\n"
    "</issue_description>\n\nCan you help me implement the necessary changes to the repository so "
    "that the requirements in the issue are met? Follow these steps:\n1. Explore the repository to "
    "find the code involved\n2. Write a test reproducing the issue and run it\n3. Edit the source\n"
    "4. Run the test again to confirm the fix\n5. Review your diff, then {finish}.")


def _schema(name, description, props, required):
    return {"type": "function", "function": {"name": name, "description": description, "parameters": {
        "type": "object", "properties": props, "required": required}}}


_S = {"type": "string"}
OPENHANDS_TOOLS = [
    _schema("execute_bash", "Run a bash command in the terminal; output is returned with its exit code.",
            {"command": {**_S, "description": "The bash command to run."}}, ["command"]),
    _schema("str_replace_editor", "View, create and edit files. `view` shows `cat -n` output; "
            "`str_replace` replaces one exact, unique occurrence of old_str.",
            {"command": {"type": "string", "enum": ["view", "create", "str_replace", "insert"]},
             "path": {**_S, "description": "Absolute path to a file or directory."}, "file_text": _S,
             "old_str": _S, "new_str": _S, "view_range": {"type": "array", "items": {"type": "integer"}}},
            ["command", "path"]),
    _schema("finish", "Signal that the task is complete.", {"message": _S}, ["message"])]


def _mini_output(step: Step) -> str:
    head, tail, cut = clip(step.output, MINI_CAP)
    if not cut:
        return f"<returncode>{step.rc}</returncode>\n<output>\n{step.output}</output>"
    return (f"<returncode>{step.rc}</returncode>\n<warning>\nThe output of your last command was too "
            "long.\nTry a command that prints less, e.g. a line range or head/tail.\n</warning>\n"
            f"<output_head>\n{head}</output_head>\n<elided_chars>\n{cut} characters elided\n"
            f"</elided_chars>\n<output_tail>\n{tail}</output_tail>")


def mini_swe_agent(s: Session) -> dict:
    msgs = [{"role": "system", "content": MINI_SYSTEM},
            {"role": "user", "content": MINI_TASK.format(task=s.task, root=ROOT, submit=SUBMIT)}]
    for st in s.steps:
        cmd = SUBMIT if st.tool == "submit" else st.args["command"]
        msgs.append({"role": "assistant", "content": f"THOUGHT: {st.thought}\n\n```bash\n{cmd}\n```"})
        if st.tool != "submit":
            msgs.append({"role": "user", "content": _mini_output(st)})
    diff = s.steps[-1].output
    msgs.append({"role": "exit", "content": diff, "extra": {"exit_status": "Submitted", "submission": diff}})
    return {"trajectory_format": "mini-swe-agent-1.1", "instance_id": s.id, "messages": msgs,
            "info": {"mini_version": "1.17.3", "exit_status": "Submitted", "submission": diff}}


def _action(st: Step) -> str:
    """SWE-agent's text form of a call: `str_replace_editor view /p --view_range 1 9`."""
    if st.tool == "bash":
        return st.args["command"]
    if st.tool == "submit":
        return "submit"
    a = st.args
    flags = "".join(f" --{k} {json.dumps(v) if isinstance(v, str) else ' '.join(map(str, v))}"
                    for k, v in a.items() if k not in ("command", "path"))
    return f"str_replace_editor {a['command']} {a['path']}{flags}"


def _observation(st: Step) -> str:
    if st.tool == "bash" and not st.output.strip():
        return "Your command ran successfully and did not produce any output."
    return st.output


def swe_agent(s: Session) -> dict:
    task = EDITOR_TASK.format(root=ROOT, task=s.task, finish="call `submit`")
    hist = [{"role": "system", "content": EDITOR_SYSTEM, "agent": "main", "message_type": "system_prompt"},
            {"role": "user", "content": [{"type": "text", "text": task}], "agent": "main",
             "message_type": "observation"}]
    traj = []
    for i, st in enumerate(s.steps, 1):
        call = {"id": f"call_{i:02d}", "type": "function", "function": {
            "name": st.tool, "arguments": json.dumps(st.args)}}
        hist.append({"role": "assistant", "content": st.thought, "thought": st.thought,
                     "action": _action(st), "agent": "main", "tool_calls": [call], "message_type": "action"})
        hist.append({"role": "tool", "content": [{"type": "text", "text": f"OBSERVATION:\n{_observation(st)}"}],
                     "agent": "main", "message_type": "observation", "tool_call_ids": [call["id"]]})
        traj.append({"thought": st.thought, "action": _action(st), "observation": _observation(st),
                     "response": st.thought, "state": json.dumps({"working_dir": ROOT})})
    return {"environment": "swe_main", "instance_id": s.id, "history": hist, "trajectory": traj,
            "info": {"exit_status": "submitted", "submission": s.steps[-1].output}}


def _openhands_calls(s: Session):
    """(call id, tool name, args, thought, the step whose output the agent saw or None)
    per step."""
    for i, st in enumerate(s.steps, 1):
        if st.tool == "submit":
            yield f"toolu_{i:02d}", "finish", {"message": s.summary}, st.thought, None
            continue
        yield f"toolu_{i:02d}", "execute_bash" if st.tool == "bash" else st.tool, st.args, st.thought, st


def _exit_line(st: Step) -> str:
    """What OpenHands shows after a command's output (editor results: nothing)."""
    return f"\n[The command completed with exit code {st.rc}.]" if st.tool == "bash" else ""


def _openhands_task(s: Session) -> str:
    return EDITOR_TASK.format(root=f"/workspace/{s.package}", task=s.task, finish="call `finish`")


def _at_workspace(rec: dict, s: Session) -> dict:
    # OpenHands mounts the repository under /workspace, not /testbed.
    return json.loads(json.dumps(rec).replace(ROOT, f"/workspace/{s.package}"))


def _resolved(s: Session) -> bool:
    tests = [st.output for st in s.steps if st.args.get("command", "").startswith("python -m pytest")]
    return bool(tests) and " passed in " in tests[-1] and " failed" not in tests[-1]


def openhands(s: Session) -> dict:
    """The chat messages OpenHands' function-calling runs are shared as (SWE-Gym)."""
    msgs = [{"role": "system", "content": EDITOR_SYSTEM}, {"role": "user", "content": _openhands_task(s)}]
    for cid, name, args, thought, st in _openhands_calls(s):
        msgs.append({"role": "assistant", "content": thought, "tool_calls": [{
            "id": cid, "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}]})
        if st is not None:
            msgs.append({"role": "tool", "name": name, "tool_call_id": cid,
                         "content": [{"type": "text", "text": st.output + _exit_line(st)}]})
    rec = {"instance_id": s.id, "messages": msgs, "tools": OPENHANDS_TOOLS, "git_patch": s.steps[-1].output,
           "resolved": _resolved(s)}
    return _at_workspace(rec, s)


def _oh_action(name: str, args: dict, thought: str) -> tuple:
    """(OpenHands action type, its args) for a call: the event its controller records."""
    if name == "execute_bash":
        return "run", {"command": args["command"], "is_input": False, "thought": thought}
    if name == "finish":
        return "finish", {"final_thought": args["message"], "task_completed": "true", "outputs": {},
                          "thought": thought}
    kind = "read" if args.get("command") == "view" else "edit"
    return kind, {**args, "thought": thought, "impl_source": "oh_aci"}


def _oh_observation(kind: str, args: dict, st: Step) -> tuple:
    """(content, extras) of the observation answering action `kind` (a run, read or
    edit: the observation has the same type): a command's exit code in its metadata,
    and the line the agent was shown after the output as its suffix (as OpenHands saves it)."""
    if kind != "run":
        return st.output, {"path": args.get("path")}
    return st.output, {"command": args["command"], "metadata": {"exit_code": st.rc, "prefix": "",
                                                                "suffix": _exit_line(st)}}


def openhands_events(s: Session) -> dict:
    """The same run as OpenHands' evaluation harness saves it (an output.jsonl line): the
    event stream, each call with the model response that made it, each observation
    naming the action it answers (`cause`)."""
    events = [{"id": 0, "source": "agent", "action": "system",
               "args": {"content": EDITOR_SYSTEM, "tools": OPENHANDS_TOOLS}},
              {"id": 1, "source": "user", "action": "message",
               "args": {"content": _openhands_task(s), "image_urls": None}}]
    for cid, name, args, thought, st in _openhands_calls(s):
        call = {"id": cid, "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}
        meta = {"function_name": name, "tool_call_id": cid, "total_calls_in_response": 1,
                "model_response": {"id": f"chatcmpl-{s.id}-{cid}", "choices": [{"message": {
                    "role": "assistant", "content": thought, "tool_calls": [call]}}]}}
        kind, action_args = _oh_action(name, args, thought)
        act = {"id": len(events), "source": "agent", "action": kind, "args": action_args,
               "tool_call_metadata": meta}
        events.append(act)
        if st is not None:
            content, extras = _oh_observation(kind, args, st)
            events.append({"id": len(events), "source": "agent", "observation": kind, "content": content,
                           "extras": extras, "cause": act["id"], "tool_call_metadata": meta})
    rec = {"instance_id": s.id, "instruction": _openhands_task(s), "history": events, "metrics": {},
           "test_result": {"git_patch": s.steps[-1].output, "resolved": _resolved(s)}}
    return _at_workspace(rec, s)


WRITERS = {"mini-swe-agent": mini_swe_agent, "swe-agent": swe_agent, "openhands": openhands}
# OpenHands records alternate between its two saves (the event stream first).
OPENHANDS_SAVES = (openhands_events, openhands)


def writer(layout: str, i: int):
    """How record `i` of the corpus, in `layout`, is saved."""
    if layout == "openhands":
        return OPENHANDS_SAVES[(i // len(LAYOUTS)) % len(OPENHANDS_SAVES)]
    return WRITERS[layout]
