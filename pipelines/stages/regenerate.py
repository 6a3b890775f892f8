"""Stage `regenerate`: agent trajectories -> the same conversations with the target's own
assistant turns (self-distillation, DLITE.md §3 "Data"), on Ray Data, before `collect`.

  plan        (driver)  the input's records cut into shard specs, record i -> shard i // R
  prepare     (map)     read + adapt + validate one shard's records (collect's step: same
                        formats, same quarantine reasons; prompt-only records are kept)
  regenerate  (actors)  `dlite.decoding.regenerate.BatchedRegenerator` over the shard's
                        records; the shard's JSONL written to a temp name and renamed, its
                        sidecar (counts, timings, quarantine entries) last
  finish      (driver)  quarantine.jsonl and manifest.json from the sidecars

With `data.regen_features` the actors also keep the target states collection needs
(`dlite.data.regen_features`): each shard's training rows, with collection's arrays, go
to `features/shards/shard-NNNNN.parquet` (collection's shard format, its sidecar beside
it) before the shard's own sidecar, and the manifest's `features` names the settings
they were made with; `collect` takes them instead of running the target where its own
rows are the same.

Layout: the plan in `collect.json` (`dlite.data.shards.claim`: a directory holding
another plan is refused), `conversations/shard-NNNNN.jsonl` (canonical {"id", "index",
"where", "sample", "turns", "messages", "tools"} records; what collect reads), their
sidecars `shards/shard-NNNNN.json`, `quarantine.jsonl`,
`manifest.json` (`kind: regenerated`; read = written + quarantined). A rerun finds the
manifest and returns it; after a crash it writes exactly the missing shards."""

import hashlib
import json
import time
from collections import Counter
from dataclasses import asdict, dataclass

import numpy as np
import ray
from omegaconf import OmegaConf

from dlite.data import formats, shards
from dlite.data.shards import Store
from dlite.target import same_target
from pipelines.stages.collect import (CollectError, _check_target, _duplicates, _prepare, _resolve_input,
                                     run_missing_shards)

KIND, SCHEMA, CONVERSATIONS = "regenerated", 1, "conversations"
_TIMINGS = ("turns", "tokens_generated", "prefill_tokens", "prefill_s", "decode_s",
            "decode_steps", "prefix_misses", "shared_prefix_tokens", "drafted", "accepted",
            "feature_rows", "feature_tokens_kept", "feature_tokens_run", "feature_s")
FEATURES = "features"


def conversations_file(shard: int) -> str:
    # Apart from the sidecars, so that the directory reads as plain trajectory JSONL.
    return f"{CONVERSATIONS}/shard-{shard:05d}.jsonl"


@dataclass
class RegenSettings:
    """The regeneration knobs, from the config's `data` / `cluster` sections."""
    max_new_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    samples: int = 1
    batch_size: int = 8
    lookup: int = 0  # prompt-lookup draft tokens per step (greedy; the same tokens, faster)
    history: str = "generated"  # what each turn's prompt holds before it (data.regen_history)
    records_per_shard: int = 64
    num_actors: int = 1
    gpus_per_actor: float = 0
    features: bool = False  # keep collection's target states (data.regen_features)

    @classmethod
    def from_config(cls, cfg) -> "RegenSettings":
        d = cfg.data
        return cls(max_new_tokens=d.regen_max_new_tokens, temperature=d.regen_temperature,
                   top_p=d.regen_top_p, samples=d.regen_samples, batch_size=d.regen_batch_size,
                   lookup=d.regen_lookup, history=d.regen_history,
                   records_per_shard=d.records_per_shard, num_actors=cfg.cluster.num_workers,
                   gpus_per_actor=cfg.cluster.gpus_per_worker, features=bool(d.regen_features))

    def sampling(self, seed: int) -> dict:
        return {"max_new_tokens": self.max_new_tokens, "temperature": self.temperature,
                "top_p": self.top_p if self.temperature > 0 else None,
                "samples": self.samples, "seed": seed}


