"""From canonical messages to what the target reads: token ids rendered with the target's
own chat template (tools included), a per-token `loss_mask` that is 1 exactly on
assistant-written tokens (text, tool-call JSON and the end-of-turn token), the length
policy that keeps sequences within `data.max_seq_len`, and the optional regeneration
of assistant turns by the target (self-distillation, DLITE.md §3 "Data").

Loss masks come from the template's `{% generation %}` blocks when it has them (the
tiny target's does); otherwise from the assistant header / end-of-turn strings probed
from the template itself (real Qwen3 templates have no generation blocks).

Length policies (over `max_seq_len` tokens):
  truncate -- drop the oldest turns, keeping the system prompt and, if at all possible,
              the first user message (the task); a turn is a user or assistant message
              with the tool results that answer it. If those and the last turn alone
              are too long, keep the last max_seq_len tokens instead.
  split    -- cut into several sequences of consecutive turns, each re-prefixed with the
              system prompt and task.
  drop     -- quarantine the record as `too_long`.
"""

import re
from typing import List, Optional, Protocol, Tuple

import numpy as np

from dlite.data import chat
from dlite.data.anchors import anchor_seed, sample_anchors, supervised_runs
from dlite.data.formats import Quarantine

GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")
Encoded = Tuple[List[int], List[int]]  # (input_ids, loss_mask)


def _render(tok, messages, tools, generation_prompt=False) -> str:
    return chat.render(tok, messages, tools, generation_prompt)


def encode(tok, messages: list, tools: Optional[list] = None) -> Encoded:
    """Token ids of the rendered conversation and its assistant-token loss mask (tool
    calls rendered as text when the template cannot, see `dlite.data.chat`)."""
    messages, tools = chat.adapt(tok, messages, tools)
    if GENERATION_TAG.search(tok.chat_template or ""):
        enc = tok.apply_chat_template(messages, tools=tools or None, tokenize=True,
                                      return_dict=True, return_assistant_tokens_mask=True)
        return list(enc["input_ids"]), [int(m) for m in enc["assistant_masks"]]
    return _encode_by_markers(tok, messages, tools)


def _turn_markers(tok) -> Tuple[str, str]:
    """(assistant header, end of turn) as this template writes them, from a probe chat."""
    user = [{"role": "user", "content": "PROBE_U"}]
    bare, prompt = _render(tok, user, None), _render(tok, user, None, True)
    said = _render(tok, user + [{"role": "assistant", "content": "PROBE_A"}], None)
    header = prompt[len(bare):]
    end = said[said.index("PROBE_A") + len("PROBE_A"):].rstrip()
    if not header or not end or not prompt.startswith(bare):
        raise ValueError("chat template: cannot find its assistant header / end-of-turn; "
                         "add {% generation %} blocks to it")
    return header, end


def _encode_by_markers(tok, messages, tools) -> Encoded:
    header, end = _turn_markers(tok)
    text = chat.apply(tok, messages, tools)
    spans, at = [], 0
    while (start := text.find(header, at)) >= 0:
        stop = text.find(end, start + len(header))
        stop = len(text) if stop < 0 else stop + len(end)
        spans.append((start + len(header), stop))
        at = stop
    if len(spans) != sum(m["role"] == "assistant" for m in messages):
        raise Quarantine("ambiguous_mask", "the assistant header occurs inside message text")
    enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    mask, k = [], 0
    for s, e in enc["offset_mapping"]:
        while k < len(spans) and spans[k][1] <= s:
            k += 1
        mask.append(int(k < len(spans) and e > spans[k][0] and s < spans[k][1]))
    return list(enc["input_ids"]), mask


# ---------------------------------------------------------------- length policy

def _turns(messages):
    """(system, task, turns): turns start at each user/assistant message, tool results
    stay with their call; trailing turns with no assistant message are dropped (nothing
    after them is supervised, so they only cost tokens)."""
    k = int(bool(messages) and messages[0]["role"] == "system")
    task = messages[k:k + 1] if len(messages) > k and messages[k]["role"] == "user" else []
    turns: List[list] = []
    for m in messages[k + len(task):]:
        if m["role"] == "tool" and turns:
            turns[-1].append(m)
        else:
            turns.append([m])
    while turns and turns[-1][0]["role"] != "assistant":
        turns.pop()
    return messages[:k], task, turns


def _flat(turns) -> list:
    return [m for t in turns for m in t]


