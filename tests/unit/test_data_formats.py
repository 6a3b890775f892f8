"""Trajectory input without Ray: readers and shard planning over every input kind, the
adapters to canonical messages (one fixture per on-disk format under
tests/fixtures/trajectories, equivalent ones rendering identically), every quarantine reason, chat rendering with loss masks
(generation blocks and the marker fallback, on a Qwen3-style template too), the length
policies, anchor sampling, and HF-generate regeneration on a tiny random target."""

import json
from pathlib import Path

import numpy as np
import pytest

from dlite.data import anchors, formats, render
from dlite.data.formats import Quarantine
from dlite.corpus import trajectories as corpus
from dlite.tiny import load_tokenizer
from dlite.tiny.tokenizer import CHAT_TEMPLATE

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "trajectories"
CHAT = [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "It is 4."}]


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer()


@pytest.fixture(scope="module")
def traj():
    return next(corpus.generate("heldout", 1, 0, 3000, 6000))


def _canon(raw, where="x"):
    return formats.normalise(formats.to_canonical(raw, where))


def _reason(raw) -> str:
    with pytest.raises(Quarantine) as e:
        _canon(raw)
    return e.value.reason


# ---------------------------------------------------------------- adapters

def test_sharegpt_maps_roles_and_function_calls():
    rec = _canon({"id": 7, "conversations": [
        {"from": "system", "value": "Be brief."}, {"from": "human", "value": "ls?"},
        {"from": "function_call", "value": '{"name": "ls", "arguments": {"path": "."}}'},
        {"from": "observation", "value": "a.py"}, {"from": "gpt", "value": "One file."}]})
    assert rec["id"] == "7"
    assert [m["role"] for m in rec["messages"]] == ["system", "user", "assistant", "tool", "assistant"]
    assert rec["messages"][2]["tool_calls"][0]["function"] == {"name": "ls", "arguments": {"path": "."}}


def test_swe_agent_and_mini_swe_agent_shapes():
    hist = {"info": {"instance_id": "django-1"}, "trajectory": [{"response": "ignored"}], "history": [
        {"role": "system", "content": "sys", "agent": "main"},
        {"role": "user", "content": [{"type": "text", "text": "fix it"}]},
        {"role": "assistant", "content": "look", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "bash", "arguments": "{\"cmd\": \"ls\"}"}}]},
        {"role": "tool", "content": "x.py", "tool_call_ids": ["c1"]},
        {"role": "assistant", "content": "done"}]}
    rec = _canon(hist)
    assert rec["id"] == "django-1" and rec["messages"][3]["tool_call_id"] == "c1"
    assert rec["messages"][1]["content"] == "fix it"
    steps = _canon({"trajectory": [{"thought": "hm", "action": "ls", "observation": "a.py"},
                                   {"response": "submit"}]}, "t.traj.json")
    assert steps["id"] == "t.traj.json"
    assert [m["role"] for m in steps["messages"]] == ["assistant", "user", "assistant"]
    mini = _canon({"messages": [{"role": "user", "content": [{"type": "text", "text": "a"},
                                                            {"type": "text", "text": "b"}]},
                                {"role": "assistant", "content": "ok"}]})
    assert mini["messages"][0]["content"] == "a\nb"


def test_deepspec_turns_alternate_and_single_turn_has_no_assistant():
    rec = _canon({"turns": ["q1", "a1", "q2", "a2"]})
    assert [m["role"] for m in rec["messages"]] == ["user", "assistant"] * 2
    one = formats.to_canonical({"turns": ["only a prompt"]}, "p:1")
    assert _reason({"turns": ["only a prompt"]}) == "no_assistant_turn"
    assert formats.normalise(one, require_assistant=False)["messages"][0]["role"] == "user"


