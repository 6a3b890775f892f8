"""The single-process training path: rows from the real tiny target, the plain engine
and the shared loop. Training lowers the loss and raises teacher-forced acceptance, a
teacher can stand in as the reference (distillation), and the TRAINED drafter still
decodes losslessly (greedy output identical to plain decoding)."""

import pytest
import torch
from omegaconf import OmegaConf

from dlite import target as tgt
from dlite.config import load_config
from dlite.models import build_drafter
from dlite.decoding.decode import plain_generate, speculative_generate
from dlite.losses import block_targets, dlite_loss
from dlite.corpus import trajectories as corpus
from dlite.train.data import collate, epoch_batches, inprocess_rows
from dlite.train.loop import LoopConfig, train_loop
from dlite.train.optim import PlainEngine, lr_at
from dlite.train.step import LossSpec, compute_loss


@pytest.fixture(scope="module")
def setup():
    torch.manual_seed(0)
    cfg = load_config("configs/experiments/tiny.yaml")
    model, tok = tgt.load(cfg.target)
    recs = list(corpus.generate("train", 6, 0, 3000, 6000))
    rows = inprocess_rows(model, tok, recs, list(cfg.drafter.target_layer_ids), 512, "truncate", 16, 0)
    return cfg, model, tok, rows


def _drafter(cfg, model, tok, arch="dlite"):
    dcfg = OmegaConf.to_object(cfg.drafter)
    dcfg.arch = arch
    return build_drafter(dcfg, *tgt.shared_vocab(model, tok))


def test_lr_schedule_warms_up_then_decays():
    lrs = [lr_at(s, 100, 1e-3, 0.1) for s in range(100)]
    assert lrs[0] < lrs[9] == pytest.approx(1e-3) and lrs[-1] < 0.2e-3


def test_collate_pads_and_masks(setup):
    _, _, _, rows = setup
    b = collate(rows[:3])
    assert b["features"].shape[:2] == b["input_ids"].shape and b["features"].dtype == torch.float32
    assert b["anchor_mask"].sum() == sum(len(r["anchors"]) for r in rows[:3])


def test_training_learns_and_stays_lossless(setup):
    cfg, model, tok, rows = setup
    drafter = _drafter(cfg, model, tok)
    batches = epoch_batches(rows, 2, 16, seed=0)
    fixed = collate(rows[:2])
    with torch.no_grad():
        before = compute_loss(drafter, fixed)[1]
    engine = PlainEngine(drafter, lr=3e-3, weight_decay=0.0, grad_clip=1.0)
    train_loop(engine, batches, LoopConfig(steps=40, lr=3e-3, warmup_frac=0.05))
    with torch.no_grad():
        after = compute_loss(drafter, fixed)[1]
    assert after["loss"] < 0.8 * before["loss"]
    assert after["tau_est"] > before["tau_est"]
    prompt = rows[0]["input_ids"][:300]
    plain, _ = plain_generate(model, prompt, 40)
    spec, rounds = speculative_generate(model, drafter.eval(), prompt, 40)
    assert spec == plain and rounds


def test_teacher_reference_distils(setup):
    """With a teacher the reference is the teacher's softmax on the same batch: the loss
    is the hand-built loss against that distribution, only the student gets gradients,
    and a student distilled from itself has nothing left to learn (L1 0, tau_est γ+1)."""
    cfg, model, tok, rows = setup
    teacher, student = _drafter(cfg, model, tok, "teacher"), _drafter(cfg, model, tok)
    batch = collate(rows[:2])
    loss, m = compute_loss(student, batch, teacher=teacher)
    targets, valid = block_targets(batch["input_ids"], batch["anchors"], student.gamma,
                                   batch.get("loss_mask"), batch.get("anchor_mask"), batch.get("seq_ids"))
    with torch.no_grad():
        p_teacher = torch.softmax(teacher.forward_train(batch).float(), -1)
        want, _ = dlite_loss(student.forward_train(batch), targets, valid, p_teacher)
    assert loss.item() == pytest.approx(want.item(), rel=1e-5) and m["l1"] > 1e-2
    loss.backward()
    assert all(p.grad is None for p in teacher.parameters())
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in student.parameters())
    with torch.no_grad():
        own, m_own = compute_loss(student, batch, teacher=student, spec=LossSpec(ce_weight=0.0))
    assert own.item() < 1e-5 and m_own["tau_est"] == pytest.approx(student.gamma + 1, abs=1e-4)