def _truncate(tok, messages, tools, max_len) -> Encoded:
    """Drop the oldest turns after the system prompt and task; when even those and the
    last turn do not fit, keep the last max_len tokens of the whole conversation (the
    most recent context, contiguous, as the target would have read it)."""
    system, task, turns = _turns(messages)
    head = system + task
    if turns and len(encode(tok, head + turns[-1], tools)[0]) <= max_len:
        lo, hi = 0, len(turns) - 1  # smallest number of dropped turns that fits
        while lo < hi:
            mid = (lo + hi) // 2
            if len(encode(tok, head + _flat(turns[mid:]), tools)[0]) <= max_len:
                hi = mid
            else:
                lo = mid + 1
        return encode(tok, head + _flat(turns[lo:]), tools)
    ids, mask = encode(tok, messages, tools)
    return ids[-max_len:], mask[-max_len:]


def _split(tok, messages, tools, max_len) -> List[Encoded]:
    system, task, turns = _turns(messages)
    head, out, cur, cur_enc = system + task, [], [], None
    for turn in turns:
        trial = encode(tok, head + _flat(cur + [turn]), tools)
        if len(trial[0]) <= max_len:
            cur, cur_enc = cur + [turn], trial
            continue
        if cur:
            out.append(cur_enc)
        cur, cur_enc = [turn], encode(tok, head + turn, tools)
        if len(cur_enc[0]) > max_len:
            raise Quarantine("too_long", f"one turn alone needs {len(cur_enc[0])} > {max_len} tokens")
    return out + ([cur_enc] if cur else [])


def fit(tok, record: dict, max_len: int, policy: str) -> List[Encoded]:
    """The record as one or more (input_ids, loss_mask) of <= max_len tokens, each with
    supervised tokens; raises Quarantine (too_long / no_supervised_tokens)."""
    msgs, tools = record["messages"], record.get("tools")
    seqs = [encode(tok, msgs, tools)]
    if len(seqs[0][0]) > max_len:
        if policy == "drop":
            raise Quarantine("too_long", f"{len(seqs[0][0])} tokens > {max_len}")
        seqs = [_truncate(tok, msgs, tools, max_len)] if policy == "truncate" else \
            _split(tok, msgs, tools, max_len)
    seqs = [s for s in seqs if any(s[1])]
    if not seqs:
        raise Quarantine("no_supervised_tokens", "no assistant token survives rendering")
    return seqs


def sequences(tok, record: dict, max_len: int, policy: str, n_anchors: int, seed: int) -> list:
    """The record's training sequences: `fit` output with sampled anchors, as dicts with
    id, part, index, where, input_ids, loss_mask, anchors. Parts without any anchor are
    left out; a record left with none is quarantined as `no_anchor`."""
    out = []
    for part, (ids, mask) in enumerate(fit(tok, record, max_len, policy)):
        anchors = sample_anchors(mask, n_anchors, anchor_seed(seed, record["id"], part))
        if len(anchors):
            out.append({"id": record["id"], "part": part, "index": record.get("index"),
                        "where": record.get("where"), "input_ids": ids, "loss_mask": mask,
                        "anchors": anchors})
    if not out:
        raise Quarantine("no_anchor", "no position where this and the next token are supervised")
    return out


# ---------------------------------------------------------------- forked rows

def _fork(ids: list, mask: list, spans: List[Tuple[int, int]], answers: List[List[int]]) -> dict:
    """The trunk `ids` with `spans` unsupervised, then per span a branch: the token before
    the span (the fork, unsupervised) and that turn's answer tokens (supervised), at the
    positions the answer takes when it follows the trunk up to the fork."""
    row = {"input_ids": list(ids), "loss_mask": list(mask),
           "position_ids": list(range(len(ids))), "branch_ids": [0] * len(ids)}
    for k, ((start, end), answer) in enumerate(zip(spans, answers), 1):
        row["loss_mask"][start:end] = [0] * (end - start)
        if start == 0:  # a truncated tail that opens inside a turn: no token to fork at
            continue
        row["input_ids"] += [ids[start - 1], *answer]
        row["loss_mask"] += [0] + [1] * len(answer)
        row["position_ids"] += list(range(start - 1, start + len(answer)))
        row["branch_ids"] += [k] * (len(answer) + 1)
    return row