@pytest.mark.parametrize("raw, reason", [
    ({"messages": []}, "empty_conversation"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "unknown_role"),
    ({"conversations": [{"from": "narrator", "value": "x"}]}, "unknown_role"),
    ({"messages": [{"role": "user", "content": "x"}, {"role": "tool", "content": "y"}]},
     "tool_without_call"),
    ({"messages": [{"role": "assistant", "content": "", "tool_calls": [
        {"id": "a", "function": {"name": "f", "arguments": {}}}]},
        {"role": "tool", "tool_call_id": "b", "content": "y"}]}, "tool_without_call"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": "u"}]},
                   {"role": "assistant", "content": "x"}]}, "non_text_content"),
    ({"messages": [{"role": "user", "content": "x"}]}, "no_assistant_turn"),
    ({"messages": [*CHAT, {"role": "system", "content": "late"}]}, "misplaced_system"),
    ({"messages": [{"role": "user", "content": "\ud800"}, CHAT[1]]}, "undecodable"),
    ({"prompt": "x"}, "unknown_format"),
    ({"messages": [CHAT[0], {"role": "assistant", "content": "", "tool_calls": [{"id": 1}]}]},
     "bad_record"),
])
def test_quarantine_reasons(raw, reason):
    assert _reason(raw) == reason


# ---------------------------------------------------------------- readers

def _write_inputs(d):
    """Every input kind; returns the expected (where, ok) list in global order."""
    d.mkdir()
    (d / "a.jsonl").write_bytes(b'{"id": "j0", "messages": []}\r\n\n{not json\n'
                                b'\xff\xfe bad bytes\n{"id": "j3", "turns": ["q", "a"]}\n')
    import pyarrow as pa
    import pyarrow.parquet as pq
    pq.write_table(pa.table({"id": [f"p{i}" for i in range(5)], "turns": [["q", "a"]] * 5}),
                   d / "b.parquet", row_group_size=2)
    (d / "runs").mkdir()
    (d / "runs" / "c.traj.json").write_text(json.dumps({"messages": CHAT}))
    (d / "notes.txt").write_text("ignored")


def test_plan_and_read_cover_every_record_once(tmp_path):
    _write_inputs(tmp_path / "in")
    specs, ident = formats.plan_input(str(tmp_path / "in"), per_shard=3, skip_other=True)
    assert [s["count"] for s in specs] == [3, 3, 3, 1] and len(ident) == 3
    got = [(i, w, raw) for s in specs for i, w, raw in formats.read_spec(s)]
    assert [i for i, _, _ in got] == list(range(10))
    wheres = [w for _, w, _ in got]
    assert wheres[:4] == ["a.jsonl:1", "a.jsonl:3", "a.jsonl:4", "a.jsonl:5"]
    assert wheres[4:9] == [f"b.parquet#row{r}" for r in range(5)] and wheres[9] == "c.traj.json"
    assert [r.reason for _, _, r in got if isinstance(r, Quarantine)] == ["bad_json", "undecodable"]
    assert [r["id"] for _, _, r in got[4:9]] == ["p0", "p1", "p2", "p3", "p4"]
    # Same plan twice: record -> shard assignment is deterministic.
    assert formats.plan_input(str(tmp_path / "in"), 3, skip_other=True)[0] == specs
    # Unless told to skip them, other files are quarantined records, counted like any.
    specs, ident = formats.plan_input(str(tmp_path / "in"), per_shard=3)
    got = [(w, raw) for s in specs for _, w, raw in formats.read_spec(s)]
    assert len(got) == 11 and len(ident) == 4
    (other,) = [(w, r) for w, r in got if w == "notes.txt"]
    assert isinstance(other[1], Quarantine) and other[1].reason == "not_a_trajectory_file"


def test_hf_datasets_directory(tmp_path):
    datasets = pytest.importorskip("datasets")
    rows = [{"id": f"h{i}", "messages": CHAT} for i in range(4)]
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "hf"))
    specs, _ = formats.plan_input(str(tmp_path / "hf"), per_shard=3)
    got = [(w, _canon(raw, w)["id"]) for s in specs for _, w, raw in formats.read_spec(s)]
    assert got == [(f"hf#row{i}", f"h{i}") for i in range(4)]


# ---------------------------------------------------------------- on-disk formats

