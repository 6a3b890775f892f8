"""The quality benchmark's ablation switches: names checked before any work, each
ablation's config = the benchmark's plus exactly its overrides (DLite stages only)."""

import pytest

from dlite.config import load_config
from pipelines.benchmarks import ablations
from pipelines.benchmarks.quality import bench_config


def test_parse_names():
    assert ablations.parse("all") == list(ablations.ABLATIONS)
    assert ablations.parse("head_none, window_4096") == ["head_none", "window_4096"]
    with pytest.raises(ValueError, match="nope"):
        ablations.parse("head_none,nope")


@pytest.mark.parametrize("name", [n for n in ablations.ABLATIONS if not n.startswith("published")
                                  and "recipe" not in ablations.ABLATIONS[n][0]])
def test_ablation_config_changes_only_its_switch(name):  # the published design / recipe: own tests
    # The vocabulary sweep varies a configured draft vocabulary (the tiny target's is full).
    over = [] if not name.startswith("vocab_") else ["drafter.draft_vocab_size=256"]
    cfg = load_config("configs/experiments/tiny.yaml", [*over, "eval.baselines=[prompt_lookup]"])
    acfg = ablations.ablation_config(cfg, name, 1536)
    base = bench_config(cfg, 1536)
    over = dict(ablations.ABLATIONS[name][0])
    assert ablations.ABLATIONS[name][0] == dict(over)  # the table itself is never changed
    if "draft_vocab" in over:
        factor = over.pop("draft_vocab")
        over["drafter.draft_vocab_size"] = None if factor is None else int(256 * factor)
    assert list(acfg.run.stages) == ["collect", "teacher", "align", "evaluate"]
    assert list(acfg.eval.temperatures) == [0.0] and acfg.eval.speed_trajectories == 1
    if "eval.context_vocab" not in over:
        assert (list(acfg.eval.baselines), list(acfg.eval.hybrids), acfg.eval.context_vocab) == ([], [], False)
    assert acfg.data.max_seq_len == over.get("window", 1536)
    from omegaconf import OmegaConf
    for key, value in over.items():
        if key == "eval.context_vocab":
            assert acfg.eval.context_vocab is value and list(acfg.eval.baselines) == []
        elif key != "window":
            assert OmegaConf.select(acfg, key) == value and OmegaConf.select(base, key) != value
    # Everything the benchmark fixes stays: held-out lengths, budget, split policy.
    for key in ("eval.min_chars", "eval.max_chars", "eval.turn_pick", "train.steps_teacher",
                "train.steps_align", "data.length_policy", "drafter.gamma"):
        assert OmegaConf.select(acfg, key) == OmegaConf.select(base, key), key


def test_held_out_turns_follow_the_target():
    """Tiny target: long built-in trajectories, turns spread to the last. SmolLM2 (8K
    positions, eval.max_context set): turns picked by context from 0 to that limit, so
    the <1K bucket gets turns too; the experiment's trajectory lengths stay."""
    tiny = bench_config(load_config("configs/experiments/tiny.yaml"), 1536, budget=200)
    assert (tiny.eval.turn_pick, tiny.eval.max_context, tiny.eval.min_chars) == ("spread", None, 40000)
    cfg = load_config("configs/experiments/smollm2.yaml")
    smol = bench_config(cfg, 1536, budget=200)
    assert (smol.eval.turn_pick, smol.eval.min_context) == ("context", 0)
    assert smol.eval.max_context == cfg.eval.max_context and smol.eval.max_chars == cfg.eval.max_chars
    assert (smol.train.steps_teacher, smol.train.steps_align, smol.train.steps_dspark) == (100, 100, 200)


def test_vocabulary_sweep_needs_a_configured_draft_vocabulary():
    with pytest.raises(ValueError, match="vocab_half.*draft_vocab_size"):
        ablations.ablation_config(load_config("configs/experiments/tiny.yaml"), "vocab_half", 1536)
    tiny = load_config("configs/experiments/tiny.yaml")
    assert not any(n.startswith("vocab_") for n in ablations.parse("all", tiny))
    with pytest.raises(ValueError, match="vocab_full"):
        ablations.parse("head_none,vocab_full", tiny)  # before any work
    smol = load_config("configs/experiments/smollm2.yaml")
    assert {"vocab_half", "vocab_double", "vocab_full"} <= set(ablations.parse("all", smol))
    # SmolLM2 already drafts over the code-text prior: that ablation would retrain itself.
    assert "vocab_prior_code" not in ablations.parse("all", smol)
    with pytest.raises(ValueError, match="vocab_prior_code.*already sets"):
        ablations.parse("vocab_prior_code", smol)
    low = load_config("configs/experiments/smollm2.yaml", ["drafter.draft_vocab_prior=low_ids"])
    assert "vocab_prior_code" in ablations.parse("all", low)
    with pytest.raises(ValueError, match="vocab_prior_code"):
        ablations.ablation_config(tiny, "vocab_prior_code", 1536)
    assert ablations.ablation_config(smol, "vocab_double", 1536).drafter.draft_vocab_size == 16384
    assert ablations.ablation_config(smol, "vocab_full", 1536).drafter.draft_vocab_size is None


