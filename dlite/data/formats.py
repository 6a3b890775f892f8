"""Trajectory input: where records come from, and what a usable one looks like.

Planning: `plan_input(path, per_shard)` lists the records of a file or directory
without parsing them and cuts the global record order into shard specs (JSON-able
dicts), so record i always lands in shard i // per_shard: the basis of resumable
collection. `read_spec(spec)` yields `(index, where, raw)` for one shard; `raw` is a
dict, or a `Quarantine` for a line that is not JSON or not UTF-8.

Inputs: `.jsonl` / `.json` (JSON lines, the HF convention), `.parquet`, `*.traj.json`
(one trajectory per file), a directory of those (searched recursively, sorted), or an
HF `datasets` directory written by `save_to_disk`.

Adapting: `to_canonical(raw, where)` maps OpenAI / mini-swe-agent (`messages`),
ShareGPT (`conversations` with `from`/`value`), SWE-agent (`history`, else
`trajectory` steps) and DeepSpec (`turns`: alternating user/assistant) records to the
canonical `{"id", "messages", "tools"}`; `normalise(record)` validates it. Anything
unusable raises `Quarantine(reason, detail)`, which the caller writes to quarantine.jsonl.
"""

import json
from functools import lru_cache
from pathlib import Path
from typing import Iterator, List, Tuple

HF_MARKERS = ("dataset_info.json", "state.json", "dataset_dict.json")


class Quarantine(Exception):
    """A record that cannot be used: `reason` is a short code, `detail` says where/why."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(f"{reason}: {detail}")
        self.reason, self.detail = reason, detail


# ---------------------------------------------------------------- planning

def _kind(p: Path):
    if p.name.endswith(".traj.json"):
        return "traj"
    if p.name.endswith((".jsonl", ".json")):
        return "jsonl"
    return "parquet" if p.name.endswith(".parquet") else None


def _sources(path: Path) -> List[Tuple[str, Path]]:
    if path.is_file():
        if _kind(path) is None:
            raise ValueError(f"--input: {path} is not .jsonl/.json/.parquet/.traj.json")
        return [(_kind(path), path)]
    if not path.is_dir():
        raise FileNotFoundError(f"--input: no such file or directory {path}")
    if any((path / m).exists() for m in HF_MARKERS):
        return [("hf", path)]
    files = sorted(p for p in path.rglob("*") if p.is_file() and _kind(p))
    if not files:
        raise ValueError(f"--input: no .jsonl/.json/.parquet/.traj.json files under {path}")
    return [(_kind(p), p) for p in files]


def _jsonl_index(path: Path):
    """Byte offsets and 1-based line numbers of the non-blank lines, and the file size."""
    offs, nums, pos = [], [], 0
    with open(path, "rb") as f:
        for lineno, line in enumerate(f, 1):
            if line.strip():
                offs.append(pos)
                nums.append(lineno)
            pos += len(line)
    return offs, nums, pos


@lru_cache(maxsize=4)
def _hf_dataset(path: str):
    import datasets
    ds = datasets.load_from_disk(path)
    if isinstance(ds, datasets.DatasetDict):
        if "train" not in ds and len(ds) != 1:
            raise ValueError(f"--input: {path} holds splits {sorted(ds)}; give one split's dir")
        ds = ds["train"] if "train" in ds else next(iter(ds.values()))
    return ds


def _open_source(kind: str, p: Path):
    """(number of records, cut(a, b) -> a JSON-able item reading records [a, b), identity)."""
    if kind == "jsonl":
        offs, nums, size = _jsonl_index(p)
        ends = offs[1:] + [size]
        return len(offs), lambda a, b: ["jsonl", str(p), offs[a], ends[b - 1], nums[a]], size
    if kind == "parquet":
        import pyarrow.parquet as pq
        n = pq.ParquetFile(p).metadata.num_rows
        return n, lambda a, b: ["parquet", str(p), a, b], p.stat().st_size
    if kind == "hf":
        n = len(_hf_dataset(str(p)))
        return n, lambda a, b: ["hf", str(p), a, b], n
    return 1, lambda a, b: ["traj", str(p)], p.stat().st_size


def plan_input(path: str, per_shard: int) -> Tuple[List[dict], List[list]]:
    """Shard specs `{"shard", "first_index", "count", "items"}` covering every record in
    order, and the sources' identity `[kind, path, size]` (for the resume check)."""
    specs, items, index, identity = [], [], 0, []

    def close(count):
        specs.append({"shard": len(specs), "first_index": index - count, "count": count,
                      "items": list(items)})
        items.clear()
    for kind, p in _sources(Path(path)):
        n, cut, ident = _open_source(kind, p)
        identity.append([kind, str(p), ident])
        a = 0
        while a < n:
            b = min(n, a + per_shard - index % per_shard)
            items.append(cut(a, b))
            index, a = index + b - a, b
            if index % per_shard == 0:
                close(per_shard)
    if items:
        close(index % per_shard)
    return specs, identity