C1 = "cat hello.py"
# (where, source_format, id, roles) of every record of the fixtures directory, in order
FIXTURE_RECORDS = [
    ("anthropic_messages.json", "anthropic", "fix-typo-anthropic", "suatata"),
    ("mini_swe_agent_bare.traj.json", "mini-swe-agent", "mini_swe_agent_bare.traj.json", "suauau"),
    ("mini_swe_agent_responses.traj.json", "mini-swe-agent/responses", "fix-typo-mini-responses",
     "suatata"),
    ("mini_swe_agent_toolcall.traj.json", "mini-swe-agent", "fix-typo-mini-toolcall", "suatata"),
    ("openai_chat.jsonl:1", "openai", "fix-typo-openai", "suatata"),
    ("openai_chat.jsonl:2", "openai", "text-parts", "ua"),
    ("openhands_output.jsonl:1", "openhands", "fix-typo-openhands-eval", "uattata"),
    ("openhands_trajectory.json", "openhands", "openhands_trajectory.json", "suatata"),
    ("responses_api.json", "responses", "fix-typo-responses", "suatata"),
    ("sharegpt.json#0", "sharegpt", "sharegpt-1", "suata"),
    ("sharegpt.json#1", "sharegpt", "sharegpt-2", "ua"),
    ("swe_agent.traj", "swe-agent", "fix-typo-swe-agent", "suatat"),
]
# One conversation written by four producers (mini-swe-agent's two without tool schemas).
EQUIVALENT = ["anthropic_messages.json", "openai_chat.jsonl:1", "responses_api.json"]
EQUIVALENT_MINI = ["mini_swe_agent_toolcall.traj.json", "mini_swe_agent_responses.traj.json"]


@pytest.fixture(scope="module")
def fixture_raw():
    specs, _ = formats.plan_input(str(FIXTURES), per_shard=4)
    return {where: raw for s in specs for _, where, raw in formats.read_spec(s)}


def _fixture(fixture_raw, where, keep_reasoning=False):
    return formats.normalise(formats.to_canonical(fixture_raw[where], where, keep_reasoning))


def test_fixtures_are_detected_from_content(fixture_raw):
    assert list(fixture_raw) == [w for w, *_ in FIXTURE_RECORDS]
    for where, fmt, rid, roles in FIXTURE_RECORDS:
        rec = _fixture(fixture_raw, where)
        assert (rec["source_format"], rec["id"]) == (fmt, rid), where
        assert "".join(m["role"][0] for m in rec["messages"]) == roles, where
        assert formats.source_format(fixture_raw[where]) == fmt
    specs, _ = formats.plan_input(str(FIXTURES), per_shard=4)
    assert formats.count_formats(specs) == {
        "anthropic": 1, "mini-swe-agent": 2, "mini-swe-agent/responses": 1, "openai": 2,
        "openhands": 2, "responses": 1, "sharegpt": 2, "swe-agent": 1}


@pytest.mark.parametrize("where", [w for w, *_ in FIXTURE_RECORDS])
def test_fixture_assistant_tokens_are_supervised(tok, fixture_raw, where):
    """On the rendered ids: every assistant text and call is in the supervised tokens,
    nothing the system, the user or a tool said is."""
    rec = _fixture(fixture_raw, where)
    ids, mask = render.encode(tok, rec["messages"], rec["tools"])
    said = tok.decode([i for i, m in zip(ids, mask) if m])
    for m in rec["messages"]:
        if m["role"] == "assistant":
            assert m["content"].strip() in said
            for c in m.get("tool_calls", []):
                assert json.dumps(c["function"]["name"]) in said
        elif m["role"] != "tool" and m["content"].strip():
            assert m["content"].strip() not in said
    assert "<tool_response>" not in said and "<|im_start|>" not in said
    assert said.count("<|im_end|>") == sum(m["role"] == "assistant" for m in rec["messages"])


def _no_ids(rec) -> list:
    """Messages without call ids (each producer names its calls its own way)."""
    out = []
    for m in rec["messages"]:
        m = {k: v for k, v in m.items() if k != "tool_call_id"}
        if "tool_calls" in m:
            m["tool_calls"] = [{**c, "id": ""} for c in m["tool_calls"]]
        out.append(m)
    return out


