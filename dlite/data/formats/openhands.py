"""OpenHands trajectories (its V0 event stream) -> OpenAI chat messages.

OpenHands saves a run as its event stream: a JSON list of events (`save_trajectory_path`,
the server's trajectory download `{"trajectory": [events]}`) or, from its evaluation
harness, an output.jsonl line `{"instance_id", "instruction", "history": [events],
"metrics", "test_result", ...}` (older harnesses: `history` as [action, observation]
pairs). An event is one of

  action       {"id", "source", "action": "message" | "run" | "edit" | "finish" | ...,
                "args", "tool_call_metadata"?: {"function_name", "tool_call_id",
                "model_response": the LLM's chat completion}}
  observation  {"id", "source", "observation": "run" | "edit" | "error" | ...,
                "content", "extras", "cause": id of the action it answers,
                "tool_call_metadata"?}

and becomes, as the agent's LLM saw it:

  system action                  system message (its `args.tools`: the record's tools)
  message action                 user / assistant text, by its source
  other agent actions            assistant turn: the model's text and the call it made,
                                 read from `model_response` when saved, else built from
                                 the action type and its args; the calls of one model
                                 response (same response id) share one turn
  observation answering a call   tool message right after that turn (matched by `cause`,
                                 else by its tool_call_id); an error with no cause is a
                                 user message (the controller's notice to the model)

State changes, "null" observations, recalls, condensations, hidden events and commands
the user ran are bookkeeping, not turns: dropped, with the observations they caused.
"""

from typing import Optional, Tuple

from dlite.data.formats.errors import Quarantine
from dlite.data.formats.messages import part_text, tool_call

SOURCES = {"user", "agent", "environment"}
SKIP_ACTIONS = {"change_agent_state", "recall", "condensation", "condensation_request",
                "null", "start", "pause", "resume", "stop"}
SKIP_OBSERVATIONS = {"agent_state_changed", "null", "recall", "condense", "microagent",
                     "workspace_context"}
# The args that are the call's arguments, per action type, for actions saved without the
# model's own call (non-function-calling agents); the rest are runtime settings.
CALL_ARGS = {"run": ("command",), "run_ipython": ("code",), "read": ("path", "view_range"),
             "write": ("path", "content"), "browse": ("url",), "think": ("thought",),
             "edit": ("command", "path", "file_text", "old_str", "new_str", "insert_line",
                      "content"),
             "browse_interactive": ("browser_actions",), "delegate": ("agent", "inputs"),
             "finish": ("final_thought", "task_completed", "outputs"),
             "mcp": ("name", "arguments"), "task_tracking": ("command", "task_list")}
REASONING_KEYS = ("reasoning_content", "reasoning", "thinking_blocks")


def is_event(e) -> bool:
    """An OpenHands event: a `source` and exactly one of `action` / `observation`
    (SWE-agent steps have both and no source; chat messages have a role)."""
    return isinstance(e, dict) and e.get("source") in SOURCES and \
        ("action" in e) != ("observation" in e) and \
        isinstance(e.get("action", e.get("observation")), str)


def flatten(items: list) -> list:
    """Events in order, whether listed or kept as [action, observation] pairs."""
    out = []
    for x in items:
        out.extend(x if isinstance(x, (list, tuple)) else [x])
    return out


def looks_like_events(items) -> bool:
    return isinstance(items, list) and any(is_event(e) for e in flatten(items))


def holds_events(raw: dict, key: str) -> bool:
    """`raw[key]` is OpenHands history: events, or the list of an evaluation output (its
    `instance_id` + `test_result`) even when empty, so a failed run is named openhands."""
    items = raw.get(key)
    return looks_like_events(items) or \
        (isinstance(items, list) and "test_result" in raw and "instance_id" in raw)


def _metadata(e: dict) -> dict:
    """An event's `tool_call_metadata` ({} if absent or not an object)."""
    meta = e.get("tool_call_metadata")
    return meta if isinstance(meta, dict) else {}


def _model_message(meta) -> dict:
    """The assistant message of the model response that made a call ({} if not saved)."""
    try:
        msg = meta["model_response"]["choices"][0]["message"]
    except (KeyError, IndexError, TypeError):
        return {}
    return msg if isinstance(msg, dict) else {}


def _arguments(kind: str, args: dict) -> dict:
    keys = CALL_ARGS.get(kind) or [k for k in args if k != "thought"]
    return {k: args[k] for k in keys if args.get(k) not in (None, "", [], {})}


def _model_call(e: dict, meta: dict, msg: dict) -> Optional[dict]:
    """The call as the model wrote it (name, argument text), else as OpenHands named it."""
    tid = meta.get("tool_call_id")
    for c in msg.get("tool_calls") or []:
        if isinstance(c, dict) and c.get("id") == tid and isinstance(c.get("function"), dict):
            return tool_call(tid, c["function"].get("name"), c["function"].get("arguments"))
    if meta.get("function_name"):
        return tool_call(tid or f"openhands-{e.get('id')}", meta["function_name"],
                         _arguments(e["action"], e.get("args") or {}))
    return None