# ---------------------------------------------------------------- no target needed

def _rows(n: int, length: int = 40, seed: int = 0) -> list:
    """Synthetic full-mode rows: supervised second half, 8-wide features."""
    g = torch.Generator().manual_seed(seed)
    mask = [0] * (length // 2) + [1] * (length - length // 2)
    return [{"id": f"r{i}", "part": 0, "input_ids": torch.randint(0, 50, (length,), generator=g).tolist(),
             "loss_mask": mask, "anchors": [], "features": torch.randn(length, 8, generator=g).numpy()}
            for i in range(n)]


def test_batch_stream_resumes_at_the_same_batch():
    from dlite.train.data import BatchStream
    rows = _rows(7)
    make = lambda start=None: BatchStream(lambda e: iter(rows), 2, 4, seed=3, shuffle_buffer=3,  # noqa: E731
                                          start=start)
    full = make()
    seen = [next(full) for _ in range(8)]           # 3 batches per epoch (7 rows, tail dropped)
    first = make()
    for _ in range(4):
        next(first)
    state = first.state()
    assert state == {"epoch": 1, "taken": 1}
    resumed = make(start=state)
    for want in seen[4:]:
        got = next(resumed)
        assert torch.equal(got["input_ids"], want["input_ids"]) and torch.equal(got["anchors"], want["anchors"])
    assert not torch.equal(seen[0]["anchors"], seen[3]["anchors"]) or \
        not torch.equal(seen[0]["input_ids"], seen[3]["input_ids"])  # a new epoch: new draw


def test_shuffle_buffer_is_a_seeded_permutation():
    from dlite.train.data import shuffled
    a, b = list(shuffled(range(50), 8, 1)), list(shuffled(range(50), 8, 1))
    assert a == b and sorted(a) == list(range(50)) and a != list(range(50))


def test_stage_plans():
    from dlite.train.plan import loop_config, plan_stage
    cfg = load_config("configs/experiments/tiny.yaml", ["train.steps_align=10", "train.distill_frac=0.3"])
    assert plan_stage(cfg, "teacher").arch == "teacher"
    assert plan_stage(cfg, "dspark").arch == "dspark"
    align = plan_stage(cfg, "align")
    assert (align.arch, align.steps, align.distill_steps, align.needs_teacher) == ("dlite", 10, 3, True)
    assert loop_config(cfg, align).distill_steps == 3
    ablation = plan_stage(load_config("configs/experiments/tiny.yaml",
                                      ["train.steps_align=10", "train.skip_teacher=true"]), "align")
    assert (ablation.steps, ablation.distill_steps, ablation.needs_teacher) == (10, 0, False)
    with pytest.raises(ValueError, match="stage"):
        plan_stage(cfg, "collect")


def test_heldout_ids_are_stable_and_whole_records():
    from dlite.train.plan import heldout_ids
    ids = [f"rec-{i}" for i in range(30)] * 2  # every record split in two parts
    held = heldout_ids(ids, 3)
    assert held == heldout_ids(list(reversed(ids)), 3) and len(held) == 3


def test_validation_holds_out_whole_repositories():
    """`data.val_group`: SWE-bench-style ids (<owner>__<repo>-<number>) of one repository
    go to validation together, never split between it and training; a regenerated
    conversation's extra answers (<id>#s<k>) always go with it; a pattern that makes
    one group of everything is refused, naming the key."""
    from dlite.train.plan import heldout_ids, record_group
    repos = ["a__flask", "b__tqdm", "c__click", "d__yaml", "e__idna"]
    ids = [f"{r}-{i:04d}" for r in repos for i in range(6)] + [f"{r}-0000#s1" for r in repos]
    held = heldout_ids(ids, 3, r"^(.+)-\d+$")
    groups = {record_group(i, r"^(.+)-\d+$") for i in held}
    assert len(groups) == 1 and len(held) == 7  # one repository: its 6 instances and a sample
    train = set(ids) - set(held)
    assert not groups & {record_group(i, r"^(.+)-\d+$") for i in train}
    assert held == heldout_ids(list(reversed(ids)), 3, r"^(.+)-\d+$")
    # Without a pattern: record by record, but a record's samples stay with it.
    plain = heldout_ids(ids, 3)
    assert all((i + "#s1" in plain) for i in plain if i.endswith("-0000") and i + "#s1" in ids)
    assert record_group("x-0003#s2") == "x-0003"
    with pytest.raises(ValueError, match="data.val_group"):
        heldout_ids(ids, 3, r"^.(_)")  # every id's second character: one group


def _small_drafter():
    """A 3-slot DLite drafter over a 64-token vocabulary (seeded weights)."""
    from dlite.models import DrafterConfig
    torch.manual_seed(0)
    vocab = torch.randn(64, 4)
    return build_drafter(DrafterConfig(gamma=3, target_layer_ids=[0, 1], hidden_size=16, num_layers=1,
                                       num_heads=2, num_kv_heads=1, head_dim=8, intermediate_size=32,
                                       head_hidden=16), vocab, vocab.clone(), 63)


def test_validate_pools_batches_like_one_batch():
    from dlite.train.step import validate
    model = _small_drafter()
    rows = [{**r, "ref_hidden": torch.randn(40, 4).numpy()} for r in _rows(4)]
    rows = [{**r, "features": r["features"][:, :8], "anchors": [21, 25, 30]} for r in rows]
    # Row 0's blocks run past its 40 tokens: its batch has fewer valid late slots, so a
    # pooling by valid slots overall (not per slot) would not match either.
    rows[0] = {**rows[0], "anchors": [36, 37, 38]}
    one = compute_loss(model, collate(rows))[1]
    assert one["valid_at_k"][0] > one["valid_at_k"][2]
    # Batches of 1 and 3 rows: an unweighted mean over batches would not match.
    pooled = validate(model.train(), [collate(rows[:1]), collate(rows[1:])])
    assert model.training  # restored
    accept = [pooled[f"val_accept_at_k_{k}"] for k in (1, 2, 3)]
    assert accept == pytest.approx(one["accept_est_at_k"], rel=1e-5) and "val_accept_at_k_4" not in pooled
    a1, a2, a3 = accept
    assert pooled["val_tau"] == pytest.approx(1 + a1 + a1 * a2 + a1 * a2 * a3, rel=1e-6)
    assert pooled["val_tau"] == pytest.approx(one["tau_est"], rel=1e-5)
    assert pooled["val_loss"] == pytest.approx(one["loss"], rel=1e-5)
    # The greedy replay's figure pools blocks the same way, at the stop rule given.
    for stop in (0.0, 0.2):
        whole = compute_loss(model, collate(rows), greedy_stop=stop)[1]
        want = 1 + whole["greedy_accepted"] / whole["greedy_blocks"]
        got = validate(model, [collate(rows[:1]), collate(rows[1:])], stop)["val_tau_greedy"]
        assert got == pytest.approx(want, rel=1e-6)
    assert validate(model, [collate(rows)], 0.999999)["val_tau_greedy"] == 1.0  # every block cut at once
    # The replay walked over the rows' supervised runs: one token a round when every block is
    # cut at once; otherwise the walk over every position's kept drafts (`walk_runs`).
    assert validate(model, [collate(rows)], 0.999999, rows)["val_tau_replay"] == 1.0
    from dlite.data.anchors import candidate_anchors, supervised_runs
    from dlite.train.step import walk_runs
    kept, tokens, rounds = {}, 0, 0
    for r in rows:
        a = candidate_anchors(r["loss_mask"])
        k = compute_loss(model, collate([{**r, "anchors": a}]), greedy_stop=0.0)[1]["greedy_kept"]
        t, n = walk_runs(dict(zip(a.tolist(), k.tolist())), supervised_runs(r["loss_mask"]))
        tokens, rounds = tokens + t, rounds + n
    got = validate(model, [collate(rows)], 0.0, rows)
    assert got["val_tau_replay"] == pytest.approx(tokens / rounds) and 1 <= got["val_tau_replay"] <= 4
    assert "val_tau_replay" not in validate(model, [collate(rows)], 0.0)  # no rows given


def test_ranks_share_one_validation():
    """Split over ranks (each scores every world-th batch and walk row, the totals summed)
    validation gives the single-rank figures; with fewer batches or rows than ranks, each
    rank scores them all and they count once."""
    from dlite.train.step import validate
    model = _small_drafter()
    rows = [{**r, "ref_hidden": torch.randn(40, 4).numpy(), "features": r["features"][:, :8],
             "anchors": [21, 25, 30]} for r in _rows(5, seed=1)]

    class Sent(Exception):
        pass

    def split(batches, walk, world):
        sent = []  # what each rank hands to the all-reduce, in rank order

        def hand_in(t):
            sent.append(t.clone())
            raise Sent
        for rank in range(world):
            with pytest.raises(Sent):
                validate(model, batches, 0.0, walk, (rank, world), hand_in)
        outs = [validate(model, batches, 0.0, walk, (r, world), lambda t: sum(sent)) for r in range(world)]
        assert all(o == outs[0] for o in outs)  # every rank ends with the same figures
        return outs[0], sent

    for n_batches, world in ((5, 2), (3, 3), (1, 2), (2, 4)):
        batches = [collate(rows[i::n_batches]) for i in range(n_batches)]
        want = validate(model, batches, 0.0, rows)
        got, sent = split(batches, rows, world)
        assert got.keys() == want.keys()
        for k in want:
            assert got[k] == pytest.approx(want[k], rel=1e-9), k
        if n_batches < world:  # scored by every rank, counted by rank 0 only
            assert all(float(t[:6].abs().sum()) == 0 for t in sent[1:])
    # A walk over fewer rows than ranks: rank 0 walks them all.
    got, sent = split([collate(rows[:2]), collate(rows[2:])], rows[:1], 2)
    assert got["val_tau_replay"] == pytest.approx(validate(model, [collate(rows)], 0.0, rows[:1])["val_tau_replay"])
    assert sent[1][-2:].tolist() == [0.0, 0.0]
    # No reduce: one rank scores everything, whatever `part` says.
    assert validate(model, [collate(rows)], 0.0, rows, (1, 2))["val_tau"] == pytest.approx(want["val_tau"])


def test_walk_runs_decodes_like_the_replay():
    """A round at anchor a yields kept[a] drafts + the bonus token; the next starts after
    them; a run ends at its last token (the prefill gave its first)."""
    from dlite.train.step import walk_runs
    assert walk_runs({0: 2, 3: 0, 4: 6}, [(0, 8)]) == (7, 3)  # 0 -> 3 -> 4 -> 7 (cut at the end)
    assert walk_runs({10: 1, 12: -1}, [(10, 14)]) == (3, 2)  # -1 (no valid block): the bonus only
    assert walk_runs({}, [(0, 1)]) == (0, 0)


def test_load_vocab_reads_only_what_drafters_share(setup):
    from dlite.train.plan import load_vocab
    cfg, model, tok, _ = setup
    embed, lm_head, mask = load_vocab(cfg.target)
    want = tgt.shared_vocab(model, tok)
    assert torch.equal(embed, want[0]) and torch.equal(lm_head, want[1]) and mask == want[2]


def _stored_rows(model, layer_ids, seqs, mode: str, reference: str) -> list:
    """Sequences through the target and a shard row round trip, as `mode` stores them."""
    from dlite.data.features import TargetFeatures, extract
    from dlite.data.shards import encode_row
    from dlite.train.data import training_row
    spec = {"storage_mode": mode, "reference": reference, "topk": 16, "gamma": 7}
    res, _ = extract(TargetFeatures(model, layer_ids), seqs, spec, 8192, 0)
    cfg = model.config
    manifest = {**spec, "feature_dim": cfg.hidden_size * len(layer_ids), "hidden_size": cfg.hidden_size}
    return [training_row(encode_row({**s, **r}), manifest) for s, r in zip(seqs, res)]


@pytest.mark.parametrize("reference", ["last_hidden", "topk"])
def test_anchor_shards_give_the_student_the_same_loss_as_full_ones(setup, reference):
    """`anchors` storage keeps features at a-1 and references per block only: the DLite
    student's loss and gradients on it equal those on `full` rows with the same anchors,
    the stored anchors survive every epoch's re-draw, and models that read the whole
    history refuse such a batch."""
    from dlite.train.data import resample
    cfg, model, tok, rows = setup
    seqs = [{k: r[k] for k in ("id", "part", "index", "input_ids", "loss_mask", "anchors")} for r in rows[:3]]
    layers = list(cfg.drafter.target_layer_ids)
    full, anch = (collate(_stored_rows(model, layers, seqs, m, reference)) for m in ("full", "anchors"))
    blocks = "ref_hidden_blocks" if reference == "last_hidden" else "topk_ids_blocks"
    assert anch["features"].shape == full["features"].shape and blocks in anch and blocks not in full
    drafter = _drafter(cfg, model, tok)
    got = []
    for batch in (full, anch):
        drafter.zero_grad()
        loss, m = compute_loss(drafter, batch)
        loss.backward()
        got.append((loss.item(), m["tau_est"], [p.grad.clone() for p in drafter.parameters() if p.grad is not None]))
    (loss_f, tau_f, grads_f), (loss_a, tau_a, grads_a) = got
    assert loss_f == pytest.approx(loss_a, rel=1e-5) and tau_f == pytest.approx(tau_a, rel=1e-5)
    assert len(grads_f) == len(grads_a) > 0
    assert all(torch.allclose(a, b, rtol=1e-4, atol=1e-7) for a, b in zip(grads_f, grads_a))
    row = _stored_rows(model, layers, seqs[:1], "anchors", reference)[0]
    assert resample(row, 4, 0, epoch=3)["anchors"] is row["anchors"]
    with pytest.raises(ValueError, match="anchors"):
        compute_loss(_drafter(cfg, model, tok, "dspark"), anch)


def test_only_the_student_without_teacher_takes_anchor_shards():
    from dlite.train.plan import plan_stage
    from pipelines.stages.train_inputs import require_full
    cfg = load_config("configs/experiments/tiny.yaml")
    assert "teacher" in require_full(plan_stage(cfg, "align"))
    assert "every position" in require_full(plan_stage(cfg, "teacher"))
    assert "dspark" in require_full(plan_stage(cfg, "dspark"))
    skip = load_config("configs/experiments/tiny.yaml", ["train.skip_teacher=true"])
    assert require_full(plan_stage(skip, "align")) is None


def test_supervise_all_trains_on_every_position(setup):
    """`train.supervise=all`: a full-storage row's every position becomes a target and
    an anchor candidate (tool output and user text included, not only the assistant's
    tokens), so the loss covers more slots; anchors storage refuses it; the config names
    the key before any work, and the stage hash moves only when it is set."""
    import dataclasses
    from dlite.config import ConfigError
    from dlite.data.anchors import candidate_anchors
    from dlite.data.shards import encode_row
    from dlite.train.data import resample, training_row
    from pipelines.orchestration import dag
    cfg, model, tok, rows = setup
    seqs = [{k: r[k] for k in ("id", "part", "index", "input_ids", "loss_mask", "anchors")} for r in rows[:2]]
    stored = _stored_rows(model, list(cfg.drafter.target_layer_ids), seqs, "full", "last_hidden")
    manifest = {"storage_mode": "full", "reference": "last_hidden", "topk": 16, "gamma": 7,
                "feature_dim": model.config.hidden_size * 2, "hidden_size": model.config.hidden_size}
    raw = encode_row({**seqs[0], **{k: stored[0][k] for k in ("features", "ref_hidden")}})
    asst, every = training_row(raw, manifest), training_row(raw, manifest, "all")
    assert 0 < asst["loss_mask"].sum() < len(asst["input_ids"]) == every["loss_mask"].sum()
    assert len(candidate_anchors(every["loss_mask"])) > len(candidate_anchors(asst["loss_mask"]))
    drawn = resample(every, 64, 0, epoch=0)["anchors"]
    assert any(not asst["loss_mask"][a] for a in drawn)  # anchors outside the replies now
    _, m_a = compute_loss(_drafter(cfg, model, tok), collate([resample(asst, 64, 0, 0)]))
    _, m_e = compute_loss(_drafter(cfg, model, tok), collate([resample(every, 64, 0, 0)]))
    assert m_e["valid_slots"] > m_a["valid_slots"]
    with pytest.raises(ValueError, match="full storage"):
        training_row(raw, {**manifest, "storage_mode": "anchors"}, "all")
    for bad, key in ((["train.supervise=tools"], "train.supervise"),
                     (["train.supervise=all", "data.storage_mode=anchors"], "train.supervise")):
        with pytest.raises(ConfigError, match=key):
            load_config("configs/experiments/tiny.yaml", bad)
    d = dag.BY_NAME["teacher"]
    before = dataclasses.replace(d, keys=tuple(k for k in d.keys if k != "train.supervise"))
    old = dag._stage_hash(cfg, before, {}, "t")  # the stage as hashed before the key existed
    assert dag._stage_hash(cfg, d, {}, "t") == old
    assert dag._stage_hash(OmegaConf.merge(cfg, {"train": {"supervise": "all"}}), d, {}, "t") != old


# ---------------------------------------------------------------- optimizer layout and resume

def _align_student(setup, recipe: str, stage: str = "align"):
    """The stage's model as `build_model` makes it (the align student from a fresh teacher)."""
    from dlite.train import plan as st
    _, model, tok, _ = setup
    cfg = load_config("configs/experiments/tiny.yaml", [f"train.recipe={recipe}"])
    teacher = _drafter(cfg, model, tok, "teacher")
    return st.build_model(cfg, st.plan_stage(cfg, stage), tgt.shared_vocab(model, tok), teacher)


def _groups(model) -> list:
    return [g["name"] for g in PlainEngine(model, 1e-3, 0.01, 1.0).optimizer.param_groups]


def test_head_group_only_where_the_recipe_freezes_the_head(setup):
    assert _groups(_align_student(setup, "teacher_init")) == ["body"]
    assert _groups(_align_student(setup, "published")) == ["body", "head"]
    assert _groups(_align_student(setup, "published", "teacher")) == ["body"]  # nothing frozen there


def test_checkpoint_with_one_group_resumes_under_teacher_init(setup, tmp_path):
    """An align checkpoint saved before the head group existed (one group over every
    trainable parameter, `adamw` as it was) loads into the teacher_init engine with the
    same moments, and training goes on; the published layout refuses it."""
    _, _, _, rows = setup
    batch = collate(rows[:2])
    student = _align_student(setup, "teacher_init")
    old = torch.optim.AdamW([p for p in student.parameters() if p.requires_grad], lr=1e-3,
                            betas=(0.9, 0.95), weight_decay=0.01)
    compute_loss(student, batch)[0].backward()
    old.step()
    torch.save({"model": student.state_dict(), "optimizer": old.state_dict(), "global_steps": 1},
               tmp_path / "ckpt.pt")
    sd = torch.load(tmp_path / "ckpt.pt", weights_only=False)
    engine = PlainEngine(_align_student(setup, "teacher_init"), 1e-3, 0.01, 1.0)
    engine.load_state_dict(sd)
    saved = old.state_dict()["state"]
    loaded = engine.optimizer.state_dict()["state"]
    assert sorted(loaded) == sorted(saved) and engine.global_steps == 1
    assert all(torch.equal(loaded[i]["exp_avg"], saved[i]["exp_avg"]) for i in saved)
    engine.backward(compute_loss(engine.module, batch)[0])
    assert engine.step() and engine.global_steps == 2
    with pytest.raises(ValueError, match="parameter groups"):
        PlainEngine(_align_student(setup, "published"), 1e-3, 0.01, 1.0).load_state_dict(sd)