@pytest.mark.parametrize("group", [EQUIVALENT, EQUIVALENT_MINI])
def test_equivalent_fixtures_normalise_and_render_identically(tok, fixture_raw, group):
    recs = [_fixture(fixture_raw, w) for w in group]
    first = recs[0]["messages"][2]["tool_calls"][0]
    assert first["type"] == "function" and first["function"] == {"name": "bash",
                                                                 "arguments": {"command": C1}}
    assert all(_no_ids(r) == _no_ids(recs[0]) and r["tools"] == recs[0]["tools"] for r in recs)
    assert all("reasoning_content" not in m for r in recs for m in r["messages"])  # default: dropped
    texts = {tok.apply_chat_template(r["messages"], tools=r["tools"] or None, tokenize=False)
             for r in recs}
    assert len(texts) == 1
    encoded = [render.encode(tok, r["messages"], r["tools"]) for r in recs]
    assert all(e == encoded[0] for e in encoded)
    kept = [_fixture(fixture_raw, w, keep_reasoning=True)["messages"][2] for w in group]
    assert [m["reasoning_content"] for m in kept] == ["The typo must be in the print call."] * len(group)


def test_tool_schemas_become_openai_function_tools(fixture_raw):
    tools = [_fixture(fixture_raw, w)["tools"] for w in EQUIVALENT]
    assert tools[0] == tools[1] == tools[2] and tools[0][0]["type"] == "function"
    assert set(tools[0][0]["function"]) == {"name", "description", "parameters"}


def test_dialect_details():
    """Pieces the fixtures do not show: Responses tool output as parts, assistant items
    merging into one turn, Anthropic redacted thinking, OpenRouter `reasoning`, the
    mini-swe-agent exit record, argument text that is not a JSON object."""
    rec = _canon([{"role": "user", "content": "go"},
                  {"type": "function_call", "call_id": "a", "name": "f", "arguments": "{}"},
                  {"type": "function_call", "call_id": "b", "name": "g", "arguments": "[1]"},
                  {"type": "function_call_output", "call_id": "a",
                   "output": [{"type": "input_text", "text": "A"}]},
                  {"type": "function_call_output", "call_id": "b", "output": "B"},
                  {"role": "assistant", "content": [{"type": "redacted_thinking", "data": "x"},
                                                    {"type": "text", "text": "ok"}]},
                  {"role": "exit", "content": "", "extra": {"exit_status": "Submitted"}}])
    assert [m["role"] for m in rec["messages"]] == ["user", "assistant", "tool", "tool", "assistant"]
    assert [c["function"]["arguments"] for c in rec["messages"][1]["tool_calls"]] == [{}, "[1]"]
    assert rec["messages"][2]["content"] == "A" and rec["messages"][4]["content"] == "ok"
    said = {"role": "assistant", "content": "4", "reasoning": "2+2"}
    assert formats.to_canonical({"messages": [CHAT[0], said]}, "x", True)["messages"][1][
        "reasoning_content"] == "2+2"
    assert "reasoning_content" not in formats.to_canonical({"messages": [CHAT[0], said]}, "x")[
        "messages"][1]
    bad_args = {"messages": [CHAT[0], {"role": "assistant", "content": "", "tool_calls": [
        {"id": "c", "function": {"name": "f", "arguments": "{not json"}}]}]}
    assert _canon(bad_args)["messages"][1]["tool_calls"][0]["function"]["arguments"] == "{not json"


@pytest.mark.parametrize("raw, seen", [
    (42, "a JSON int"), ("text", "a JSON str"), ([1, 2], "a list of 2 items"),
    ([{"prompt": "x"}], "keys ['prompt']"), ({"prompt": "x"}, "keys ['prompt']"),
])
def test_valid_json_of_no_known_shape_is_unknown_format(raw, seen):
    with pytest.raises(Quarantine) as e:
        _canon(raw)
    assert e.value.reason == "unknown_format" and seen in e.value.detail
    assert formats.source_format(raw) == "unknown"


