"""What each training stage trains, engine- and cluster-free (DLITE.md §3):

  teacher  the history-aware teacher (`arch=teacher`) against the target, by its own
           loss keys (`train.teacher_*`), whatever the recipe's stage 2
  align    the DLite student, initialised from the teacher's shared weights, distilling
           the teacher's block distributions for `distill_frac` of `steps_align`, then
           against the target. `train.skip_teacher` is the ablation: the student from
           scratch, against the target for all `steps_align` steps (same step count).
           `train.recipe: published` is the authors' (FlashMTP `train_dlite_two_stage.py`):
           from scratch but the teacher's sequential head, copied and frozen for stage 1
           (KL to the teacher, `distill_frac`), a cosine blend of the two losses
           (`blend_frac`), then stage 2 against the target (`dlite.train.loop`)
  dspark   the DSpark-style baseline (`arch=dspark`) against the target

The teacher is run on the fly during distillation, on the same `full` shard batch as
the student, rather than stored at collection time: its block distributions are
gamma x vocabulary per anchor (or a lossy top-k) and would need a re-collection for
every new teacher, whereas a no-grad forward of a model the student's size replaces
the re-projection of the stored target reference (measured on the tiny CPU setup: a
distillation step and a target step both ~50 ms, within noise), and it sees exactly
the anchors re-sampled for this epoch.

`pipelines/stages/train.py` runs these on Ray Train + DeepSpeed; `pipelines/benchmarks/train.py`
runs them in one process with the plain engine. Both build everything from here."""

import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import List, Optional

import torch
from omegaconf import OmegaConf

from dlite import target as tgt
from dlite.data import shards
from dlite.export import load_drafter
from dlite.data import draft_vocab as dv
from dlite.models import DrafterConfig, build_drafter, init_student_from_teacher
from dlite.models.teacher import copy_head
from dlite.train.data import collate, training_row
from dlite.train.loop import LoopConfig, to_device
from dlite.train.optim import separate_head
from dlite.train.step import LossSpec

STAGE_ARCH = {"teacher": "teacher", "align": "dlite", "dspark": "dspark"}


# A plan's architecture that is a drafter config's arch + flags (`drafter_config`).
PLAN_ARCHS = {"dlite_v1_teacher": {"arch": "dlite_v1", "v1_teacher": True}}


@dataclass
class StagePlan:
    stage: str
    arch: str
    steps: int
    distill_steps: int = 0
    from_teacher: bool = False  # the student needs the teacher (init and / or distillation)
    blend_steps: int = 0
    recipe: str = "teacher_init"  # "published": from scratch but the head, copied and frozen

    @property
    def needs_teacher(self) -> bool:
        return self.from_teacher


def plan_stage(cfg, stage: str) -> StagePlan:
    """The stage's architecture, step count and use of the teacher, from the config."""
    t = cfg.train
    if stage not in STAGE_ARCH:
        raise ValueError(f"stage must be one of {sorted(STAGE_ARCH)}, got {stage!r}")
    if stage == "teacher":  # the published design has a teacher of its own shape
        return StagePlan(stage, "dlite_v1_teacher" if cfg.drafter.arch == "dlite_v1" else "teacher",
                         t.steps_teacher)
    if stage == "dspark":
        return StagePlan(stage, "dspark", t.steps_dspark)
    # The align stage trains our DLite, or the published design when the drafter section
    # asks for it (`drafter.arch: dlite_v1`; from scratch, the config check insists).
    arch = "dlite_v1" if cfg.drafter.arch == "dlite_v1" else "dlite"
    if t.skip_teacher:
        return StagePlan(stage, arch, t.steps_align)
    return StagePlan(stage, arch, t.steps_align, round(t.distill_frac * t.steps_align), True,
                     round(t.blend_frac * t.steps_align), t.recipe)


def freezes_head(plan: StagePlan) -> bool:
    """Recipe "published": the student's copied head is frozen in stage 1, by the lr of an
    optimizer group of its own (`dlite.train.optim.separate_head`)."""
    return plan.recipe == "published" and plan.from_teacher


