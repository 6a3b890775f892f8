"""Record shapes that hold turns in something other than a messages list: ShareGPT
(`conversations` with `from`/`value`), SWE-agent (`history` messages, whose tool results
name their call in a list, else `trajectory` steps of thought/action/observation) and
DeepSpec (`turns`: alternating user/assistant strings). Each maps its list to OpenAI
chat messages; `dlite.data.formats.messages` then reads whatever dialect those use."""

import json

from dlite.data.formats.errors import Quarantine

SHAREGPT_ROLES = {
    "system": "system", "human": "user", "user": "user", "gpt": "assistant",
    "assistant": "assistant", "chatgpt": "assistant", "model": "assistant",
    "function_call": "assistant", "tool": "tool", "observation": "tool",
    "function_response": "tool", "function": "tool", "ipython": "tool"}


def sharegpt(conv: list) -> list:
    out = []
    for turn in conv:
        if not isinstance(turn, dict):
            raise Quarantine("bad_record", "a conversation turn is not an object")
        who, value = turn.get("from", turn.get("role")), turn.get("value", turn.get("content"))
        role = SHAREGPT_ROLES.get(str(who).lower())
        if role is None:
            raise Quarantine("unknown_role", f"ShareGPT from={who!r}")
        if str(who).lower() != "function_call":
            out.append({"role": role, "content": value})
            continue
        try:  # a call as JSON text {"name", "arguments"}
            call = json.loads(value) if isinstance(value, str) else value
            out.append({"role": "assistant", "content": "", "tool_calls": [{"function": {
                "name": call["name"], "arguments": call.get("arguments", {})}}]})
        except (ValueError, TypeError, KeyError, AttributeError):
            raise Quarantine("bad_record", "function_call value is not {name, arguments}") from None
    return out


def swe_history(hist: list) -> list:
    # SWE-agent keeps the id a tool result answers in a list (`tool_call_ids`).
    return [{**m, "tool_call_id": m.get("tool_call_id") or m["tool_call_ids"][0]}
            if isinstance(m, dict) and m.get("tool_call_ids") else m for m in hist]


def swe_steps(steps: list) -> list:
    out = []
    for s in steps:
        if not isinstance(s, dict):
            raise Quarantine("bad_record", "a trajectory step is not an object")
        said = s.get("response") or "\n".join(x for x in (s.get("thought"), s.get("action")) if x)
        out.append({"role": "assistant", "content": said})
        if s.get("observation") is not None:
            out.append({"role": "user", "content": s["observation"]})
    return out


def turns(items: list) -> list:
    return [{"role": "user" if i % 2 == 0 else "assistant", "content": t}
            for i, t in enumerate(items)]