@pytest.mark.parametrize("raw, reason", [
    ({"messages": [CHAT[0], {"role": "assistant", "content": [
        {"type": "tool_use", "id": "t", "name": "f", "input": {}},
        {"type": "image", "source": {}}]}]}, "non_text_content"),
    ({"messages": [CHAT[0], {"role": "assistant", "content": [
        {"type": "tool_use", "id": "t", "name": "f", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t",
                                      "content": [{"type": "image", "source": {}}]}]}]},
     "non_text_content"),
    ({"messages": [CHAT[0], {"type": "function_call_output", "call_id": "z", "output": "o"}]},
     "tool_without_call"),
])
def test_dialect_quarantine_reasons(raw, reason):
    assert _reason(raw) == reason


def test_json_layout_is_read_from_content(tmp_path):
    """Pretty-printed documents whatever the suffix, JSON lines whatever the suffix, a
    JSON array of records, a bare list of messages on a line, broken files."""
    d = tmp_path / "in"
    d.mkdir()
    (d / "a_doc.jsonl").write_text(json.dumps({"messages": CHAT}, indent=2))
    (d / "b_lines.json").write_text("\n".join(json.dumps({"id": f"l{i}", "messages": CHAT})
                                              for i in range(2)))
    (d / "c_bare.jsonl").write_text(json.dumps(CHAT) + "\n" + json.dumps(CHAT) + "\n")
    (d / "d_array.json").write_text(json.dumps([{"id": f"r{i}", "messages": CHAT}
                                                for i in range(3)], indent=1))
    (d / "e_broken_first.json").write_text('{"id": \n' + json.dumps({"messages": CHAT}) + "\n")
    (d / "f_broken_doc.traj.json").write_text('{\n  "messages": [\n')
    (d / "g_empty.json").write_text("\n")
    specs, ident = formats.plan_input(str(d), per_shard=4)
    got = [(w, formats.source_format(raw)) for s in specs for _, w, raw in formats.read_spec(s)]
    assert got == [
        ("a_doc.jsonl", "openai"), ("b_lines.json:1", "openai"), ("b_lines.json:2", "openai"),
        ("c_bare.jsonl:1", "mini-swe-agent"), ("c_bare.jsonl:2", "mini-swe-agent"),
        ("d_array.json#0", "openai"), ("d_array.json#1", "openai"), ("d_array.json#2", "openai"),
        ("e_broken_first.json:1", "unreadable"), ("e_broken_first.json:2", "openai"),
        ("f_broken_doc.traj.json", "unreadable")]
    assert [k for k, _, _ in ident] == ["traj", "jsonl", "jsonl", "traj", "jsonl", "traj", "jsonl"]
    assert sum(formats.count_formats(specs).values()) == len(got)


# ---------------------------------------------------------------- rendering

def test_loss_mask_covers_assistant_text_and_calls_only(tok, traj):
    rec = _canon(traj)
    ids, mask = render.encode(tok, rec["messages"], rec["tools"])
    said = tok.decode([i for i, m in zip(ids, mask) if m])
    assert rec["messages"][-1]["content"] in said and "<tool_call>" in said
    assert "<tool_response>" not in said and "# Tools" not in said and "<|im_start|>" not in said
    assert said.count("<|im_end|>") == sum(m["role"] == "assistant" for m in rec["messages"])


def test_marker_fallback_matches_generation_blocks(tok, traj):
    rec = _canon(traj)
    plain = tok.__class__.from_pretrained(tok.name_or_path)
    plain.chat_template = CHAT_TEMPLATE.replace("{%- generation %}", "").replace(
        "{%- endgeneration %}", "")
    assert render.encode(plain, rec["messages"], rec["tools"]) == \
        render.encode(tok, rec["messages"], rec["tools"])


# Real Qwen3 style: no generation blocks, an empty think block on the final turn.
QWEN3_LIKE = (
    "{%- for m in messages %}{%- if m.role == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' }}{%- if loop.last %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{{- m.content + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")


