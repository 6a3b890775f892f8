"""Stage `collect`: agent trajectories -> feature shards, on Ray Data.

  plan     (driver)  the input's records cut into shard specs, record i -> shard i // R
  ids      (driver)  every record's id, so duplicates are decided globally (first wins)
  prepare  (map)     read + adapt + validate one shard's records; bad ones -> quarantine
                     (Ray Data fuses it into the actors' stage: no payload copies)
  features (actors)  rendering + loss mask + length policy,
                     anchors, the target forward in length buckets, each bucket appended
                     to the shard's temp file, renamed, sidecar last (actor pool, GPUs
                     per actor from cluster.gpus_per_worker)
  finish   (driver)  quarantine.jsonl and manifest.json from the sidecars

With `data.regenerate` on, the records are the target's own conversations, from the
`regenerate` stage's output (`pipelines.stages.regenerate.as_input`). Where that stage
kept the target's states (`data.regen_features`), a row it made that equals the one made
here (tokens, loss mask, anchors, fork layout), in a shard whose sidecar names this
collection's layers, dtype and storage, is written from its arrays instead of the
target forward.

Bad records never fail the job; a target that does not load, or an output directory
holding another plan, does. Resume: a rerun skips shards whose sidecar and file are in
place, so after a crash it writes exactly the missing shards (no duplicate, no gap).
`DLITE_COLLECT_CRASH_AFTER=N` makes the driver SIGKILL itself after N finished shards
(the resume test's crash)."""

import hashlib
import json
import os
import signal
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

import numpy as np
import ray
from omegaconf import OmegaConf

from dlite.data import formats, shards
from dlite.data.formats import Quarantine
from dlite.data.heldout import canonical_record, duplicate_id
from dlite.data.shards import Store
from pipelines.common.ray_cluster import init_ray


class CollectError(RuntimeError):
    """A systemic fault: the stage cannot produce shards (as opposed to a bad record)."""


@dataclass
class CollectSettings:
    """The collection knobs, from the config's `data` / `cluster` sections (tests build
    one directly to vary them without a config file)."""
    regenerate: bool = False
    regen_max_new_tokens: int = 256
    records_per_shard: int = 64
    batch_tokens: int = 16384  # token budget of one padded forward batch
    num_actors: int = 1
    gpus_per_actor: float = 0
    precomputed: Optional[str] = None  # a regeneration's features/ directory (see above)

    @classmethod
    def from_config(cls, cfg) -> "CollectSettings":
        d = cfg.data
        return cls(regenerate=d.regenerate, regen_max_new_tokens=d.regen_max_new_tokens,
                   records_per_shard=d.records_per_shard,
                   batch_tokens=max(d.batch_tokens, d.max_seq_len),
                   num_actors=cfg.cluster.num_workers, gpus_per_actor=cfg.cluster.gpus_per_worker)


def make_plan(cfg, st: CollectSettings, fingerprint: dict, identity: list) -> dict:
    """Everything that decides the shards' content (not how fast they are made)."""
    d = cfg.data
    return {"schema_version": shards.SCHEMA_VERSION, "target": fingerprint["id"],
            "layer_ids": list(cfg.drafter.target_layer_ids), "storage_mode": d.storage_mode,
            "reference": d.reference, "topk": d.topk if d.reference == "topk" else None,
            "gamma": cfg.drafter.gamma if d.storage_mode == "anchors" else None,
            "anchors_per_seq": d.anchors_per_seq, "max_seq_len": d.max_seq_len,
            "length_policy": d.length_policy, "seed": cfg.run.seed,
            "target_dtype": cfg.target.dtype, "keep_reasoning": d.keep_reasoning,
            "regenerate": st.regenerate,
            "regen_max_new_tokens": st.regen_max_new_tokens if st.regenerate else None,
            "records_per_shard": st.records_per_shard, "input": identity}


# ---------------------------------------------------------------- Ray steps

def _entry(index, where, q: Quarantine, rid=None) -> dict:
    return {"index": index, "id": rid, "where": where, "reason": q.reason, "detail": q.detail}