class _RegenWorker:
    """One actor: the target loaded once; each call regenerates a prepared shard."""

    def __init__(self, cfg: dict, settings: dict, plan_id: str, output: str):
        import torch
        from dlite import target
        from dlite.decoding.regenerate import BatchedRegenerator
        cfg, st = OmegaConf.create(cfg), RegenSettings(**settings)
        model, tok = target.load(cfg.target)  # the experiment's dtype, as collection reads it
        model.to("cuda" if st.gpus_per_actor > 0 and torch.cuda.is_available() else "cpu")
        self.spec = feature_spec(cfg) if st.features else None
        capture = _capture(cfg, model, tok, self.spec) if st.features else None
        self.regen = BatchedRegenerator(model, tok, st.max_new_tokens, st.temperature, st.top_p,
                                        st.samples, st.batch_size, cfg.run.seed, st.lookup, st.history,
                                        capture)
        self.plan_id, self.store, self.output = plan_id, Store(output), output

    def __call__(self, batch):
        return {"summary": np.array([json.dumps(self.process(json.loads(p)))
                                     for p in batch["payload"]], dtype=object)}

    def process(self, payload: dict) -> dict:
        t0, before = time.time(), dict(self.regen.stats)
        done, bad = self.regen.regenerate_many(payload["records"])
        bad = list(payload["quarantine"]) + bad
        if self.spec is not None:  # before the shard's sidecar: a finished shard has them
            self._write_features(payload["shard"], [r for d in done for r in d.pop("features")])
        lines = [json.dumps({k: v for k, v in d.items() if k != "tokens"}, ensure_ascii=False)
                 for d in done]
        name, file = shards.shard_name(payload["shard"]), conversations_file(payload["shard"])
        self.store.write_atomic(file, "".join(x + "\n" for x in lines).encode())
        info = {"plan": self.plan_id, "shard": payload["shard"], "read": payload["read"],
                "written": len({d["index"] for d in done}), "quarantined": len(bad),
                "rows": len(done), "by_reason": dict(Counter(e["reason"] for e in bad)),
                "quarantine": bad, "file": file, "bytes": self.store.size(file),
                "sha256": self.store.sha256(file), "seconds": round(time.time() - t0, 3),
                **{k: self.regen.stats[k] - before[k] for k in _TIMINGS}}
        self.store.write_atomic(f"{name}.json", json.dumps(info).encode())  # done, last
        return {k: info[k] for k in ("shard", "read", "written", "quarantined", "tokens_generated")}

    def _write_features(self, shard: int, rows: list) -> None:
        # its sidecar names the settings: a resumed run may have other layers than the first
        shards.write_shard(Store(f"{self.output}/{FEATURES}"), shard, rows, self.spec["reference"],
                           {"plan": self.plan_id, "settings": self.spec})


def feature_spec(cfg) -> dict:
    """The settings regenerated features are made with, which `collect` compares with its
    own before taking them (the rows themselves it compares one by one)."""
    d = cfg.data
    return {"layer_ids": list(cfg.drafter.target_layer_ids), "target_dtype": cfg.target.dtype,
            "storage_mode": d.storage_mode, "reference": d.reference,
            "topk": d.topk if d.reference == "topk" else None,
            "gamma": cfg.drafter.gamma if d.storage_mode == "anchors" else None}


def _capture(cfg, model, tok, spec: dict):
    from dlite.data.regen_features import StateCapture
    from dlite.data.render import training_rows
    d = cfg.data
    return StateCapture(model, spec["layer_ids"], spec, lambda rec: training_rows(
        tok, rec, d.max_seq_len, d.length_policy, d.anchors_per_seq, cfg.run.seed, d.regen_rows == "forked"))


def _run(cfg, st: RegenSettings, todo: list, dups: list, plan_id: str, output: str) -> None:
    items = [{"spec": json.dumps(s)} for s in todo]
    ds = ray.data.from_items(items, override_num_blocks=len(items)).map_batches(
        _prepare, batch_size=1, fn_kwargs={"duplicates": dups, "require_assistant": False,
                                           "keep_reasoning": bool(cfg.data.keep_reasoning)})
    ds = ds.map_batches(
        _RegenWorker, batch_size=1, num_cpus=1, num_gpus=st.gpus_per_actor or None,
        compute=ray.data.ActorPoolStrategy(size=st.num_actors, max_tasks_in_flight_per_actor=1),
        fn_constructor_kwargs={"cfg": OmegaConf.to_container(cfg, resolve=True),
                               "settings": asdict(st), "plan_id": plan_id, "output": output})
    for n, row in enumerate(ds.iter_rows(), start=1):
        print(f"[regenerate] shard {json.loads(row['summary'])} ({n}/{len(todo)})", flush=True)


