"""Message dialects -> OpenAI chat messages, item by item, so one list may mix them (a
mini-swe-agent run that used the Responses API still starts with chat messages).

  openai     {"role", "content": str | [text parts], "tool_calls"?, "tool_call_id"?,
             "reasoning_content"?} -- passed through (validation checks it)
  anthropic  content blocks: assistant `text` / `tool_use {id, name, input}` /
             `thinking`; user `tool_result {tool_use_id, content}` blocks become `tool`
             messages (in their order, before the user's own text)
  responses  items `message` / `function_call {name, arguments, call_id}` /
             `function_call_output {call_id, output}` / `reasoning`, and saved response
             objects `{"object": "response", "output": [items]}`; the output items of
             one response (or consecutive assistant items) make one assistant turn

mini-swe-agent's closing `{"role": "exit"}` record is dropped: nobody said it.
Tool calls come out as `{"id", "type": "function", "function": {"name", "arguments"}}`
(arguments made canonical in validation); reasoning as the assistant message's
`reasoning_content`, the key chat templates that render thinking (Qwen3) read.
"""

from typing import Optional

from dlite.data.formats.errors import Quarantine

RESPONSES_ITEMS = {"message", "function_call", "function_call_output", "reasoning"}
ANTHROPIC_BLOCKS = {"tool_use", "tool_result", "thinking", "redacted_thinking"}
TEXT_PARTS = {"text", "input_text", "output_text"}


def _is_response_item(m: dict) -> bool:
    # A saved response object has an `output` list and no role of its own.
    return m.get("type") in RESPONSES_ITEMS or (isinstance(m.get("output"), list)
                                                 and "role" not in m)


def item_dialect(m) -> str:
    """"responses", "anthropic" or "openai" (also for anything unreadable)."""
    if not isinstance(m, dict):
        return "openai"
    if _is_response_item(m):
        return "responses"
    c = m.get("content")
    if isinstance(c, list) and any(isinstance(b, dict) and b.get("type") in ANTHROPIC_BLOCKS
                                   for b in c):
        return "anthropic"
    return "openai"


def dialect(messages: list) -> str:
    """The list's dialect: the first item not in OpenAI form decides."""
    return next((d for d in map(item_dialect, messages) if d != "openai"), "openai")


def looks_like_messages(items: list) -> bool:
    """A list of messages / Responses items, as opposed to a list of records."""
    return any(isinstance(m, dict) and ("role" in m or _is_response_item(m)) for m in items)


def part_text(content, where: str) -> str:
    """Plain text of a content value; text parts are joined by newlines (as vLLM does),
    any other part (an image...) is refused: the drafter is trained on text only."""
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list):
        raise Quarantine("bad_record", f"{where}: content is {type(content).__name__}")
    texts = []
    for part in content:
        if isinstance(part, str):
            texts.append(part)
        elif isinstance(part, dict) and part.get("type", "text") in TEXT_PARTS \
                and isinstance(part.get("text"), str):
            texts.append(part["text"])
        elif isinstance(part, dict) and isinstance(part.get("refusal"), str):
            texts.append(part["refusal"])
        else:
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise Quarantine("non_text_content", f"{where}: a {kind!r} part")
    return "\n".join(texts)


def _join(*texts) -> str:
    return "\n".join(t for t in texts if t)


class _Turns:
    """The messages so far; assistant pieces (text, a call, reasoning) from Responses
    items join the assistant turn that is open, else open a new one."""

    def __init__(self):
        self.out, self.open = [], False

    def add(self, m) -> None:
        self.out.append(m)
        self.open = False

    def assistant(self, text: str = "", call: Optional[dict] = None, reasoning: str = ""):
        if not self.open:
            self.add({"role": "assistant", "content": ""})
            self.open = True
        turn = self.out[-1]
        turn["content"] = _join(turn["content"], text)
        if call is not None:
            turn.setdefault("tool_calls", []).append(call)
        if reasoning:
            turn["reasoning_content"] = _join(turn.get("reasoning_content"), reasoning)