def _prepare(batch, duplicates, require_assistant, keep_reasoning=False, canonical=False):
    """One payload per shard: its validated canonical records and its quarantine entries.
    `canonical`: records the regenerate stage wrote, validated there (re-validating
    would refuse their tool results: the regenerated turns carry no structured calls)."""
    dups, out = set(duplicates), []
    for s in batch["spec"]:
        spec, recs, bad, read = json.loads(s), [], [], 0
        for index, where, raw in formats.read_spec(spec):
            read, rid = read + 1, None
            try:
                if canonical and not isinstance(raw, Quarantine):  # a Quarantine value: raised below
                    recs.append({"index": index, "where": where, "id": raw["id"],
                                 "messages": raw["messages"], "tools": raw.get("tools") or [],
                                 **{k: raw[k] for k in ("recorded_messages",) if raw.get(k)}})
                    continue
                rec = canonical_record(raw, where, keep_reasoning)
                rid = rec["id"]
                if index in dups:  # decided over the whole input (`_duplicates`), before validation
                    raise duplicate_id(rid)
                recs.append({"index": index, "where": where,
                             **formats.normalise(rec, require_assistant)})
            except Quarantine as q:
                bad.append(_entry(index, where, q, rid))
        out.append(json.dumps({"shard": spec["shard"], "read": read, "records": recs,
                               "quarantine": bad}, ensure_ascii=False))
    return {"payload": np.array(out, dtype=object)}


class _FeatureWorker:
    """One actor: the target loaded once; each call turns a prepared shard into a file."""

    def __init__(self, cfg: dict, settings: dict, plan_id: str, output: str):
        # torch/transformers are imported here, where the model lives, so the driver and
        # the prepare step stay light.
        import torch
        from dlite import target
        from dlite.data.features import TargetFeatures
        self.cfg, self.st = OmegaConf.create(cfg), CollectSettings(**settings)
        gpu = self.st.gpus_per_actor > 0 and torch.cuda.is_available()
        # The configured target dtype, as training features and evaluation will use it.
        self.model, self.tok = target.load(self.cfg.target)
        self.model.to("cuda" if gpu else "cpu")
        self.tf = TargetFeatures(self.model, self.cfg.drafter.target_layer_ids)
        self.plan_id, self.store = plan_id, Store(output)
        self.pad_id = self.tok.pad_token_id if self.tok.pad_token_id is not None else 0
        d = self.cfg.data
        self.spec = {"storage_mode": d.storage_mode, "reference": d.reference,
                     "topk": d.topk, "gamma": self.cfg.drafter.gamma}

    def __call__(self, batch):
        return {"summary": np.array([json.dumps(self.process(json.loads(p)))
                                     for p in batch["payload"]], dtype=object)}

    def process(self, payload: dict) -> dict:
        from dlite.data.features import write_features
        from dlite.data.render import training_rows
        t0, bad, seqs, d = time.time(), list(payload["quarantine"]), [], self.cfg.data
        for rec in payload["records"]:
            try:  # a regeneration that read the recorded history: a trunk and its branches
                seqs += training_rows(self.tok, rec, d.max_seq_len, d.length_policy, d.anchors_per_seq,
                                      self.cfg.run.seed, d.regen_rows == "forked")
            except Quarantine as q:
                bad.append(_entry(rec["index"], rec["where"], q, rec["id"]))
        taken, seqs = self._take_precomputed(payload["records"], seqs)
        w = shards.ShardWriter(self.store, payload["shard"], self.spec["reference"])
        try:
            w.write(taken)
            st, written, lost = write_features(self.tf, seqs, self.spec, w, self.st.batch_tokens,
                                               self.pad_id)
        except BaseException:
            w.abort()
            raise
        st.update(sequences=len(taken), tokens=sum(len(r["input_ids"]) for r in taken),
                  supervised_tokens=int(sum(np.sum(r["loss_mask"]) for r in taken)),
                  anchors=sum(len(r["anchors"]) for r in taken))
        written |= {(r["index"], r["id"]) for r in taken}
        lost = [s for s in lost if s["index"] not in {r["index"] for r in taken}]
        bad += [_entry(s["index"], s["where"], Quarantine("nonfinite_features", "target states "
                                                          "overflow float16"), s["id"]) for s in lost]
        info = {"plan": self.plan_id, "read": payload["read"], "written": len(written),
                "quarantined": len(bad), "by_reason": dict(Counter(e["reason"] for e in bad)),
                **{k: st[k] for k in ("sequences", "tokens", "supervised_tokens", "anchors")},
                "precomputed_sequences": len(taken),
                "ids": sorted({rid for _, rid in written}), "quarantine": bad,
                "forward_s": round(st["forward_s"], 4), "seconds": round(time.time() - t0, 4)}
        side = w.finish(info)
        return {k: side[k] for k in ("shard", "read", "written", "quarantined", "rows")}

    def _take_precomputed(self, records: list, seqs: list) -> tuple:
        """(rows written from the regeneration's arrays, sequences still to run): a row is
        taken only where the regeneration made exactly this one."""
        if not self.st.precomputed or not seqs:
            return [], seqs
        made = self._precomputed(records)
        taken, rest = [], []
        for s in seqs:
            r = made.get((s["id"], s["part"]))
            if r is not None and _same_row(s, r):
                taken.append({**s, **{k: r[k] for k in shards.ARRAY_DTYPES if k in r}})
            else:
                rest.append(s)
        return taken, rest

    def _precomputed(self, records: list) -> dict:
        """{(id, part): decoded row} of the regeneration's feature shards these records'
        conversation files have (`where` = "<file>:<line>"; none from a shard not finished
        or made with other settings: a resumed regeneration may have changed them)."""
        import pyarrow.parquet as pq
        from pipelines.stages.regenerate import feature_spec
        store, out, want = Store(self.st.precomputed), {}, feature_spec(self.cfg)
        conf = self.model.config
        shape = {"gamma": self.spec["gamma"], "storage_mode": self.spec["storage_mode"],
                 "topk": self.spec["topk"], "hidden_size": conf.hidden_size,
                 "feature_dim": len(self.cfg.drafter.target_layer_ids) * conf.hidden_size}
        by_file = {}
        for rec in records:
            by_file.setdefault(str(rec["where"]).rsplit(":", 1)[0], set()).add(rec["id"])
        for name, ids in by_file.items():
            stem = f"shards/{Path(name).stem}"
            if not store.exists(f"{stem}.json") or \
                    json.loads(store.read_bytes(f"{stem}.json")).get("settings") != want:
                continue
            table = pq.read_table(store.path(f"{stem}.parquet"), filesystem=store.fs,
                                  filters=[("id", "in", sorted(ids))])
            for row in table.to_pylist():
                out[(row["id"], row["part"])] = shards.decode_row(row, shape)
        return out