def test_qwen3_style_template_without_generation_blocks(tok):
    q = tok.__class__.from_pretrained(tok.name_or_path)
    q.chat_template = QWEN3_LIKE
    msgs = [{"role": "system", "content": "S"}, *CHAT, {"role": "user", "content": "And 3+3?"},
            {"role": "assistant", "content": "Six."}]
    ids, mask = render.encode(q, msgs)
    said = q.decode([i for i, m in zip(ids, mask) if m])
    assert said == "It is 4.<|im_end|><think>\n\n</think>\n\nSix.<|im_end|>"


def test_length_policies(tok, traj):
    rec = _canon(traj)
    full = len(render.encode(tok, rec["messages"], rec["tools"])[0])
    assert render.fit(tok, rec, full, "drop")[0][0] == render.encode(tok, rec["messages"], rec["tools"])[0]
    with pytest.raises(Quarantine, match="too_long"):
        render.fit(tok, rec, full - 1, "drop")
    (ids, mask), = render.fit(tok, rec, 1100, "truncate")
    text = tok.decode(ids)
    assert len(ids) <= 1100 and text.startswith("<|im_start|>system\n") and any(mask)
    assert rec["messages"][1]["content"] in text  # the task survives, old turns go
    parts = render.fit(tok, rec, 1100, "split")
    assert len(parts) > 1 and all(len(p[0]) <= 1100 and any(p[1]) for p in parts)
    assert all(tok.decode(p[0]).startswith("<|im_start|>system\n") for p in parts)
    (ids, mask), = render.fit(tok, rec, 300, "truncate")  # head too long: last tokens
    assert len(ids) == 300 and tok.decode(ids).endswith("<|im_end|>\n")
    with pytest.raises(Quarantine, match="too_long"):
        render.fit(tok, rec, 300, "split")


# ---------------------------------------------------------------- anchors

def test_anchor_sampling_is_supervised_and_deterministic():
    mask = np.array([0, 1, 1, 1, 0, 1, 1, 0, 1, 0, 1, 1])
    assert anchors.candidate_anchors(mask).tolist() == [1, 2, 5, 10]
    assert anchors.candidate_anchors([1, 1]).tolist() == []
    big = np.ones(400, dtype=np.int8)
    s = anchors.anchor_seed(0, "rec", 0)
    a, b = anchors.sample_anchors(big, 16, s), anchors.sample_anchors(big, 16, s)
    assert a.tolist() == b.tolist() and len(set(a.tolist())) == 16 and a.min() >= 1
    assert a.tolist() != anchors.sample_anchors(big, 16, anchors.anchor_seed(0, "rec", 1)).tolist()
    assert anchors.reference_positions(np.array([3, 8]), 4, 10).tolist() == \
        [[3, 4, 5, 6], [8, 9, 9, 9]]


# ---------------------------------------------------------------- regeneration

def test_hf_regenerator_adds_and_replaces_assistant_turns(tok):
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(Qwen3Config(
        vocab_size=len(tok), hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, intermediate_size=64)).eval()
    regen = render.HFRegenerator(model, tok, max_new_tokens=4)
    out = regen.regenerate([{"role": "user", "content": "hi"}], [])
    assert [m["role"] for m in out] == ["user", "assistant"]
    assert "<|im_end|>" not in out[1]["content"]
    out = regen.regenerate(CHAT, [])
    assert len(out) == 2 and out[1]["role"] == "assistant" and out[0] == CHAT[0]


def test_sequences_carry_anchors_or_quarantine(tok):
    rec = {"id": "r", "index": 3, "where": "f:4", "tools": [],
           "messages": [CHAT[0], {"role": "assistant", "content": "Hello there, friend."}]}
    (s,) = render.sequences(tok, rec, 256, "truncate", 4, seed=0)
    assert (s["id"], s["part"], s["index"], s["where"]) == ("r", 0, 3, "f:4")
    m = np.asarray(s["loss_mask"])
    assert len(s["anchors"]) == 4 and m[s["anchors"]].all() and m[s["anchors"] + 1].all()
    bare = {**rec, "messages": [CHAT[0], {"role": "assistant", "content": ""}]}  # <|im_end|> only
    with pytest.raises(Quarantine, match="no_anchor"):
        render.sequences(tok, bare, 256, "truncate", 4, seed=0)