def loop_config(cfg, plan: StagePlan) -> LoopConfig:
    """The loop's schedule and loss: the teacher stage's own (`train.teacher_*`), else
    the recipe's stages (recipe "published": the head frozen in stage 1)."""
    t = cfg.train
    spec = LossSpec.for_teacher(t) if plan.stage == "teacher" else LossSpec.from_train(t)
    return LoopConfig(steps=plan.steps, lr=t.lr, warmup_frac=t.warmup_frac, grad_accum=t.grad_accum,
                      distill_steps=plan.distill_steps, blend_steps=plan.blend_steps,
                      eval_every=t.eval_every, spec=spec, freeze_head=freezes_head(plan))


def drafter_config(cfg, arch: str) -> DrafterConfig:
    """The drafter section with the stage's architecture (plain or structured config)."""
    over = PLAN_ARCHS.get(arch, {"arch": arch})
    return DrafterConfig(**{**OmegaConf.to_container(cfg.drafter, resolve=True), **over})


# ---------------------------------------------------------------- models

def _target_tensors(target_cfg, names, dtype) -> dict:
    """{name: tensor} of those `names` found in the target's safetensors files, read
    file by file (a worker needs a few matrices, not a whole 8B target in memory)."""
    from safetensors import safe_open
    found = {}
    for f in sorted(tgt.target_dir(target_cfg).glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as sf:
            for name in names:
                if name in sf.keys():
                    found[name] = sf.get_tensor(name).to(dtype)
    return found


def load_vocab(target_cfg, dtype=torch.float32) -> tuple:
    """(embed, lm_head, mask_id) read straight from the target's safetensors."""
    from transformers import AutoConfig
    d = tgt.target_dir(target_cfg)
    conf = AutoConfig.from_pretrained(d)
    found = _target_tensors(target_cfg, ("model.embed_tokens.weight", "lm_head.weight"), dtype)
    embed = found["model.embed_tokens.weight"]
    lm_head = found.get("lm_head.weight", embed if conf.tie_word_embeddings else None)
    if lm_head is None:
        raise ValueError(f"target.path: no lm_head.weight in {d} and embeddings are not tied")
    tok = tgt.load_tokenizer(target_cfg)
    return embed, lm_head, tgt.mask_token_id(SimpleNamespace(config=conf), tok)


def load_final_norm(target_cfg, dtype=torch.float32) -> torch.Tensor:
    """The target's final-norm weight (`model.norm.weight`), which the published DLite
    design applies to the last context layer (`dlite.models.dlite_v1`)."""
    found = _target_tensors(target_cfg, ("model.norm.weight",), dtype)
    if "model.norm.weight" not in found:
        raise ValueError(f"target.path: no model.norm.weight in {tgt.target_dir(target_cfg)}")
    return found["model.norm.weight"]


def teacher_dir(path: str) -> Path:
    """A teacher stage's output dir or its `drafter/` artifact dir."""
    p = Path(path)
    return p / "drafter" if (p / "drafter" / "config.json").is_file() else p


def load_teacher(path: str, vocab: tuple, device=None, dtype=torch.float32):
    """The frozen teacher from its exported artifact (never trained here), in the
    student's compute dtype."""
    teacher = load_drafter(teacher_dir(path), vocab[0], vocab[1])
    if teacher.cfg.arch != "teacher" and not teacher.cfg.v1_teacher:
        raise ValueError(f"--teacher {path}: architecture {teacher.cfg.arch!r}, not 'teacher' "
                         f"(or a dlite_v1 teacher)")
    teacher.requires_grad_(False)
    return teacher.to(device or "cpu", dtype).eval()


def build_model(cfg, plan: StagePlan, vocab: tuple, teacher=None, device=None, draft_ids=None):
    """The stage's model, seeded by `run.seed` (every rank and engine builds the same
    init), its shared weights copied from the teacher when the plan says so. With
    `drafter.draft_vocab_size` set, `draft_ids` is the draft vocabulary
    (`draft_vocab_from_shards`); a student from a teacher takes the teacher's."""
    torch.manual_seed(cfg.run.seed)
    n = cfg.drafter.draft_vocab_size
    if plan.from_teacher and teacher is not None and teacher.vocab.draft_ids is not None:
        draft_ids = teacher.vocab.draft_ids.cpu() if draft_ids is None else draft_ids
    if n is not None and draft_ids is None:
        raise ValueError(f"drafter.draft_vocab_size={n}: build_model needs the draft vocabulary "
                         f"(dlite.train.plan.draft_vocab_from_shards on the training shards)")
    parts = {"final_norm_weight": load_final_norm(cfg.target)} if plan.arch.startswith("dlite_v1") else {}
    model = build_drafter(drafter_config(cfg, plan.arch), *vocab, draft_vocab=draft_ids, **parts)
    if plan.from_teacher:
        if teacher is None:
            raise ValueError("the align stage needs --teacher (or train.skip_teacher=true)")
        if plan.recipe == "published":
            copy_head(model, teacher)  # the rest stays at its fresh init
        else:
            init_student_from_teacher(model, teacher)
    if freezes_head(plan):
        separate_head(model)  # the loop freezes the copied head by its optimizer group's lr
    return model.to(device or "cpu")


def draft_vocab_from_shards(cfg, uri: str, vocab_size: Optional[int] = None,
                            held_ids: Optional[List[str]] = None):
    """(draft ids, report) for `drafter.draft_vocab_size`, or (None, {}) when unset: the
    target's supervised next tokens of the training rows of collection `uri` (records
    in `held_ids` left out, as the trainer leaves them out), the special tokens and
    `drafter.draft_vocab_prior` (`dlite.data.draft_vocab`). Deterministic: every rank and every stage
    (teacher, DSpark, student without teacher) gets the same ids. The report has the
    train coverage and, when `held_ids` are given, the held-out coverage. `vocab_size`
    defaults to the target's (read from its config only when a draft vocabulary is set)."""
    n = cfg.drafter.draft_vocab_size
    if n is None:
        return None, {}
    vocab_size = vocab_size or target_vocab_size(cfg.target)
    import pyarrow.parquet as pq
    m, store, held = shards.read_manifest(uri), shards.Store(uri), set(held_ids or ())
    rows = {True: [], False: []}  # held out? -> rows (input_ids + loss_mask: cheap to read)
    for f in m["files"]:
        t = pq.read_table(store.path(f["path"]), columns=["id", "input_ids", "loss_mask"],
                          filesystem=store.fs)
        for r in t.to_pylist():
            rows[r["id"] in held].append(r)
    counts = dv.supervised_counts(rows[False], vocab_size)
    prior = dv.prior_order(cfg.drafter.draft_vocab_prior, tgt.load_tokenizer(cfg.target), vocab_size)
    ids = dv.build_draft_vocab(counts, n, special_ids(cfg.target), prior)
    report = {"draft_vocab_size": n,  # numbers only: the stage logs them as MLflow metrics
              "distinct_train_tokens": int((counts > 0).sum()),
              "train_coverage": dv.coverage(ids, dv.supervised_tokens(rows[False]))}
    if rows[True]:
        report["heldout_coverage"] = dv.coverage(ids, dv.supervised_tokens(rows[True]))
    return ids, report


def target_vocab_size(target_cfg) -> int:
    from transformers import AutoConfig
    return int(AutoConfig.from_pretrained(tgt.target_dir(target_cfg)).vocab_size)


def special_ids(target_cfg) -> List[int]:
    """Ids a drafter must always be able to propose: the tokenizer's special tokens and
    every EOS id of the target's generation config (`dlite.target.eos_ids`)."""
    from transformers import GenerationConfig
    tok = tgt.load_tokenizer(target_cfg)
    try:
        gen = GenerationConfig.from_pretrained(tgt.target_dir(target_cfg))
    except OSError:  # no generation_config.json: the tokenizer's EOS alone
        gen = None
    eos = tgt.eos_ids(SimpleNamespace(generation_config=gen), tok)
    return sorted(set(int(i) for i in tok.all_special_ids) | set(eos))


# ---------------------------------------------------------------- validation data

SAMPLE_SUFFIX = re.compile(r"#s\d+$")  # regeneration's extra answers: `<id>#s<k>`


def record_group(record_id: str, pattern: Optional[str] = None) -> str:
    """What a record is held out with: every answer regenerated for one conversation
    (`<id>#s<k>`) always; with `pattern` (`data.val_group`), every record whose id gives
    the same first capture group -- e.g. `^(.+)-[0-9]+$` puts SWE-bench's
    `<owner>__<repo>-<number>` instances of one repository together. An id that does not
    match is a group of its own."""
    base = SAMPLE_SUFFIX.sub("", record_id)
    m = re.match(pattern, base) if pattern else None
    return m.group(1) if m else base


def heldout_ids(ids: List[str], n: int, pattern: Optional[str] = None) -> List[str]:
    """About n record ids, whole groups (`record_group`) chosen by hash (stable whatever
    the shard order); every part of a split record goes the same way, so no held-out
    text leaks into training. Groups are taken in hash order while they fit in 2n
    records, until n are held (at least one group: the smallest when none fits);
    refused when that would hold every record."""
    groups: dict = {}
    for i in sorted(set(ids)):
        groups.setdefault(record_group(i, pattern), []).append(i)
    order = sorted(groups, key=lambda g: hashlib.sha256(g.encode()).hexdigest())
    held: List[str] = []
    for g in order:
        if len(held) >= n:
            break
        if len(held) + len(groups[g]) <= max(2 * n, 1):
            held += groups[g]
    if not held and groups:
        held = list(min(groups.values(), key=len))
    if groups and len(held) == len(set(ids)):
        raise ValueError(f"data.val_group {pattern!r}: one group holds every record "
                         f"({len(held)}); validation would leave nothing to train on")
    return sorted(held)


def heldout_rows(uri: str, ids: Optional[List[str]] = None, limit: int = 64) -> List[dict]:
    """Decoded rows of a finished collection (only those of `ids` when given), at most
    `limit`. Read straight from Parquet with the id filter pushed down: validation rows
    are few, and every rank needs all of them."""
    import pyarrow.parquet as pq
    m, store, rows = shards.read_manifest(uri), shards.Store(uri), []
    for f in m["files"]:
        flt = [("id", "in", list(ids))] if ids is not None else None
        table = pq.read_table(store.path(f["path"]), filesystem=store.fs, filters=flt)
        rows += [training_row(r, m) for r in table.slice(0, limit - len(rows)).to_pylist()]
        if len(rows) >= limit:
            break
    return rows


def val_batches(rows: List[dict], batch_size: int, device=None) -> List[dict]:
    """Fixed batches with the stored anchors, so every evaluation scores the same blocks."""
    if not rows:
        raise ValueError("no held-out rows to validate on")
    return [to_device(collate(rows[i:i + batch_size]), device) for i in range(0, len(rows), batch_size)]


# ---------------------------------------------------------------- export

def artifact_fields(cfg, plan: StagePlan, manifest: dict, step: int, metrics: dict) -> dict:
    """Lineage written into the drafter's config.json."""
    return {"target_name": cfg.target.name, "target_fingerprint": manifest["target_fingerprint"]["id"],
            "target_dtype": manifest.get("target_dtype", "float32"),
            "data_plan_id": manifest.get("plan_id"), "stage": plan.stage, "step": step,
            "skip_teacher": plan.stage == "align" and not plan.from_teacher,
            "val_tau": metrics.get("val_tau"), "val_loss": metrics.get("val_loss")}


def card_sections(plan: StagePlan, step: int, metrics: dict) -> dict:
    rows = [f"| {k} | {v:.4f} |" for k, v in sorted(metrics.items())
            if k.startswith("val_") and isinstance(v, float)]
    body = (f"Stage `{plan.stage}`, best checkpoint by teacher-forced `val_tau` (step {step} of "
            f"{plan.steps}; {plan.distill_steps} distillation steps, {plan.blend_steps} blending, "
            f"recipe {plan.recipe}).\n\n| metric | value |\n|---|---|\n"
            + "\n".join(rows))
    return {"Training": body}


def read_json(path) -> Optional[dict]:
    p = Path(path)
    return json.loads(p.read_text()) if p.is_file() else None
