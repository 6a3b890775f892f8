"""The pipeline as a DAG of idempotent stages (ARCHITECTURE.md §1):

    [regenerate ->] collect -> teacher -> align ---------------\
                            -> align_no_teacher (ablation) -----> evaluate -> publish
                            -> dspark (baseline) --------------/

`regenerate` (the target's own assistant turns, before collection) runs when
`data.regenerate` is on and `collect` is in `run.stages`.

Each stage's output directory is `<run.output_dir>/stages/<stage>-<hash>`, the hash
taken over the config keys the stage reads and its inputs' hashes (the target's
fingerprint enters through `collect`), so pipelines that share settings share finished
stages and a changed setting re-runs exactly the stages downstream of it. A finished
stage writes `stage.json` last; a rerun skips it. An unfinished one is run again and
resumes on its own (collection keeps finished shards, training resumes from its last
checkpoint, evaluation and publishing are cheap and idempotent).

No Ray here: `plan` is pure (for `--dry-run`), and each stage's runner calls the
stage module, which starts or joins Ray itself.
"""

import hashlib
import json
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional

from omegaconf import OmegaConf

from pipelines.common import tracking
MARKER = "stage.json"
_TRAIN_COMMON = ("run.seed", "drafter", "train.lr", "train.warmup_frac", "train.weight_decay",
                 "train.batch_size", "train.grad_accum", "train.grad_clip", "train.zero_stage",
                 "train.precision", "train.eval_every", "train.supervise", "cluster.num_workers",
                 "data.shuffle_buffer", "data.val_group")
# The loss each training stage reads: the teacher its own keys, the others stage 2's.
_STAGE2_LOSS = ("train.ce_weight", "train.tv_weight", "train.loss_decay", "train.ce_labels")
_TEACHER_LOSS = ("train.teacher_ce_weight", "train.teacher_tv_weight", "train.teacher_loss_decay",
                 "train.teacher_ce_labels")
# Which drafter each training stage yields, under the name reports and plots use.
METHODS = {"align": "dlite", "align_no_teacher": "dlite_no_teacher", "dspark": "dspark"}


class PipelineError(RuntimeError):
    """The stages asked for cannot run (e.g. --only a stage whose inputs are missing)."""


@dataclass(frozen=True)
class StageDef:
    name: str
    deps: tuple   # stages whose outputs this one reads (when they are in run.stages)
    keys: tuple   # config keys that decide this stage's output
    # A stage not listed in run.stages: on when this boolean key is true and the stage
    # it feeds is in run.stages.
    switch: Optional[str] = None
    feeds: Optional[str] = None


_REGEN_KEYS = ("run.seed", "target", "data.train_path", "data.n_train", "data.min_chars",
               "data.max_chars", "data.skip_other_files", "data.keep_reasoning",
               "data.records_per_shard", "data.regen_max_new_tokens", "data.regen_temperature",
               "data.regen_top_p", "data.regen_samples", "data.corpus", "data.extra_prompts",
               "data.extra_prompts_limit", "data.regen_history")
DEFS = [
    StageDef("regenerate", (), _REGEN_KEYS, switch="data.regenerate", feeds="collect"),
    StageDef("collect", ("regenerate",), ("run.seed", "target", "data", "drafter.target_layer_ids",
                                          "drafter.gamma")),
    StageDef("teacher", ("collect",), _TRAIN_COMMON + _TEACHER_LOSS + ("train.steps_teacher",)),
    StageDef("align", ("collect", "teacher"), _TRAIN_COMMON + _STAGE2_LOSS + ("train.steps_align", "train.distill_frac",
                                                         "train.recipe", "train.blend_frac", "train.kl_weight")),
    StageDef("align_no_teacher", ("collect",), _TRAIN_COMMON + _STAGE2_LOSS + ("train.steps_teacher", "train.steps_align")),
    StageDef("dspark", ("collect",), _TRAIN_COMMON + _STAGE2_LOSS + ("train.steps_dspark",)),
    StageDef("evaluate", ("align", "align_no_teacher", "dspark"),
             ("run.seed", "target", "data.heldout_path", "data.corpus", "data.min_chars", "data.max_chars",
              "eval")),
    StageDef("publish", ("evaluate", "align"), ("gate", "tracking.registered_model")),
]
BY_NAME = {d.name: d for d in DEFS}


@dataclass
class PlannedStage:
    name: str
    deps: List[str]
    hash: str
    dir: str
    status: str  # "done" | "resume" | "run" | "reuse" (done, not selected) | "off"
    selected: bool = field(default=True)


def target_identity(cfg) -> str:
    """The target's content fingerprint, or its configured path when the weights are not
    reachable from here (a hub id at `--dry-run`): the plan says which."""
    from dlite import target
    try:
        return target.fingerprint(cfg.target)["id"]
    except (OSError, ValueError):
        return f"unresolved:{cfg.target.path}@{cfg.target.revision}"


def _value(cfg, key: str):
    v = OmegaConf.select(cfg, key)
    return OmegaConf.to_container(v, resolve=True) if OmegaConf.is_config(v) else v


