"""From a raw record of any supported shape to the canonical `{"id", "messages", "tools",
"source_format"}`, the format read from the content alone (never the file name).

  shape (first that matches)                          source_format
  a bare list of messages                             mini-swe-agent[/dialect]
  {"messages"} with mini-swe-agent's `info.mini_version`
      or `trajectory_format: mini-swe-agent-*`        mini-swe-agent[/dialect]
  {"messages"} with a top-level `system`              anthropic
  {"messages"} otherwise                              openai | anthropic | responses
  {"conversations"} / {"conversation"}                sharegpt
  a bare list of OpenHands events, or {"history"} /
      {"trajectory"} holding them (its output.jsonl)  openhands
  {"history"} / {"trajectory"} (SWE-agent .traj)      swe-agent[/dialect]
  {"turns"}                                           deepspec
  {"input", "output"?, "instructions"?}               responses (a logged request)

The dialect (openai / anthropic / responses) is that of the messages themselves; see
`messages.py` (OpenHands events: `openhands.py`). Tools in Anthropic (`input_schema`) or
Responses (flat) form become OpenAI function tools, so the chat template renders them
the same whatever the source.
"""

import json
from collections import Counter
from typing import Tuple

from dlite.data.formats import containers, openhands
from dlite.data.formats.errors import Quarantine
from dlite.data.formats.inputs import read_spec
from dlite.data.formats.messages import dialect, looks_like_messages, to_openai

# (key, container, adapter of that list to messages; None: it already is one)
SHAPES = (("messages", "openai", None), ("conversations", "sharegpt", containers.sharegpt),
          ("conversation", "sharegpt", containers.sharegpt),
          ("history", "swe-agent", containers.swe_history),
          ("trajectory", "swe-agent", containers.swe_steps),
          ("turns", "deepspec", containers.turns), ("input", "responses", None))
MESSAGE_LISTS = ("openai", "mini-swe-agent", "swe-agent")


def record_id(raw, fallback: str) -> str:
    """The record's own id (`id`, `instance_id`, `info.instance_id`...), else `fallback`."""
    if not isinstance(raw, dict):
        return fallback
    for key in ("id", "instance_id", "uuid", "conversation_id"):
        v = raw.get(key)
        if isinstance(v, (str, int)) and not isinstance(v, bool) and str(v):
            return str(v)
    info = raw.get("info")
    if isinstance(info, dict) and isinstance(info.get("instance_id"), str):
        return info["instance_id"]
    return fallback


def _seen(raw) -> str:
    """What an unreadable record looks like, for its quarantine detail."""
    if isinstance(raw, dict):
        return f"an object with keys {sorted(raw)[:8]}"
    if isinstance(raw, list):
        first = type(raw[0]).__name__ if raw else "nothing"
        keys = f" with keys {sorted(raw[0])[:8]}" if raw and isinstance(raw[0], dict) else ""
        return f"a list of {len(raw)} items that are not messages (the first a {first}{keys})"
    return f"a JSON {type(raw).__name__}"


def _shape(raw) -> Tuple[str, str]:
    """(container, key of the turns list; "" for a bare list), or unknown_format."""
    if isinstance(raw, list) and (not raw or looks_like_messages(raw)):
        return "mini-swe-agent", ""
    if isinstance(raw, list) and openhands.looks_like_events(raw):
        return "openhands", ""
    if isinstance(raw, dict):
        for key, container, _ in SHAPES:
            # OpenHands keeps its events under the keys SWE-agent uses for steps/messages
            if key in ("history", "trajectory") and openhands.holds_events(raw, key):
                return "openhands", key
            if isinstance(raw.get(key), list):
                return container, key
    raise Quarantine("unknown_format", f"no messages/conversations/history/trajectory/turns/"
                                       f"input list: {_seen(raw)}")


def _is_mini(raw: dict) -> bool:
    info = raw.get("info")
    return str(raw.get("trajectory_format", "")).startswith("mini-swe-agent") or \
        (isinstance(info, dict) and "mini_version" in info)


def _label(raw, container: str, items: list) -> str:
    if container not in MESSAGE_LISTS:
        return container
    d = dialect(items)
    if container == "openai" and _is_mini(raw):
        container = "mini-swe-agent"
    if container == "openai":  # only Anthropic requests put `system` beside the messages
        return "anthropic" if "system" in raw else d
    return container if d == "openai" else f"{container}/{d}"


def source_format(raw) -> str:
    """The detected format of a raw record; "unreadable" for one that is not JSON,
    "unknown" for JSON of no supported shape."""
    if isinstance(raw, Quarantine):
        return "unreadable"
    try:
        container, key = _shape(raw)
    except Quarantine:
        return "unknown"
    return _label(raw, container, raw[key] if key else raw)


def count_formats(specs: list) -> dict:
    """Records read per detected format over shard specs (sums to the records read)."""
    counts = Counter(source_format(raw) for spec in specs for _, _, raw in read_spec(spec))
    return dict(sorted(counts.items()))


def _tool(t: dict) -> dict:
    """An OpenAI function tool from Anthropic `{name, description, input_schema}` or
    Responses `{type: function, name, parameters}`; OpenAI ones (and provider built-in
    tools without a name) as they are."""
    if "function" in t or not isinstance(t.get("name"), str):
        return t
    spec = {"name": t["name"]}
    if "description" in t:
        spec["description"] = t["description"]
    params = t.get("parameters", t.get("input_schema"))
    if params is not None:
        spec["parameters"] = params
    return {"type": "function", "function": spec}


def _tools(tools) -> list:
    if isinstance(tools, str):
        try:
            tools = json.loads(tools) if tools.strip() else []
        except ValueError:
            raise Quarantine("bad_record", "`tools` is a string but not JSON") from None
    if tools is None:
        return []
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise Quarantine("bad_record", "`tools` is not a list of objects")
    return [_tool(t) for t in tools]


def _system(raw: dict) -> list:
    """The system prompt kept beside the messages: Anthropic `system` (text or text
    blocks), Responses `instructions`."""
    for key in ("system", "instructions"):
        if raw.get(key):
            return [{"role": "system", "content": raw[key]}]
    return []


def _without_reasoning(m):
    if isinstance(m, dict) and "reasoning_content" in m:
        return {k: v for k, v in m.items() if k != "reasoning_content"}
    return m


def to_canonical(raw, where: str, keep_reasoning: bool = False) -> dict:
    """`{"id", "messages", "tools", "source_format"}` from any supported record shape (not
    yet validated). Reasoning (thinking blocks, reasoning items, `reasoning_content`)
    stays as `reasoning_content` on its assistant message only with `keep_reasoning`."""
    container, key = _shape(raw)
    items = raw[key] if key else raw
    fmt = _label(raw, container, items)
    meta = raw if isinstance(raw, dict) else {}
    tools = meta.get("tools")
    if container == "openhands":  # its tools are those its system prompt listed
        items, tools = openhands.to_messages(raw, key)
    else:
        adapt = next((a for k, _, a in SHAPES if k == key), None)
        items = list(adapt(items) if adapt else items)
    if key == "input":  # a logged Responses request: the reply is its `output`
        items += [x for x in meta.get("output") or [] if isinstance(x, dict)]
    msgs = to_openai(items)
    if msgs and isinstance(msgs[0], dict) and msgs[0].get("role") not in ("system", "developer"):
        msgs = _system(meta) + msgs
    if not keep_reasoning:
        msgs = [_without_reasoning(m) for m in msgs]
    return {"id": record_id(raw, where), "messages": msgs, "tools": _tools(tools),
            "source_format": fmt}