def forked_sequences(tok, record: dict, max_len: int, policy: str, n_anchors: int, seed: int) -> list:
    """`sequences` for a record regenerated with the recorded history (data.regen_history:
    recorded; `record["recorded_messages"]` is the conversation as recorded, its
    `messages` the same with each assistant turn the target's answer to the recorded
    turns before it). Each part `fit` makes of the RECORDED conversation is a trunk, and
    each of its assistant turns gets a branch holding the target's answer instead
    (`_fork`; `data.regen_rows: forked`): every supervised token sits where the target
    wrote it -- after the recorded history, as the evaluation replays a held-out
    session -- where the regenerated conversation read whole puts it after the target's
    earlier answers, which it never saw. An answer the regeneration added after the
    last recorded message (a prompt, a final tool result) followed the whole recorded
    conversation: it ends the trunk, supervised there."""
    tools = record.get("tools")
    gen_ids, gen_mask = encode(tok, record["messages"], tools)
    answers = [gen_ids[a:b] for a, b in supervised_runs(gen_mask)]
    msgs = list(record["recorded_messages"])
    n_turns = sum(m["role"] == "assistant" for m in msgs)
    if len(answers) not in (n_turns, n_turns + 1):
        raise Quarantine("fork_mismatch", f"{len(answers)} regenerated answers for {n_turns} recorded turns")
    if len(answers) > n_turns:
        msgs.append([m for m in record["messages"] if m["role"] == "assistant"][-1])
    parts = fit(tok, {"messages": msgs, "tools": tools}, max_len, policy)
    spans = [supervised_runs(mask) for _, mask in parts]
    # the record's turn number of each part's first span: split parts are consecutive
    # turns; a truncated conversation keeps its last ones
    firsts = [len(answers) - len(spans[0])] if policy == "truncate" else \
        [int(x) for x in np.cumsum([0] + [len(x) for x in spans[:-1]])]
    out = []
    for part, ((ids, mask), sp, first) in enumerate(zip(parts, spans, firsts)):
        forked = sp[:max(0, n_turns - first)]  # the added last answer stays in the trunk
        row = _fork(ids, mask, forked, answers[first:first + len(forked)])
        if not any(row["branch_ids"]):  # nothing forked (a prompt and its answer): a plain row
            row = {k: row[k] for k in ("input_ids", "loss_mask")}
        anchors = sample_anchors(row["loss_mask"], n_anchors, anchor_seed(seed, record["id"], part))
        if len(anchors):
            out.append({"id": record["id"], "part": part, "index": record.get("index"),
                        "where": record.get("where"), **row, "anchors": anchors})
    if not out:
        raise Quarantine("no_anchor", "no position where this and the next token are supervised")
    return out


def training_rows(tok, record: dict, max_len: int, policy: str, n_anchors: int, seed: int,
                  forked: bool = True) -> list:
    """What collection makes of one record: `forked_sequences` for a regeneration that
    read the recorded history (`recorded_messages`; `forked`: data.regen_rows is
    "forked"), else `sequences`. Raises Quarantine."""
    rows = forked_sequences if record.get("recorded_messages") and forked else sequences
    return rows(tok, record, max_len, policy, n_anchors, seed)


# ---------------------------------------------------------------- regeneration

class Regenerator(Protocol):
    """Replaces a conversation's assistant turns by the target's own (a serving engine can
    implement this as well as HF `generate`)."""

    def regenerate(self, messages: list, tools: list) -> list: ...


class HFRegenerator:
    """Assistant turns from a HF causal LM, left to right: each assistant turn is replaced
    by the target's continuation of the conversation so far (earlier turns already
    regenerated), and a conversation ending in a user/tool turn gains one. Tool results
    stay as recorded, so the supervised tokens are the target's own given exactly the
    context they are stored with. Cost grows with turns x context (the whole history is
    prefilled again every turn): `dlite.decoding.regenerate.BatchedRegenerator` carries each
    conversation's cache from turn to turn and decodes many at once."""

    def __init__(self, model, tokenizer, max_new_tokens: int = 256, do_sample: bool = False):
        self.model, self.tok = model, tokenizer
        self.max_new_tokens, self.do_sample = max_new_tokens, do_sample
        self.generated: List[List[int]] = []  # every turn's new ids, in order (for comparisons)

    def regenerate(self, messages: list, tools: list) -> list:
        out: list = []
        for m in messages:
            out.append(self._turn(out, tools) if m["role"] == "assistant" else m)
        if not out or out[-1]["role"] != "assistant":
            out.append(self._turn(out, tools))
        return out

    def _turn(self, history: list, tools: list) -> dict:
        import torch
        from dlite.target import eos_ids
        prompt = _render(self.tok, history, tools, generation_prompt=True)
        dev = next(self.model.parameters()).device
        ids = self.tok(prompt, add_special_tokens=False, return_tensors="pt")["input_ids"].to(dev)
        with torch.no_grad():
            gen = self.model.generate(ids, attention_mask=torch.ones_like(ids),
                                      max_new_tokens=self.max_new_tokens, do_sample=self.do_sample,
                                      eos_token_id=list(eos_ids(self.model, self.tok)),
                                      pad_token_id=self.tok.pad_token_id or self.tok.eos_token_id)
        self.generated.append(gen[0, ids.shape[1]:].tolist())
        text = self.tok.decode(gen[0, ids.shape[1]:], skip_special_tokens=False)
        for stop in (self.tok.eos_token, self.tok.pad_token):
            text = text.split(stop)[0] if stop else text
        return {"role": "assistant", "content": text}
