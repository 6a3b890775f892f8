"""Rendering a conversation with the target's own chat template, for any template.

Many chat templates (SmolLM2's, most base-model ChatML ones) have no tool support:
they print `message['content']` and silently drop `tool_calls` and the `tools` list,
which would erase the assistant's supervised tool-call tokens. `adapt` probes the
template once and, for each piece it does not render, rewrites the conversation into
text the template does print, deterministically (Hermes / Qwen style tags):
  tool calls   -> appended to the assistant's content as <tool_call>{json}</tool_call>
  tool results -> a `tool` message if the template prints that role, else a `user`
                  message wrapped in <tool_response>...</tool_response>
  tool schemas -> appended to the system prompt inside <tools>...</tools>
Content given as a list of parts becomes its text. Templates that render tools
natively (Qwen3, the tiny target) see the conversation unchanged."""

import functools
import json
from typing import List, Optional, Tuple

_PROBE_CALL, _PROBE_RESULT, _PROBE_TOOL = "PROBE_CALL_NAME", "PROBE_RESULT_TEXT", "PROBE_TOOL_SCHEMA"


def text_of(content) -> str:
    """OpenAI content: a string or a list of parts; only text parts are rendered."""
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return content or ""


def apply(tok, messages, tools, generation_prompt=False, tokenize=False, **kw):
    return tok.apply_chat_template(messages, tools=tools or None, tokenize=tokenize,
                                   add_generation_prompt=generation_prompt, **kw)


@functools.lru_cache(maxsize=16)
def _support(template: str, tok) -> Tuple[bool, bool, bool]:
    """(renders tool calls, renders the tool role, renders tool schemas)."""
    call = {"id": "c0", "type": "function", "function": {"name": _PROBE_CALL, "arguments": "{}"}}
    msgs = [{"role": "user", "content": "u"}, {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c0", "content": _PROBE_RESULT}]
    tools = [{"type": "function", "function": {"name": _PROBE_TOOL, "parameters": {}}}]
    try:
        text = apply(tok, msgs, tools)
    except Exception:  # a template that raises on tool messages supports none of it
        return False, False, False
    return _PROBE_CALL in text, _PROBE_RESULT in text, _PROBE_TOOL in text


def _call_text(call: dict) -> str:
    fn = call.get("function", call)
    args = fn.get("arguments", {})
    try:
        args = json.loads(args) if isinstance(args, str) else args
    except ValueError:
        pass  # not JSON: kept verbatim, as the agent wrote it
    return "<tool_call>\n" + json.dumps({"name": fn.get("name"), "arguments": args}, ensure_ascii=False) + "\n</tool_call>"


def _tools_text(tools: list) -> str:
    rows = "\n".join(json.dumps(t, ensure_ascii=False, sort_keys=True) for t in tools)
    return ("\n\n# Tools\n\nYou may call one or more functions. Their signatures are inside "
            "<tools></tools>:\n<tools>\n" + rows + "\n</tools>\nReturn each call as "
            "<tool_call>{\"name\": ..., \"arguments\": ...}</tool_call>.")


def _message(m: dict, calls: bool, tool_role: bool) -> dict:
    out = {"role": m["role"], "content": text_of(m.get("content"))}
    if m.get("reasoning_content"):  # kept only with data.keep_reasoning; thinking templates print it
        out["reasoning_content"] = m["reasoning_content"]
    if m.get("tool_calls") and not calls:
        out["content"] = "\n".join([out["content"]] * bool(out["content"]) + [_call_text(c) for c in m["tool_calls"]])
    elif m.get("tool_calls"):
        out["tool_calls"] = m["tool_calls"]
    if m["role"] == "tool":
        if tool_role:
            out.update({k: m[k] for k in ("tool_call_id", "name") if k in m})
        else:
            out = {"role": "user", "content": "<tool_response>\n" + out["content"] + "\n</tool_response>"}
    return out


def adapt(tok, messages: List[dict], tools: Optional[list]) -> Tuple[List[dict], Optional[list]]:
    """(messages, tools) the template renders without losing anything."""
    calls, tool_role, schemas = _support(tok.chat_template or "", tok)
    msgs = [_message(m, calls, tool_role) for m in messages]
    if tools and not schemas:
        if msgs and msgs[0]["role"] == "system":
            msgs[0] = dict(msgs[0], content=msgs[0]["content"] + _tools_text(tools))
        else:
            msgs.insert(0, {"role": "system", "content": _tools_text(tools).lstrip()})
        tools = None
    return msgs, tools


def render(tok, messages: List[dict], tools=None, generation_prompt=False) -> str:
    msgs, tools = adapt(tok, messages, tools)
    return apply(tok, msgs, tools, generation_prompt)