def tool_call(call_id, name, arguments) -> dict:
    """A tool call in the internal OpenAI form (shared by every reader that builds calls)."""
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def _reasoning(item: dict) -> str:
    """A reasoning item's text: its full `content` when present, else its `summary`."""
    parts = item.get("content") or item.get("summary") or []
    return _join(*(p.get("text") for p in parts if isinstance(p, dict)
                   and isinstance(p.get("text"), str)))


def _responses_item(t: _Turns, m: dict, i: int) -> None:
    typ, where = m.get("type"), f"message {i}"
    if typ == "function_call_output":
        out = m.get("output")
        t.add({"role": "tool", "tool_call_id": m.get("call_id"),
               "content": out if isinstance(out, str) else part_text(out, where)})
    elif typ == "function_call":
        t.assistant(call=tool_call(m.get("call_id") or m.get("id"), m.get("name"),
                                   m.get("arguments")))
    elif typ == "reasoning":
        t.assistant(reasoning=_reasoning(m))
    elif typ == "message" and m.get("role") == "assistant":
        t.assistant(text=part_text(m.get("content"), where))
    elif typ == "message":
        t.add({"role": m.get("role"), "content": m.get("content")})
    else:  # a saved response object: its output is one new assistant turn
        t.open = False
        for item in m["output"]:
            if isinstance(item, dict):
                _responses_item(t, item, i)


def _anthropic_assistant(blocks: list, i: int) -> dict:
    text, calls, thinking = [], [], []
    for b in blocks:
        typ = b.get("type") if isinstance(b, dict) else type(b).__name__
        if typ == "text":
            text.append(b.get("text") or "")
        elif typ == "tool_use":
            calls.append(tool_call(b.get("id"), b.get("name"), b.get("input")))
        elif typ == "thinking":
            thinking.append(b.get("thinking") or "")
        elif typ != "redacted_thinking":  # redacted: encrypted, no text to keep
            raise Quarantine("non_text_content", f"message {i}: an assistant {typ!r} block")
    out = {"role": "assistant", "content": "\n".join(text)}
    if calls:
        out["tool_calls"] = calls
    if _join(*thinking):
        out["reasoning_content"] = _join(*thinking)
    return out


def _anthropic_message(t: _Turns, m: dict, i: int) -> None:
    if m.get("role") == "assistant":
        t.add(_anthropic_assistant(m["content"], i))
        return
    rest = []  # tool results become tool messages; what else the user said follows them
    for b in m["content"]:
        if isinstance(b, dict) and b.get("type") == "tool_result":
            t.add({"role": "tool", "tool_call_id": b.get("tool_use_id"),
                   "content": part_text(b.get("content"), f"message {i}")})
        else:
            rest.append(b)
    if rest:
        t.add({"role": m.get("role"), "content": rest})


def _openai_message(m: dict) -> dict:
    """As is, with reasoning under `reasoning_content` whatever the key the source used
    (`reasoning` from OpenRouter, `thinking_blocks` from LiteLLM's Anthropic replies)."""
    r = m.get("reasoning_content") or m.get("reasoning")
    if not isinstance(r, str) and isinstance(m.get("thinking_blocks"), list):
        r = _join(*(b.get("thinking") for b in m["thinking_blocks"] if isinstance(b, dict)))
    return {**m, "reasoning_content": r} if isinstance(r, str) and r else m


def to_openai(messages: list) -> list:
    """OpenAI-dialect messages from any mix of the dialects above (not yet validated)."""
    t = _Turns()
    for i, m in enumerate(messages):
        if isinstance(m, dict) and m.get("role") == "exit":
            continue  # mini-swe-agent's end-of-run record (exit status), not a turn
        kind = item_dialect(m)
        if kind == "responses":
            _responses_item(t, m, i)
        elif kind == "anthropic":
            _anthropic_message(t, m, i)
        else:
            t.add(_openai_message(m) if isinstance(m, dict) else m)
    return t.out