# ---------------------------------------------------------------- reading

def _parse(data: bytes, where: str):
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        return Quarantine("undecodable", f"{where}: {e}")
    try:
        obj = json.loads(text.lstrip("\ufeff"))  # a BOM some editors write first
    except json.JSONDecodeError as e:
        return Quarantine("bad_json", f"{where}: {e}")
    return obj if isinstance(obj, dict) else Quarantine("bad_json", f"{where}: not an object")


def _read_item(item) -> Iterator[Tuple[str, object]]:
    kind, path = item[0], Path(item[1])
    if kind == "jsonl":
        start, end, lineno = item[2:]
        with open(path, "rb") as f:
            f.seek(start)
            chunk = f.read(end - start)
        for k, line in enumerate(chunk.split(b"\n")):
            if line.strip():
                where = f"{path.name}:{lineno + k}"
                yield where, _parse(line, where)
    elif kind == "parquet":
        yield from _read_parquet(path, *item[2:])
    elif kind == "hf":
        a, b = item[2:]
        for r, row in enumerate(_hf_dataset(str(path)).select(range(a, b))):
            yield f"{path.name}#row{a + r}", row
    else:
        yield path.name, _parse(path.read_bytes(), path.name)


def _read_parquet(path: Path, a: int, b: int):
    """Rows [a, b) reading only the row groups that hold them."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    pf, groups, first, start = pq.ParquetFile(path), [], None, 0
    for g in range(pf.metadata.num_row_groups):
        n = pf.metadata.row_group(g).num_rows
        if start < b and start + n > a:
            groups.append(g)
            first = start if first is None else first
        start += n
    table = pf.read_row_groups(groups) if groups else pa.table({})
    for r, row in enumerate(table.slice(a - (first or 0), b - a).to_pylist()):
        yield f"{path.name}#row{a + r}", row


def read_spec(spec: dict) -> Iterator[Tuple[int, str, object]]:
    """(global index, where, raw dict or Quarantine) for every record of a shard spec."""
    index = spec["first_index"]
    for item in spec["items"]:
        for where, raw in _read_item(item):
            yield index, where, raw
            index += 1


# ---------------------------------------------------------------- adapters

SHAREGPT_ROLES = {
    "system": "system", "human": "user", "user": "user", "gpt": "assistant",
    "assistant": "assistant", "chatgpt": "assistant", "model": "assistant",
    "function_call": "assistant", "tool": "tool", "observation": "tool",
    "function_response": "tool", "function": "tool", "ipython": "tool"}
ROLES = {"system": "system", "developer": "system", "user": "user",
         "assistant": "assistant", "tool": "tool", "function": "tool"}


def record_id(raw: dict, fallback: str) -> str:
    """The record's own id (`id`, `instance_id`, `info.instance_id`...), else `fallback`."""
    for key in ("id", "instance_id", "uuid", "conversation_id"):
        v = raw.get(key)
        if isinstance(v, (str, int)) and not isinstance(v, bool) and str(v):
            return str(v)
    info = raw.get("info")
    if isinstance(info, dict) and isinstance(info.get("instance_id"), str):
        return info["instance_id"]
    return fallback


