"""Trajectory input: where records come from, what shape they have, and what a usable
one looks like. One module per concern:

  inputs      `plan_input(path, per_shard)` -> shard specs; `read_spec(spec)` ->
              (index, where, raw JSON value | Quarantine). JSON lines or one JSON
              document per file, told apart by content; Parquet; HF datasets dirs.
  canonical   `to_canonical(raw, where, keep_reasoning)` -> {"id", "messages", "tools",
              "source_format"} from OpenAI chat, mini-swe-agent (bare list or its 1.1
              save format), Anthropic Messages, Responses API items, SWE-agent .traj,
              OpenHands event streams / eval outputs, ShareGPT and DeepSpec records;
              `source_format` / `count_formats` name them.
  messages    the message dialects (OpenAI / Anthropic blocks / Responses items) ->
              OpenAI chat messages, tool calls and reasoning in one internal form.
  containers  ShareGPT, SWE-agent steps/history and DeepSpec turns -> messages.
  openhands   OpenHands events (actions, observations by `cause`) -> messages.
  validate    `normalise(record)`: roles, text-only content, calls matched to results.

Anything unusable raises `Quarantine(reason, detail)`, which the caller writes to
quarantine.jsonl; `read = written + quarantined` is the caller's count to keep.
"""

from dlite.data.formats.canonical import count_formats, record_id, source_format, to_canonical
from dlite.data.formats.containers import SHAREGPT_ROLES
from dlite.data.formats.errors import Quarantine
from dlite.data.formats.inputs import HF_MARKERS, plan_input, read_spec
from dlite.data.formats.validate import ROLES, normalise

__all__ = ["Quarantine", "plan_input", "read_spec", "to_canonical", "normalise", "record_id",
           "source_format", "count_formats", "HF_MARKERS", "ROLES", "SHAREGPT_ROLES"]