def test_supervise_all_applies_only_where_it_changes_something():
    tiny = load_config("configs/experiments/tiny.yaml")
    assert "supervise_all" in ablations.parse("all", tiny)
    assert ablations.ablation_config(tiny, "supervise_all", 1536).train.supervise == "all"
    for over, why in ((["train.supervise=all"], "already sets train.supervise=all"),
                      (["data.storage_mode=anchors"], "needs data.storage_mode=full")):
        cfg = load_config("configs/experiments/tiny.yaml", over)
        assert "supervise_all" not in ablations.parse("all", cfg)
        with pytest.raises(ValueError, match=f"supervise_all: .*{why}"):
            ablations.parse("supervise_all", cfg)


def test_published_design_ablations_at_the_targets_shape():
    """The published DLite design (issue 29) as quality-benchmark rows: the authors'
    layer selection of this target, its width, the full vocabulary, from scratch at the
    benchmark's total step budget, no teacher stage; each variant changes one thing."""
    smol = load_config("configs/experiments/smollm2.yaml")
    base = ablations.ablation_config(smol, "published_v1", 1536)
    d, t = base.drafter, base.train
    assert (d.arch, list(d.target_layer_ids), d.hidden_size, d.num_layers, d.anchor_group_size) == \
        ("dlite_v1", [0, 1, 8, 15, 21, 28, 29], 576, 5, 2)
    assert d.draft_vocab_size is None and t.skip_teacher and list(base.run.stages) == ["collect", "align", "evaluate"]
    assert t.steps_align == smol.train.steps_teacher + smol.train.steps_align
    one = ablations.ablation_config(smol, "published_v1_1layer", 1536).drafter
    g1 = ablations.ablation_config(smol, "published_v1_g1", 1536).drafter
    assert (one.num_layers, one.anchor_group_size, g1.num_layers, g1.anchor_group_size) == (1, 2, 5, 1)


def test_published_recipe_ablations():
    """The published recipe (issue 29) as rows: on our design (its teacher windowed to 512,
    the student from scratch but the copied, frozen head, KL, blend, CE + TV) and on the
    published design with its own teacher; the benchmark's teacher + align split kept."""
    smol = load_config("configs/experiments/smollm2.yaml")
    ours = ablations.ablation_config(smol, "recipe_published_on_ours", 1536)
    t = ours.train
    assert (t.recipe, t.distill_frac, t.blend_frac, t.ce_weight, t.tv_weight, t.loss_decay, t.ce_labels) == \
        ("published", 0.25, 0.25, 1.0, 1.0, None, "target_argmax")
    assert ours.drafter.history_window == 512 and ours.drafter.arch == "dlite"
    assert list(ours.run.stages) == ["collect", "teacher", "align", "evaluate"]
    assert (t.steps_teacher, t.steps_align) == (smol.train.steps_teacher, smol.train.steps_align)
    theirs = ablations.ablation_config(smol, "published_recipe", 1536)
    assert theirs.drafter.arch == "dlite_v1" and theirs.drafter.num_layers == 5
    assert not theirs.train.skip_teacher and theirs.train.recipe == "published"
    assert theirs.train.steps_align == smol.train.steps_align  # not the from-scratch total
    assert list(theirs.run.stages) == ["collect", "teacher", "align", "evaluate"]
    assert "recipe" not in ablations.ABLATIONS["published_recipe"][0]["published"] or \
        ablations.ABLATIONS["published_recipe"][0]["published"]["recipe"] is True  # the table unchanged
    from dlite.train import plan as st
    assert st.plan_stage(theirs, "teacher").arch == "dlite_v1_teacher"
    assert st.plan_stage(theirs, "align").blend_steps == round(0.25 * smol.train.steps_align)


def test_teacher_window_row_not_where_the_config_has_it():
    cfg = load_config("configs/experiments/tiny.yaml", ["drafter.history_window=512"])
    assert not ablations.applies(cfg, "teacher_window_512")
    assert "teacher_window_512" not in ablations.parse("all", cfg)


def test_published_parts_on_our_design():
    """`context_slots` / `head_rank`: our design with one published part each; the
    own-vocabulary head drops the draft vocabulary it cannot use."""
    smol = load_config("configs/experiments/smollm2.yaml")
    assert smol.drafter.draft_vocab_size is not None
    slots = ablations.ablation_config(smol, "context_slots", 1536)
    assert (slots.drafter.context_injection, slots.drafter.draft_vocab_size) == ("slots", smol.drafter.draft_vocab_size)
    head = ablations.ablation_config(smol, "head_rank", 1536)
    assert (head.drafter.head, head.drafter.sequential_rank, head.drafter.draft_vocab_size) == ("rank", 256, None)
    assert head.drafter.context_injection == "kv" and list(head.run.stages)[1] == "teacher"
