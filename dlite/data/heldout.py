"""Held-out records for evaluation, read through the same format layer as collection.

`data.heldout_path` may be anything `collect` reads (JSONL, one JSON document per file,
`.traj` / `.traj.json`, Anthropic / Responses logs, ShareGPT, Parquet, HF datasets, a
directory of them). Two record kinds come out, the two `dlite.decoding.replay` replays:
- a trajectory with at least one assistant turn, canonical and validated as collection
  validates it (`dlite.data.formats.normalise`);
- a DeepSpec-style prompt `{"turns": [str, ...]}` of user turns only (e.g. SWE-bench
  issue texts), kept as such: the target answers each turn itself during replay, which
  the canonical mapping (alternating user / assistant) would lose.
Unusable records are quarantined with a reason, never dropped: reading stops once
`limit` records are usable, so `read = used + quarantined` holds for the report."""

from collections import Counter
from typing import List, Optional, Tuple

from dlite.data import formats
from dlite.data.formats import Quarantine


def _prompt_record(raw, where: str) -> Optional[dict]:
    """The `turns` prompt form, validated, or None when `raw` is not one."""
    if not (isinstance(raw, dict) and "turns" in raw) or any(k in raw for k in ("messages", "conversations")):
        return None
    turns = raw["turns"]
    if not isinstance(turns, list) or not turns or not all(isinstance(t, str) and t.strip() for t in turns):
        raise Quarantine("bad_turns", "`turns` must be a non-empty list of non-empty strings")
    return {"id": formats.record_id(raw, where), "turns": list(turns)}


def duplicate_id(rid: str) -> Quarantine:
    """The quarantine of a record whose id appeared earlier (this reader and collection)."""
    return Quarantine("duplicate_id", f"id {rid!r} appears earlier in the input")


def canonical_record(raw, where: str, keep_reasoning: bool) -> dict:
    """One value `formats.read_spec` yielded -> its canonical record, not yet validated
    (this reader and collection); a Quarantine the reader yielded is raised as it is."""
    if isinstance(raw, Quarantine):
        raise raw
    return formats.to_canonical(raw, where, keep_reasoning=keep_reasoning)


def _usable(raw, where: str, seen: set, keep_reasoning: bool) -> dict:
    """One raw value -> a replayable record, or Quarantine (first usable occurrence of an
    id wins). Unlike collection, which decides duplicates over the whole input before
    validating, ids are checked after validation: reading stops at `limit`, no first pass."""
    rec = _prompt_record(raw, where)  # None for a Quarantine value too: raised below
    if rec is None:
        rec = formats.normalise(canonical_record(raw, where, keep_reasoning))
    if rec["id"] in seen:
        raise duplicate_id(rec["id"])
    seen.add(rec["id"])
    return rec


def read_heldout(path: str, limit: int, keep_reasoning: bool = False) -> Tuple[List[dict], dict, List[dict]]:
    """(the first `limit` usable records, counts {read, used, quarantined, reasons},
    quarantine entries {index, where, reason, detail})."""
    specs, _ = formats.plan_input(path, per_shard=1024)
    values = ((i, w, raw) for spec in specs for i, w, raw in formats.read_spec(spec))
    used, bad, seen, read = [], [], set(), 0
    for index, where, raw in values:
        if len(used) >= limit:  # lazily read: a large directory is not parsed past need
            break
        read += 1
        try:
            used.append(_usable(raw, where, seen, keep_reasoning))
        except Quarantine as q:
            bad.append({"index": index, "where": where, "reason": q.reason, "detail": q.detail})
    reasons = dict(Counter(b["reason"] for b in bad))
    return used, {"read": read, "used": len(used), "quarantined": len(bad), "reasons": reasons}, bad