# Settings added after stages were first hashed: at these values they leave a stage's
# hash as it was, so finished stages stay reusable (a section's field, or a whole key).
_HASH_NEUTRAL = {"drafter": {"draft_vocab_prior": "low_ids", "anchor_group_size": 2, "sequential_rank": 256,
                             "v1_teacher": False, "history_window": None},
                 "train.supervise": "assistant",
                 "data.shuffle_buffer": 256,  # hashed through collect's data section before
                 "data.val_group": None,
                 # the stage-2 loss and recipe as they were hard-wired before they were keys
                 "train.ce_weight": 0.1, "train.tv_weight": 0.9, "train.loss_decay": 4.0,
                 "train.ce_labels": "data", "train.recipe": "teacher_init", "train.blend_frac": 0.0,
                 "train.kl_weight": 1.0,
                 # the teacher's own loss keys at the stage-2 defaults it read before them
                 "train.teacher_ce_weight": 0.1, "train.teacher_tv_weight": 0.9,
                 "train.teacher_loss_decay": 4.0, "train.teacher_ce_labels": "data",
                 "data.corpus": "builtin", "data.extra_prompts": None, "data.extra_prompts_limit": 0,
                 "data.regen_history": "generated",
                 "data": {"regen_temperature": 0.0, "regen_top_p": 1.0, "regen_samples": 1,
                          "regen_batch_size": 8, "regen_lookup": 0, "regen_history": "generated",
                          "regen_rows": "forked", "regen_features": False,
                          "corpus": "builtin", "extra_prompts": None, "extra_prompts_limit": 0},
                 "eval": {"verify_cost_tokens": [1, 2, 4, 8], "verify_cost": [1.0, 1.4, 1.6, 2.2],
                          "tree_budget": 16, "calibration_trajectories": 1,
                          "calibration_max_turns": None, "concurrency": [], "concurrency_requests": None,
                          "hybrid_gamma": None}}


# Keys inside a section a stage hashes whole that do not decide that stage's output:
# how fast it is made (`regen_batch_size`, `regen_lookup`: batched regeneration, with
# or without verified lookup drafts, gives batch 1's greedy tokens; `regen_features`:
# collection's rows from the regeneration's kept states instead of its own forward;
# `batch_tokens`: collection's forward batches) or what later stages read (`cache_bytes`,
# and `shuffle_buffer` and `val_group`, which the training stages hash themselves). They are hashed at
# their defaults: changing one keeps a finished stage reusable, and the hashes of runs
# at the defaults stay what they were.
_HASHED_AT_DEFAULT = {"collect": {"data": {"regen_batch_size": 8, "regen_lookup": 0, "regen_features": False,
                                           "batch_tokens": 16384, "cache_bytes": 1 << 30,
                                           "shuffle_buffer": 256, "val_group": None}}}


def _agent_ids(cfg) -> Optional[int]:
    """The agent corpus's id scheme when the stages read it (a built-in agent or mixed
    corpus, no data.train_path): ids name the package since version 2, which
    `data.val_group` reads, so stages finished on the old ids are not reused."""
    d = cfg.data
    if d.get("train_path") or d.get("corpus", "builtin") == "builtin":
        return None
    from dlite.corpus.build import AGENT_IDS
    return AGENT_IDS


def _stage_hash(cfg, d: StageDef, dep_hashes: dict, identity: str) -> str:
    values = {k: _value(cfg, k) for k in d.keys}
    for section, defaults in _HASHED_AT_DEFAULT.get(d.name, {}).items():
        if isinstance(values.get(section), dict):
            values[section].update({k: v for k, v in defaults.items() if k in values[section]})
    for key, neutral in _HASH_NEUTRAL.items():
        if isinstance(values.get(key), dict):
            values[key] = {k: v for k, v in values[key].items() if neutral.get(k, object()) != v}
        elif key in values and values[key] == neutral:
            del values[key]
    payload = {"stage": d.name, "keys": values, "deps": dep_hashes}
    if d.name in ("regenerate", "collect"):
        payload["target"] = identity
        scheme = _agent_ids(cfg)
        if scheme:  # the built input's record ids changed
            payload["agent_ids"] = scheme
    if d.name == "regenerate" and cfg.data.get("regen_history") == "recorded":
        # its records carry the recorded conversation too (collect forks rows from it)
        payload["recorded_messages"] = True
    return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()[:12]


def plan(cfg, only: Optional[List[str]] = None, start: Optional[str] = None) -> List[PlannedStage]:
    """Every stage of `run.stages` with its output dir and what a run would do with it."""
    enabled = [d for d in DEFS if _enabled(cfg, d)]
    names = [d.name for d in enabled]
    for s in (only or []) + ([start] if start else []):
        if s not in names:
            raise PipelineError(f"--only/--from: {s!r} is not one of the enabled stages {names}")
    root, identity = Path(cfg.run.output_dir).resolve() / "stages", target_identity(cfg)
    hashes, out = {}, []
    for i, d in enumerate(enabled):
        deps = [x for x in d.deps if x in names]
        hashes[d.name] = _stage_hash(cfg, d, {x: hashes[x] for x in deps}, identity)
        path = root / f"{d.name}-{hashes[d.name]}"
        selected = (d.name in only) if only else (not start or i >= names.index(start))
        done = (path / MARKER).is_file()
        status = ("done" if done else "resume" if path.exists() else "run") if selected else \
                 ("reuse" if done else "off")
        out.append(PlannedStage(d.name, deps, hashes[d.name], str(path), status, selected))
    _check_inputs(out)
    return out