class _Reader:
    """The messages so far, and which call each action event became."""

    def __init__(self):
        self.out, self.tools = [], []
        self.call_of, self.turn_of_call = {}, {}  # action id -> call id; call id -> its turn
        self.by_response = {}  # model response id -> the assistant turn of its calls
        self.dropped = set()  # ids of events that are no turn (their observations go too)
        self.asked = False  # did the user say anything (else the task is the instruction)

    def action(self, e: dict) -> None:
        kind, args, who = e["action"], e.get("args") or {}, e.get("source")
        if not isinstance(args, dict):
            raise Quarantine("bad_record", f"OpenHands event {e.get('id')}: args is not an object")
        if kind in SKIP_ACTIONS or args.get("hidden") is True or \
                (who == "user" and kind not in ("message", "system")):
            self.dropped.add(e.get("id"))
        elif kind == "system":
            self.out.append({"role": "system", "content": args.get("content")})
            self.tools = args.get("tools") or []
        elif kind == "message":
            if args.get("image_urls"):  # as elsewhere: the drafter is trained on text only
                raise Quarantine("non_text_content", f"OpenHands event {e.get('id')}: images")
            self.out.append({"role": "user" if who == "user" else "assistant",
                             "content": args.get("content")})
            self.asked = self.asked or who == "user"
        else:
            self._call(e, kind, args)

    def _call(self, e: dict, kind: str, args: dict) -> None:
        meta = _metadata(e)
        msg = _model_message(meta)
        call = _model_call(e, meta, msg) or tool_call(f"openhands-{e.get('id')}", kind,
                                                       _arguments(kind, args))
        rid = (meta.get("model_response") or {}).get("id") if msg else None
        turn = self.by_response.get(rid) if rid else None
        if turn is None:  # the first (or only) call of this model response opens its turn
            text = msg.get("content") if msg.get("content") is not None else \
                ("" if kind == "think" else args.get("thought"))
            turn = {"role": "assistant", "content": text, "tool_calls": [],
                    **{k: msg[k] for k in REASONING_KEYS if msg.get(k)}}
            self.out.append(turn)
            if rid:
                self.by_response[rid] = turn
        turn["tool_calls"].append(call)
        self.call_of[e.get("id")], self.turn_of_call[call["id"]] = call["id"], turn

    def observation(self, e: dict) -> None:
        kind, cause, extras = e["observation"], e.get("cause"), e.get("extras") or {}
        if kind in SKIP_OBSERVATIONS or (cause is not None and cause in self.dropped) or \
                (isinstance(extras, dict) and extras.get("hidden") is True):
            return
        meta = _metadata(e)
        call_id = self.call_of.get(cause) if cause is not None else None
        if call_id is None and isinstance(meta.get("tool_call_id"), str) and \
                meta["tool_call_id"] in self.turn_of_call:
            call_id = meta["tool_call_id"]
        text = _result(e, extras)
        if call_id is not None:
            self._answer(call_id, text)
        elif cause is None and kind == "error":
            self.out.append({"role": "user", "content": text})
        else:
            raise Quarantine("tool_without_call", f"OpenHands event {e.get('id')}: a {kind!r} "
                                                  f"observation of cause {cause!r} answers no call")

    def _answer(self, call_id: str, text: str) -> None:
        # Right after the call's turn and the results already there: OpenHands runs a
        # response's calls one by one (and a user may speak meanwhile), chat wants them together.
        turn = self.turn_of_call[call_id]
        at = next(j for j, m in enumerate(self.out) if m is turn) + 1
        while at < len(self.out) and self.out[at]["role"] == "tool":
            at += 1
        self.out.insert(at, {"role": "tool", "tool_call_id": call_id, "content": text})


def _result(e: dict, extras) -> str:
    """An observation's text; a command's with the prefix/suffix the agent was shown
    (e.g. "[The command completed with exit code 0.]")."""
    text = part_text(e.get("content"), f"OpenHands event {e.get('id')}")
    meta = extras.get("metadata") if isinstance(extras, dict) else None
    if e["observation"] == "run" and isinstance(meta, dict):
        text = f"{meta.get('prefix') or ''}{text}{meta.get('suffix') or ''}"
    return text


def to_messages(raw, key: str) -> Tuple[list, list]:
    """(messages, tools) of an OpenHands event list (`key` ""), or of a record's
    `history` / `trajectory`; the record's `instruction` is the task if no user spoke."""
    r = _Reader()
    for e in flatten(raw[key] if key else raw):
        if not is_event(e):
            raise Quarantine("bad_record", "an OpenHands event that is neither an action nor "
                                           "an observation")
        if "action" in e:
            r.action(e)
        else:
            r.observation(e)
    msgs = r.out
    if not r.asked:
        task = raw.get("instruction") if isinstance(raw, dict) else None
        if not isinstance(task, str) or not task.strip():
            raise Quarantine("no_user_task", "an OpenHands run without a user message or "
                                             "an `instruction`")
        msgs.insert(1 if msgs and msgs[0]["role"] == "system" else 0,
                    {"role": "user", "content": task})
    return msgs, r.tools