def _same_row(mine: dict, theirs: dict) -> bool:
    """The same training row: tokens, loss mask, anchors and fork layout all equal."""
    for k in ("input_ids", "loss_mask", "anchors", *shards.FORK_COLUMNS):
        a, b = mine.get(k), theirs.get(k)
        if (a is None) != (b is None) or (a is not None and not np.array_equal(np.asarray(a), np.asarray(b))):
            return False
    return True


# ---------------------------------------------------------------- driver

def _duplicates(specs: list) -> list:
    """Indices whose id already appeared at a lower index (first occurrence wins). A
    driver-side pass: ids must be decided over the whole input, and parsing is cheap
    next to the target forward."""
    seen, dups = set(), []
    for spec in specs:
        for index, where, raw in formats.read_spec(spec):
            if isinstance(raw, dict):
                rid = formats.record_id(raw, where)
                if rid in seen:
                    dups.append(index)
                seen.add(rid)
    return dups


def _run_features(cfg, st: CollectSettings, todo: list, dups: list, plan_id: str, output: str,
                  canonical: bool = False):
    items = [{"spec": json.dumps(s)} for s in todo]
    ds = ray.data.from_items(items, override_num_blocks=len(items)).map_batches(
        _prepare, batch_size=1, fn_kwargs={"duplicates": dups, "require_assistant": True,
                                           "keep_reasoning": bool(cfg.data.keep_reasoning),
                                           "canonical": canonical})
    ds = ds.map_batches(
        _FeatureWorker, batch_size=1, num_cpus=1, num_gpus=st.gpus_per_actor or None,
        compute=ray.data.ActorPoolStrategy(size=st.num_actors, max_tasks_in_flight_per_actor=1),
        fn_constructor_kwargs={"cfg": OmegaConf.to_container(cfg, resolve=True),
                               "settings": asdict(st), "plan_id": plan_id, "output": output})
    crash_after = int(os.environ.get("DLITE_COLLECT_CRASH_AFTER", "0"))
    for n, row in enumerate(ds.iter_rows(), start=1):
        print(f"[collect] shard {json.loads(row['summary'])} ({n}/{len(todo)})", flush=True)
        if crash_after and n >= crash_after:
            os.kill(os.getpid(), signal.SIGKILL)


