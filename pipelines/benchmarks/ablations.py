"""Why DLite wins or loses in the quality benchmark: the model's and the
training's switches, one at a time, each trained with the benchmark's data, window
and step budget (teacher + align) and replayed greedily on the same held-out turns.

Each ablation is its own small DAG (collect -> teacher -> align -> evaluate) over the
benchmark's config plus its overrides, so finished stages are shared by hash: an
ablation that only changes alignment reuses the benchmark's teacher, one that keeps
the data reuses its collection. Its MLflow run is nested under the benchmark's run.

What to keep is read from `best_val_tau` (teacher-forced acceptance on the training
run's validation rows), never from the held-out replay the table reports.
"""

import json
from pathlib import Path
from typing import Dict, List

from omegaconf import OmegaConf

# name -> (overrides, the question it answers). `window` is the benchmark's training
# window (data.max_seq_len), set by quality_bench.bench_config.
ABLATIONS: Dict[str, tuple] = {  # in the order `all` runs them: the likeliest causes first
    "window_4096": ({"window": 4096}, "training window 4096 tokens instead of 1536"),
    "inject_add": ({"drafter.context_injection": "add"},
                   "context feature added to every slot's embedding instead of one extra key/value"),
    "head_none": ({"drafter.head": "none"}, "no sequential head: the parallel backbone alone"),
    "distill_none": ({"train.distill_frac": 0.0}, "alignment to the target only, no teacher distillation"),
    "head_attn": ({"drafter.head": "attn"}, "one causal attention layer as the sequential head instead of a GRU"),
    "anchors_x4": ({"data.anchors_per_seq": 64}, "4x more anchors sampled per training row"),
    "distill_all": ({"train.distill_frac": 1.0}, "alignment by teacher distillation only"),
    "supervise_all": ({"train.supervise": "all"},
                      "every position supervised (tool output, user text, files) instead of the "
                      "target's own replies only"),
    # The draft-vocabulary sweep (issue 20): N relative to the config's, teacher and
    # student alike (a student takes its teacher's ids), same budget; the rows add the
    # held-out coverage of the target's greedy tokens and the draft time per bucket.
    "vocab_half": ({"draft_vocab": 0.5}, "draft vocabulary of half the configured N"),
    "vocab_double": ({"draft_vocab": 2}, "draft vocabulary of twice the configured N"),
    "vocab_full": ({"draft_vocab": None}, "the target's full vocabulary instead of a draft vocabulary"),
    # ... and what fills it after the training data's tokens: code-text frequencies
    # instead of the lowest ids; replayed over a per-request vocabulary too.
    "vocab_prior_code": ({"drafter.draft_vocab_prior": "python_stdlib", "eval.context_vocab": True},
                         "draft vocabulary filled by token frequency over Python standard-library "
                         "source instead of the lowest ids (+ the per-request vocabulary)"),
    # The authors' published design (issue 29, `dlite.models.dlite_v1`) at this target's
    # shape: one context slot per layer of the published selection of 7, G=2 query, 5
    # layers at the target's width, its own rank-256 head over the full vocabulary; from
    # scratch with the teacher's steps added (the published teacher recipe is not built).
    # The variants isolate one difference each.
    "published_v1": ({"published": {}}, "the published DLite design (7 context slots, G=2, 5 layers at "
                                         "the target's width, own rank-256 head), from scratch"),
    "published_v1_1layer": ({"published": {"drafter.num_layers": 1}},
                            "the published design with 1 backbone layer instead of 5"),
    "published_v1_g1": ({"published": {"drafter.anchor_group_size": 1}},
                        "the published design with G=1 (anchor + MASKs) instead of G=2"),
    # The published training recipe (`train.recipe: published`, RECIPE below) and its
    # sliding-window teacher, on their design and on ours; the teacher + align budget
    # of the benchmark, the teacher's steps kept as a stage.
    "published_recipe": ({"published": {"train.skip_teacher": False, "recipe": True}},
                         "the published design trained with the published recipe (its own 512-window "
                         "teacher; head copied and frozen, KL, cosine blend, CE + TV)"),
    "recipe_published_on_ours": ({"recipe": True},
                                 "our design trained with the published recipe instead of teacher "
                                 "initialisation"),
    "teacher_window_512": ({"drafter.history_window": 512},
                           "the teacher sees the last 512 history positions instead of all of them"),
    # Two published parts on our design, one at a time (issue 29's isolated rows): the
    # context as one key per target layer, and the published head with its own vocabulary
    # matrices (rank drafter.sequential_rank, 256 as published; the full vocabulary, which
    # it needs: `vocab_full` is the same vocabulary through the target's lm_head,
    # separating the head from the vocabulary).
    "context_slots": ({"drafter.context_injection": "slots"},
                      "one context key per target layer (published) instead of the K layers fused "
                      "into one"),
    "head_rank": ({"drafter.head": "rank"},
                  "the published rank-256 recurrent head with its own V x r / r -> V matrices over the "
                  "full vocabulary instead of a GRU through the target's lm_head and the draft vocabulary"),
}
# The published recipe at this project's budget (FlashMTP `run_training_dlite_two_stage.sh`
# defaults: KL weight 1, stage-2 CE 1 + TV 1 on the target's greedy token, no slot decay;
# their 1-epoch stage 1 / 1-epoch blend become a quarter of the align steps each here).
RECIPE = {"train.recipe": "published", "train.distill_frac": 0.25, "train.blend_frac": 0.25,
          "train.kl_weight": 1.0, "train.ce_weight": 1.0, "train.tv_weight": 1.0,
          "train.loss_decay": None, "train.ce_labels": "target_argmax", "drafter.history_window": 512,
          # the authors' teacher loss (FlashMTP run_training_dlite_teacher.sh): CE 0.1 on the
          # target's greedy token + TV 1.0, slot weights decaying at 4
          "train.teacher_ce_weight": 0.1, "train.teacher_tv_weight": 1.0, "train.teacher_loss_decay": 4.0,
          "train.teacher_ce_labels": "target_argmax"}