def _sharegpt(conv, raw) -> list:
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


def _swe_history(hist, raw) -> list:
    # SWE-agent keeps the id a tool result answers in a list (`tool_call_ids`).
    return [{**m, "tool_call_id": m.get("tool_call_id") or m["tool_call_ids"][0]}
            if isinstance(m, dict) and m.get("tool_call_ids") else m for m in hist]


def _swe_steps(steps, raw) -> list:
    out = []
    for s in steps:
        if not isinstance(s, dict):
            raise Quarantine("bad_record", "a trajectory step is not an object")
        said = s.get("response") or "\n".join(x for x in (s.get("thought"), s.get("action")) if x)
        out.append({"role": "assistant", "content": said})
        if s.get("observation") is not None:
            out.append({"role": "user", "content": s["observation"]})
    return out


def _turns(turns, raw) -> list:
    return [{"role": "user" if i % 2 == 0 else "assistant", "content": t}
            for i, t in enumerate(turns)]


ADAPTERS = (("messages", lambda m, raw: list(m)), ("conversations", _sharegpt),
            ("conversation", _sharegpt), ("history", _swe_history),
            ("trajectory", _swe_steps), ("turns", _turns))


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
    return tools


def to_canonical(raw: dict, where: str) -> dict:
    """`{"id", "messages", "tools"}` from any supported record shape (not yet validated)."""
    for key, adapt in ADAPTERS:
        if isinstance(raw.get(key), list):
            return {"id": record_id(raw, where), "messages": adapt(raw[key], raw),
                    "tools": _tools(raw.get("tools"))}
    raise Quarantine("unknown_format", f"no messages/conversations/history/trajectory/turns list; "
                                       f"keys {sorted(raw)[:8]}")


# ---------------------------------------------------------------- validation

def _text(content, i: int) -> str:
    """Plain text of a message; text parts are joined (as vLLM does), others refused."""
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list):
        raise Quarantine("bad_record", f"message {i}: content is {type(content).__name__}")
    texts = []
    for part in content:
        if isinstance(part, dict) and part.get("type", "text") == "text" \
                and isinstance(part.get("text"), str):
            texts.append(part["text"])
        elif isinstance(part, str):
            texts.append(part)
        else:
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise Quarantine("non_text_content", f"message {i}: a {kind!r} part")
    return "\n".join(texts)


def _call(c, i: int) -> dict:
    fn = c.get("function", c) if isinstance(c, dict) else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str) or not name:
        raise Quarantine("bad_record", f"message {i}: a tool call without a function name")
    args = fn.get("arguments")
    if not isinstance(args, (str, dict, type(None))):
        raise Quarantine("bad_record", f"message {i}: tool-call arguments are not JSON text/object")
    return {"id": str(c.get("id") or ""), "type": "function",
            "function": {"name": name, "arguments": {} if args is None else args}}


def _message(m, i: int) -> dict:
    if not isinstance(m, dict):
        raise Quarantine("bad_record", f"message {i} is not an object")
    role = ROLES.get(m.get("role"))
    if role is None:
        raise Quarantine("unknown_role", f"message {i}: role {m.get('role')!r}")
    out = {"role": role, "content": _text(m.get("content"), i)}
    if role == "assistant" and m.get("tool_calls"):
        out["tool_calls"] = [_call(c, i) for c in m["tool_calls"]]
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
    try:  # lone surrogates (from "\ud800" escapes) cannot be tokenised
        json.dumps(out, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError as e:
        raise Quarantine("undecodable", f"unpaired surrogate in the text: {e.reason}")
    return out