def _check_target(cfg) -> dict:
    """Fingerprint, config, tokenizer and weight headers on the driver, so a broken
    target fails at once instead of inside every actor."""
    from safetensors import safe_open
    from transformers import AutoConfig
    from dlite import target
    try:
        fp = target.fingerprint(cfg.target)
        tok = target.load_tokenizer(cfg.target)
        conf = AutoConfig.from_pretrained(target.target_dir(cfg.target))
        weights = sorted(target.target_dir(cfg.target).glob("*.safetensors"))
        if not weights:
            raise FileNotFoundError("no *.safetensors weights")
        for w in weights:  # reads the header only
            with safe_open(str(w), framework="pt") as f:
                f.keys()
    except Exception as e:  # any failure here means no shard can be made
        raise CollectError(f"target.path: the target {cfg.target.path!r} does not load: {e}") from e
    if not tok.chat_template:
        raise CollectError(f"target.path: the tokenizer of {cfg.target.path!r} has no chat template")
    return {"fingerprint": fp, "hidden_size": conf.hidden_size,
            "num_layers": conf.num_hidden_layers, "dtype": cfg.target.dtype}


def run_missing_shards(cfg, store: Store, specs: list, plan_id: str, stage: str, work) -> list:
    """Every shard's sidecar, after `work(todo)` (on Ray, started only if needed) made the
    shards not finished yet, then quarantine.jsonl: the resume protocol of the stages
    that write shards (collect, regenerate)."""
    store.remove_tmp("shards")
    todo = [s for s in specs if shards.finished_shard(store, s["shard"], plan_id) is None]
    print(f"[{stage}] {len(specs)} shards, {len(specs) - len(todo)} already done", flush=True)
    if todo:
        init_ray(cfg)
        try:
            work(todo)
        except Exception as e:  # Ray wraps worker failures in pages of traceback
            cause = [x for x in str(e).splitlines() if x.strip()][-1:] or [repr(e)]
            raise CollectError(f"{stage}: the stage failed on a worker: {cause[0]}") from e
    sides = [shards.finished_shard(store, s["shard"], plan_id) for s in specs]
    if any(s is None for s in sides):
        raise CollectError(f"{stage}: shards {[i for i, s in enumerate(sides) if s is None]} "
                           "are missing after the run")
    shards.write_quarantine(store, [e for s in sides for e in s["quarantine"]])
    return sides


def _resolve_input(cfg, input_path: str, output: str) -> str:
    """`builtin:train|heldout` -> the built-in corpus (`data.corpus`; training also gets
    `data.extra_prompts`) written as JSONL beside the output."""
    if not input_path.startswith("builtin:"):
        return input_path
    from dlite.corpus import build
    split, d = input_path.split(":", 1)[1], cfg.data
    n = d.n_train if split == "train" else d.n_heldout
    root = Path(output) if "://" not in output else Path(os.environ.get("TMPDIR", "/tmp"))
    prompts = d.get("extra_prompts") if split == "train" else None
    return str(build.input_file(root, d.get("corpus", "builtin"), split, n, cfg.run.seed, d.min_chars,
                                d.max_chars, prompts, d.get("extra_prompts_limit", 0)))