STAGES = ["collect", "teacher", "align", "evaluate"]
PUBLISHED_STAGES = ["collect", "align", "evaluate"]  # trained from scratch: no teacher stage


def parse(names: str, cfg=None) -> List[str]:
    """`all` or a comma list of ABLATIONS keys; unknown names fail before any work. With
    the benchmark's `cfg`: `all` keeps the ablations that apply to it (`why_not`) and
    every one kept is configured once here, so one that cannot apply, or whose config
    would not validate, fails before any work."""
    if names.strip() == "all":
        out = [n for n in ABLATIONS if cfg is None or applies(cfg, n)]
    else:
        out = [n.strip() for n in names.split(",") if n.strip()]
    bad = [n for n in out if n not in ABLATIONS]
    if bad:
        raise ValueError(f"--ablations: unknown {bad}; choose from {list(ABLATIONS)} or 'all'")
    for name in out if cfg is not None else ():
        ablation_config(cfg, name, cfg.data.max_seq_len)
    return out


# The ablations that vary a configured draft vocabulary (its N or its prior).
VOCAB_SWEEP = ("vocab_half", "vocab_double", "vocab_full", "vocab_prior_code")
# The override that makes an ablation what it is: a config already set that way would
# only retrain the benchmark's own drafter.
DECIDING_KEY = {"vocab_prior_code": "drafter.draft_vocab_prior", "supervise_all": "train.supervise",
                "teacher_window_512": "drafter.history_window", "context_slots": "drafter.context_injection",
                "head_rank": "drafter.head"}


def why_not(cfg, name: str):
    """Why ablation `name` cannot apply to `cfg` (None when it can): the vocabulary sweep
    needs a configured draft vocabulary, an ablation whose deciding setting the config
    already has changes nothing, and supervising every position needs full storage."""
    if name in VOCAB_SWEEP and cfg.drafter.draft_vocab_size is None:
        return ("varies the draft vocabulary, but this config leaves drafter.draft_vocab_size "
                "null (the full vocabulary)")
    key = DECIDING_KEY.get(name)
    if key is not None and OmegaConf.select(cfg, key) == ABLATIONS[name][0][key]:
        return f"this config already sets {key}={ABLATIONS[name][0][key]}"
    if name == "supervise_all" and cfg.data.storage_mode != "full":
        return f"needs data.storage_mode=full (this config stores {cfg.data.storage_mode!r})"
    return None


def applies(cfg, name: str) -> bool:
    return why_not(cfg, name) is None


def ablation_config(cfg, name: str, window: int):
    """The benchmark's config for one ablation, validated: its overrides, DLite's stages
    only, the DLite drafter alone (no eval.baselines / hybrids / context_vocab), greedy
    replay and one speed trajectory (acceptance is what is compared); its training
    window is `data.max_seq_len`."""
    from dlite.config import validate
    from pipelines.benchmarks.settings import bench_config
    why = why_not(cfg, name)
    if why:
        raise ValueError(f"--ablations {name}: {why}")
    over = dict(ABLATIONS[name][0])
    window = over.pop("window", window)
    if "draft_vocab" in over:  # the swept N: a factor of the configured N (None: full)
        factor = over.pop("draft_vocab")
        over["drafter.draft_vocab_size"] = None if factor is None else int(cfg.drafter.draft_vocab_size * factor)
    if over.get("drafter.head") == "rank":  # its own r -> V projection: the full vocabulary
        over["drafter.draft_vocab_size"] = None
    if "published" in over:
        over.update(_published(cfg, over.pop("published")))
    if over.pop("recipe", False):
        over.update(RECIPE)
    dotted = [f"{k}={'null' if v is None else v}" for k, v in over.items()]
    base = OmegaConf.merge(cfg, OmegaConf.from_dotlist(dotted))
    out = bench_config(base, window)
    alone = {k: v for k, v in {"baselines": [], "hybrids": [], "context_vocab": False}.items()
             if f"eval.{k}" not in over}  # the DLite variant alone, unless the ablation says
    stages = PUBLISHED_STAGES if out.train.skip_teacher else STAGES  # from scratch: no teacher
    out = OmegaConf.merge(out, {"run": {"stages": stages, "name": f"{out.run.name}-{name}"},
                                "eval": {"temperatures": [0.0], "speed_trajectories": 1, **alone}})
    validate(out)
    return out


