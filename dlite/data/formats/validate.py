"""Validation of canonical records: `normalise(record)` checks roles, text-only content and
that every tool result answers a call, and writes each tool call in one internal form,
`{"id", "type": "function", "function": {"name", "arguments": <JSON object>}}`.

Arguments are a parsed object, not OpenAI's JSON text: HF chat templates that render
calls (`tojson`) expect an object (Llama 3.1 refuses text; Qwen3 takes either), and
`tojson` writes an object as `json.dumps` does, so a call renders the same whether it
came as Anthropic `input`, Responses or OpenAI `arguments` text. Text that is not a JSON
object stays text (what the model wrote, for templates that print it as is).
"""

import json

from dlite.data.formats.errors import Quarantine
from dlite.data.formats.messages import part_text

ROLES = {"system": "system", "developer": "system", "user": "user",
         "assistant": "assistant", "tool": "tool", "function": "tool"}


def _arguments(args, i: int):
    if args is None or isinstance(args, dict):
        return args or {}
    if not isinstance(args, str):
        raise Quarantine("bad_record", f"message {i}: tool-call arguments are not JSON text/object")
    try:
        parsed = json.loads(args) if args.strip() else {}
    except ValueError:
        return args
    return parsed if isinstance(parsed, dict) else args


def _call(c, i: int) -> dict:
    fn = c.get("function", c) if isinstance(c, dict) else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str) or not name:
        raise Quarantine("bad_record", f"message {i}: a tool call without a function name")
    return {"id": str(c.get("id") or ""), "type": "function",
            "function": {"name": name, "arguments": _arguments(fn.get("arguments"), i)}}


def _message(m, i: int) -> dict:
    if not isinstance(m, dict):
        raise Quarantine("bad_record", f"message {i} is not an object")
    role = ROLES.get(m.get("role"))
    if role is None:
        raise Quarantine("unknown_role", f"message {i}: role {m.get('role')!r}")
    out = {"role": role, "content": part_text(m.get("content"), f"message {i}")}
    if role == "assistant" and m.get("tool_calls"):
        out["tool_calls"] = [_call(c, i) for c in m["tool_calls"]]
    if role == "assistant" and isinstance(m.get("reasoning_content"), str) \
            and m["reasoning_content"]:
        out["reasoning_content"] = m["reasoning_content"]
    if role == "tool":
        out["tool_call_id"] = str(m.get("tool_call_id") or "")
        if m.get("name"):
            out["name"] = str(m["name"])
    return out


def _check_order(msgs: list) -> None:
    """System only first; every tool result answers a call of the assistant turn just before."""
    waiting: list = []  # call ids of the latest assistant turn not yet answered
    for i, m in enumerate(msgs):
        if m["role"] == "system" and i > 0:
            raise Quarantine("misplaced_system", f"message {i} is a system message")
        if m["role"] != "tool":
            waiting = [c["id"] for c in m.get("tool_calls", [])]
            continue
        if not waiting:
            raise Quarantine("tool_without_call", f"message {i} answers no pending tool call")
        tid = m["tool_call_id"]
        if tid and any(waiting):
            if tid not in waiting:
                raise Quarantine("tool_without_call", f"message {i}: tool_call_id {tid!r} unknown")
            waiting.remove(tid)
        else:
            waiting.pop(0)


def normalise(record: dict, require_assistant: bool = True) -> dict:
    """Validated canonical record: roles, text-only content, tool calls matched to results.
    `require_assistant=False` when assistant turns will be generated (regeneration)."""
    if not record["messages"]:
        raise Quarantine("empty_conversation", "no messages")
    msgs = [_message(m, i) for i, m in enumerate(record["messages"])]
    _check_order(msgs)
    if require_assistant and not any(m["role"] == "assistant" for m in msgs):
        raise Quarantine("no_assistant_turn", f"roles {[m['role'] for m in msgs][:6]}")
    out = {"id": record["id"], "messages": msgs, "tools": record["tools"]}
    if "source_format" in record:
        out["source_format"] = record["source_format"]
    try:  # lone surrogates (from "\ud800" escapes) cannot be tokenised
        json.dumps(out, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError as e:
        raise Quarantine("undecodable", f"unpaired surrogate in the text: {e.reason}")
    return out