def _enabled(cfg, d: StageDef) -> bool:
    if d.switch is None:
        return d.name in cfg.run.stages
    return bool(OmegaConf.select(cfg, d.switch)) and d.feeds in cfg.run.stages


def _check_inputs(stages: List[PlannedStage]) -> None:
    by = {s.name: s for s in stages}
    for s in stages:
        if s.selected:
            missing = [d for d in s.deps if by[d].status == "off"]
            if missing:
                raise PipelineError(
                    f"stage {s.name} needs {', '.join(missing)}, not finished and not selected "
                    f"({by[missing[0]].dir}): drop --only/--from or include {missing[0]}")


def home_dir(cfg) -> Path:
    """A pipeline's own directory (its config.yaml, summary.json and MLflow run id):
    `<run.output_dir>/<run.name>-<config hash>`, so a rerun finds its parent run."""
    from dlite.config import config_hash
    return Path(cfg.run.output_dir).resolve() / f"{cfg.run.name}-{config_hash(cfg)}"


def check_writable(cfg) -> None:
    """Before any work: `run.output_dir` (every stage's outputs) and `cluster.storage_uri`
    (Ray Train checkpoints, when set) take a file. An unwritable NFS mount or bucket then
    costs one line (PipelineError), not a traceback after collection."""
    for key in ("run.output_dir", "cluster.storage_uri"):
        where = OmegaConf.select(cfg, key)
        if not where:
            continue
        try:
            _probe(str(where))
        except (OSError, ValueError) as e:  # pyarrow: ArrowInvalid is a ValueError
            why = getattr(e, "strerror", None) or " ".join(str(e).split())[:160] or type(e).__name__
            raise PipelineError(f"{key}: cannot write {where} ({why}): make it writable "
                                f"or point {key} elsewhere") from None


def _probe(where: str) -> None:
    """Write and delete one file there: local / NFS paths directly, URIs (s3://, ...)
    through pyarrow, as the stages write them."""
    if "://" not in where:
        return tracking.probe_write(Path(where))
    import uuid
    from pyarrow import fs as pafs
    filesystem, root = pafs.FileSystem.from_uri(where)
    probe = f"{root.rstrip('/')}/.dlite-write-check-{uuid.uuid4().hex}"
    with filesystem.open_output_stream(probe) as f:
        f.write(b"ok")
    filesystem.delete_file(probe)


def open_home(cfg, tags: dict) -> tuple:
    """(home dir, MLflow parent run id): the dir made, the resolved config written there,
    the parent run opened (reopened when the dir already has one)."""
    from dlite.config import to_yaml
    home = home_dir(cfg)
    home.mkdir(parents=True, exist_ok=True)
    (home / "config.yaml").write_text(to_yaml(cfg))
    return home, tracking.open_parent(cfg, home, home.name, tags)


@contextmanager
def child_run(ctx, stage: str, out: Path):
    """A stage's MLflow child run, closed FINISHED or FAILED."""
    with tracking.child_run(ctx.cfg, stage, out, ctx.parent_run_id) as run_id:
        yield run_id


@dataclass
class Context:
    cfg: object
    parent_run_id: str
    log: Callable[[str], None] = print


def execute(ctx: Context, stages: List[PlannedStage], runners: Dict[str, Callable]) -> Dict[str, dict]:
    """Run the plan in order; returns each finished stage's summary (`stage.json`)."""
    results = {}
    for s in stages:
        out = Path(s.dir)
        if s.status in ("done", "reuse"):
            results[s.name] = json.loads((out / MARKER).read_text())
            ctx.log(f"[pipeline] {s.name:<16} finished earlier ({out.name})")
            continue
        if s.status == "off":
            continue
        ctx.log(f"[pipeline] {s.name:<16} {'resuming' if s.status == 'resume' else 'running'} -> {out}")
        t0 = time.time()
        out.mkdir(parents=True, exist_ok=True)
        summary = runners[s.name](ctx, out, {d: results[d] for d in s.deps if d in results})
        summary = {**summary, "stage": s.name, "hash": s.hash, "seconds": round(time.time() - t0, 1)}
        tmp = out / f".{MARKER}.tmp"
        tmp.write_text(json.dumps(summary, indent=2, default=str) + "\n")
        tmp.rename(out / MARKER)  # the completion marker, last
        results[s.name] = summary
        ctx.log(f"[pipeline] {s.name:<16} done in {summary['seconds']:.0f}s")
    return results