def _published(cfg, extra: dict) -> dict:
    """Overrides that make `cfg`'s drafter the published design at this target's shape
    and the same optimiser-step budget (teacher + align steps, all in align)."""
    from dlite.config import target_shape
    from dlite.models.dlite_v1 import published_layer_ids
    layers, width = target_shape(cfg)
    if layers is None or width is None:
        raise ValueError("--ablations published_*: the target's num_layers / hidden_size are unknown "
                         "(set target.num_layers and target.hidden_size)")
    t, extra = cfg.train, dict(extra)
    if not extra.get("train.skip_teacher", True):  # with its teacher: the benchmark's split of steps
        extra = {"train.steps_align": t.steps_align, **extra}
    return {"drafter.arch": "dlite_v1", "drafter.target_layer_ids": published_layer_ids(layers, min(7, layers)),
            "drafter.hidden_size": width, "drafter.num_layers": 5, "drafter.anchor_group_size": 2,
            "drafter.sequential_rank": 256, "drafter.draft_vocab_size": None,
            "train.skip_teacher": True, "train.steps_align": t.steps_teacher + t.steps_align, **extra}


def run_one(cfg, name: str, window: int, parent: str, log=print) -> dict:
    """Train and replay one ablation; its row of the benchmark's `ablations` table.
    Its MLflow run ends FINISHED, or FAILED when the ablation raises (`tracking.closing`,
    as every pipeline run's stages do), never left RUNNING."""
    from pipelines.common import tracking
    from pipelines.orchestration.dag import Context, execute, open_home, plan
    from pipelines.orchestration.runners import RUNNERS
    acfg = ablation_config(cfg, name, window)
    _, run_id = open_home(acfg, {"dlite.kind": "benchmark", "dlite.benchmark": "quality-ablation",
                                 "dlite.ablation": name, "mlflow.parentRunId": parent})
    log(f"[ablation] {name}: {ABLATIONS[name][1]}")
    with tracking.closing(acfg.tracking.uri, run_id):
        stages = plan(acfg)
        done = execute(Context(acfg, run_id, log), stages, RUNNERS)
        return _row(acfg, name, stages, done, run_id)


def _row(acfg, name: str, stages: list, done: dict, run_id: str) -> dict:
    methods = json.loads(Path(done["evaluate"]["report"]).read_text())["methods"]
    dl, ctx = methods["dlite"], methods.get("dlite_ctxvocab")
    return {"overrides": ABLATIONS[name][0], "why": ABLATIONS[name][1], "training_window": acfg.data.max_seq_len,
            "best_val_tau": {s: done.get(s, {}).get("best_val_tau") for s in ("teacher", "align")},
            "tau": dl["tau"], "tau_by_bucket": dl["tau_by_bucket"], "bucket_labels": dl["bucket_labels"],
            "accept_at_k": dl["accept_at_k"],
            "draft_ms_by_bucket": dl["draft_ms_by_bucket"], "lossless": dl["lossless"],
            "draft_vocab_size": acfg.drafter.draft_vocab_size,
            "draft_vocab_coverage": dl.get("draft_vocab_coverage"),
            "speedup_vs_ar": dl.get("speedup_vs_ar"), "speedup_vs_ar_by_bucket": dl.get("speedup_vs_ar_by_bucket"),
            "draft_vocab_prior": acfg.drafter.draft_vocab_prior,
            "ctxvocab": None if ctx is None else {k: ctx.get(k) for k in (
                "tau", "tau_by_bucket", "draft_vocab_coverage", "speedup_vs_ar", "draft_ms_by_bucket", "lossless")},
            "stage_dirs": {s.name: s.dir for s in stages},
            # Reused stages were finished by the benchmark or an earlier ablation: their
            # seconds are from that run, not this one.
            "seconds": {s: done[s].get("seconds") for s in done},
            "reused": [s.name for s in stages if s.status in ("done", "reuse")], "mlflow_run": run_id}


def table(bench: dict, rows: Dict[str, dict]) -> dict:
    """The rows against the benchmark's own DLite and DSpark (greedy), and which
    setting the validation split would pick (held-out tau is reported, not used)."""
    from pipelines.benchmarks.settings import ratio
    m = bench["methods"]
    ref = {"dlite": m["dlite"], "dspark": m["dspark"]}
    out = {}
    for name, r in rows.items():
        by = r["tau_by_bucket"]
        out[name] = {**r,
                     "tau_over_dlite": ratio(r["tau"], ref["dlite"]["tau"]),
                     "tau_over_dspark_by_bucket": {b: ratio(v, ref["dspark"]["tau_by_bucket"].get(b))
                                                   for b, v in by.items()}}
    val = {"dlite (benchmark)": bench["best_val_tau"]["align"],
           **{n: r["best_val_tau"]["align"] for n, r in rows.items()}}
    best = max((k for k, v in val.items() if v is not None), key=lambda k: val[k], default=None)
    return {"rows": out, "val_tau_align": val, "chosen_by_validation": best}