def _manifest(plan: dict, plan_id: str, fingerprint: dict, sides: list, seconds: float, lookup: int = 0) -> dict:
    # .get: a shard finished before a counter existed (drafted / accepted) counts 0 there
    counts = {k: sum(s.get(k, 0) for s in sides) for k in ("read", "written", "quarantined", "rows", *_TIMINGS)}
    counts["by_reason"] = dict(sum((Counter(s["by_reason"]) for s in sides), Counter()))
    rate = lambda n, s: round(n / s, 1) if s > 0 else None  # noqa: E731
    return {"kind": KIND, "schema_version": SCHEMA, "plan_id": plan_id,
            "target_fingerprint": fingerprint, "sampling": plan["sampling"],
            "history": plan.get("history", "generated"),
            "records_per_shard": plan["records_per_shard"], "input": plan["input"],
            "counts": counts,
            "prefill_tokens_per_s": rate(counts["prefill_tokens"], counts["prefill_s"]),
            "decode_tokens_per_s": rate(counts["tokens_generated"], counts["decode_s"]),
            # speed only: verified lookup drafts (greedy) leave the tokens as they are
            "features": plan.get("features"),
            "lookup": {"draft_tokens": lookup,
                       "acceptance": round(counts["accepted"] / counts["drafted"], 3) if counts["drafted"] else None},
            "files": [{"path": s["file"], "sha256": s["sha256"], "bytes": s["bytes"], "rows": s["rows"]}
                      for s in sides],
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "seconds": round(seconds, 1)}


def read_manifest(uri: str):
    """The manifest of a finished regeneration at `uri`, or None when it is not one."""
    store = Store(uri)
    if not store.exists(shards.MANIFEST):
        return None
    m = json.loads(store.read_bytes(shards.MANIFEST))
    return m if m.get("kind") == KIND else None


def regenerate(cfg, input_path: str, output: str, settings: RegenSettings = None) -> dict:
    """Run (or resume, or find finished) the regeneration of `input_path` into `output`;
    returns the manifest. Starts Ray (`init_ray`) only if there is work left."""
    t0, st = time.time(), settings or RegenSettings.from_config(cfg)
    fp = _check_target(cfg)["fingerprint"]
    specs, identity = formats.plan_input(_resolve_input(cfg, input_path, output),
                                         st.records_per_shard, bool(cfg.data.skip_other_files))
    plan = {"kind": KIND, "schema_version": SCHEMA, "target": fp["id"], "input": identity,
            "sampling": st.sampling(cfg.run.seed), "records_per_shard": st.records_per_shard,
            "keep_reasoning": bool(cfg.data.keep_reasoning),
            # only when not the default, so that earlier plans keep their ids
            **({"history": st.history} if st.history != "generated" else {})}
    plan_id = hashlib.sha256(json.dumps(plan, sort_keys=True).encode()).hexdigest()[:16]
    store = Store(output)
    shards.claim(store, plan)
    if (m := read_manifest(output)) is not None:
        return m
    if st.features:  # what the kept states are; not in the plan: the conversations are the same
        plan = {**plan, "features": feature_spec(cfg)}
        Store(f"{output}/{FEATURES}").remove_tmp("shards")  # here: actors write side by side
    store.remove_tmp(CONVERSATIONS)
    sides = run_missing_shards(cfg, store, specs, plan_id, "regenerate", lambda todo: _run(
        cfg, st, todo, _duplicates(specs), plan_id, output))
    manifest = _manifest(plan, plan_id, fp, sides, time.time() - t0, st.lookup if st.temperature <= 0 else 0)
    shards.write_manifest(store, manifest)
    return manifest


def as_input(cfg, input_path: str, output: str, fingerprint: dict, enabled: bool,
             max_new_tokens: int):
    """What `collect` reads: (input path, the regeneration manifest or None). A finished
    regeneration is read as it is (its `conversations/`, validated here); with regeneration on,
    any other input is regenerated first into `<output>/regenerated` (resumable there)."""
    m = read_manifest(input_path) if "://" not in input_path else None
    if m is None and enabled:
        st = RegenSettings(**{**asdict(RegenSettings.from_config(cfg)), "max_new_tokens": max_new_tokens})
        m = regenerate(cfg, input_path, f"{output}/regenerated", st)
        input_path = f"{output}/regenerated"
    if m is None:
        return input_path, None
    if not same_target(m["target_fingerprint"]["id"], fingerprint):
        raise CollectError(f"{input_path}: conversations regenerated by target "
                           f"{m['target_fingerprint']['id']}, but the target is {fingerprint['id']}")
    return f"{input_path}/{CONVERSATIONS}", m