def _manifest(cfg, plan: dict, plan_id: str, tinfo: dict, sides: list, seconds: float) -> dict:
    keys = ("read", "written", "quarantined", "sequences", "tokens", "supervised_tokens",
            "anchors", "forward_s")
    counts = {k: sum(s[k] for s in sides) for k in keys}
    counts["by_reason"] = dict(sum((Counter(s["by_reason"]) for s in sides), Counter()))
    # rows written from a regeneration's kept states, not this stage's forward
    counts["precomputed_sequences"] = sum(s.get("precomputed_sequences", 0) for s in sides)
    d, k = cfg.data, len(cfg.drafter.target_layer_ids)
    return {**{x: plan[x] for x in ("schema_version", "storage_mode", "reference", "topk",
                                    "gamma", "anchors_per_seq", "max_seq_len", "length_policy",
                                    "regenerate", "records_per_shard", "input", "seed")},
            "plan_id": plan_id, "target_fingerprint": tinfo["fingerprint"],
            "layer_ids": plan["layer_ids"], "num_layers": tinfo["num_layers"],
            "hidden_size": tinfo["hidden_size"], "feature_dim": k * tinfo["hidden_size"],
            "target_dtype": tinfo["dtype"],
            "dtypes": {"features": "float16", "ref_hidden": "float16", "topk_ids": "int32",
                       "topk_logprobs": "float16", "input_ids": "int32", "loss_mask": "int8"},
            "columns": shards.shard_schema(d.reference).names, "counts": counts,
            "files": [{"path": s["file"], "sha256": s["sha256"], "bytes": s["bytes"],
                       "rows": s["rows"]} for s in sides],
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "seconds": round(seconds, 1)}


def collect(cfg, input_path: str, output: str, settings: CollectSettings = None) -> dict:
    """Run (or resume, or find finished) the collection of `input_path` into `output`;
    returns the manifest. Starts Ray (`init_ray`) only if there is work left."""
    t0, st = time.time(), settings or CollectSettings.from_config(cfg)
    tinfo = _check_target(cfg)
    from pipelines.stages.regenerate import as_input  # it builds on this module's steps
    input_path, regen = as_input(cfg, input_path, output, tinfo["fingerprint"],
                                 st.regenerate, st.regen_max_new_tokens)
    if regen is not None and regen.get("features"):  # each shard's settings checked where read
        from pipelines.stages.regenerate import FEATURES
        st = CollectSettings(**{**asdict(st), "precomputed": f"{input_path.rsplit('/', 1)[0]}/{FEATURES}"})
    specs, identity = formats.plan_input(_resolve_input(cfg, input_path, output),
                                         st.records_per_shard, bool(cfg.data.skip_other_files))
    plan = make_plan(cfg, st, tinfo["fingerprint"], identity)
    plan_id = hashlib.sha256(json.dumps(plan, sort_keys=True).encode()).hexdigest()[:16]
    store = Store(output)
    shards.claim(store, plan)
    if store.exists(shards.MANIFEST):
        return shards.read_manifest(output, tinfo["fingerprint"])
    sides = run_missing_shards(cfg, store, specs, plan_id, "collect", lambda todo: _run_features(
        cfg, st, todo, _duplicates(specs), plan_id, output, regen is not None))
    manifest = _manifest(cfg, plan, plan_id, tinfo, sides, time.time() - t0)
    manifest["counts"]["formats"] = formats.count_formats(specs)  # records read, per input format
    if regen is not None:  # where the conversations came from, and what regeneration dropped
        manifest["regenerated"] = {k: regen[k] for k in ("plan_id", "sampling", "counts")}
    shards.write_manifest(store, manifest)
    return manifest


def read_shards(uri: str, expect_fingerprint=None) -> "ray.data.Dataset":
    """The shard rows of a finished collection as a Ray Dataset (array columns are raw
    bytes: decode rows with `dlite.data.shards.decode_row(row, read_manifest(uri))`)."""
    m = shards.read_manifest(uri, expect_fingerprint)
    shards.check_schema(uri, m)
    store = Store(uri)
    return ray.data.read_parquet([store.path(f["path"]) for f in m["files"]],
                                 filesystem=store.fs)
