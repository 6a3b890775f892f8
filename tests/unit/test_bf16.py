"""bf16 end to end on CPU, with the tiny built-in target loaded as `target.dtype=bfloat16`
runs it (collection, training features, evaluation): the few-row fast path steps aside
for bf16; features collected from the bf16 target train a drafter with the real loss
and AdamW (frozen vocabulary read as the train stage reads it, the model cast as
DeepSpeed's bf16 casts it); the artifact round-trips bitwise in bf16; and the reloaded
drafter, cast to the target's dtype as evaluation does, decodes losslessly at T=0 and
validly at T=1 -- DLite (the target's MASK row; a learned MASK with a draft vocabulary)
and the DSpark-style baseline. An artifact also serves a target of the other dtype
uncast (the model card's recipe: bf16 weights around an fp32 target's vocabulary).

Lossless in bf16: token-identical output, except that a divergence is allowed where the
target itself is tied within bf16 rounding. A bf16 forward's logits depend on its
shape (a 1-token step, an 8-token block and a prefill round differently: up to ~0.2 on
this target's logits of ~8, whose bf16 spacing is 0.06), and exact ties are common at
that spacing, so plain and speculative decoding may each pick a different top token
(measured on this machine: 4 of 12 prompts x 48 tokens parted at an exact tie, the
same place for all three drafters). The prompts below run token-identical here;
`assert_lossless` fails on any divergence a tie cannot explain (the library's rule,
`dlite.decoding.ties`, which evaluation reports as `lossless_up_to_ties`), and
`test_a_broken_crop_is_caught_in_bf16` shows that it has teeth."""

import dataclasses
import json

import pytest
import torch
from omegaconf import OmegaConf

from dlite import few_rows
from dlite import target as tgt
from dlite.bench.draft_cost import CONFIG_DIR, load_drafter_yaml
from dlite.config import load_config
from dlite.corpus import trajectories as corpus
from dlite.data.draft_vocab import build_draft_vocab, supervised_counts
from dlite.decoding import decode, ties
from dlite.decoding.decode import plain_generate, speculative_generate
from dlite.decoding.replay import EvalArgs, _run_task, aggregate
from dlite.export import load_drafter, save_drafter
from dlite.models import LEARNED_MASK, build_drafter
from dlite.train.data import collate, epoch_batches, inprocess_rows
from dlite.train.optim import adamw
from dlite.train.plan import load_vocab
from dlite.train.step import compute_loss

BF16 = torch.bfloat16
STEPS, NEW_TOKENS = 30, 48


@pytest.fixture(scope="module")
def setup():
    """The bf16 target, its tokenizer and `full` training rows collected from it."""
    cfg = load_config("configs/experiments/tiny.yaml", ["target.dtype=bfloat16"])
    model, tok = tgt.load(cfg.target)
    recs = list(corpus.generate("train", 4, 0, 3000, 6000))
    rows = inprocess_rows(model, tok, recs, list(cfg.drafter.target_layer_ids), 512, "truncate", 16, 0)
    return cfg, model, tok, rows


def _drafter_cfg(cfg, variant: str):
    if variant == "dspark":
        return load_drafter_yaml(CONFIG_DIR / "dspark_tiny.yaml")
    dcfg = OmegaConf.to_object(cfg.drafter)
    return dcfg if variant == "dlite" else dataclasses.replace(dcfg, draft_vocab_size=1024)


def _train_drafter(cfg, model, rows, variant: str):
    """Build as the train stage does (vocabulary read from the safetensors in fp32), cast
    to bf16 as DeepSpeed's bf16 mode does, then STEPS steps of the real loss + AdamW.
    Returns (drafter, losses on a fixed batch before / after)."""
    embed, lm_head, mask = load_vocab(cfg.target)
    dcfg, ids = _drafter_cfg(cfg, variant), None
    if variant == "dlite_learned":  # SmolLM2's case: no spare row, 1024 of 4096 tokens
        mask, ids = LEARNED_MASK, build_draft_vocab(supervised_counts(rows, embed.shape[0]), 1024)
    torch.manual_seed(0)
    drafter = build_drafter(dcfg, embed, lm_head, mask, ids).to(BF16).train()
    # training and evaluation must share the exact frozen vocabulary
    assert torch.equal(drafter.vocab.embed_weight, model.get_input_embeddings().weight)
    fixed, opt = collate(rows[:2]), adamw(drafter, 3e-3, 0.0)
    with torch.no_grad():
        before = compute_loss(drafter, fixed)[0].item()
    batches = epoch_batches(rows, 2, 16, seed=0)
    for _ in range(STEPS):
        loss, _ = compute_loss(drafter, next(batches))
        assert torch.isfinite(loss) and loss.dtype == torch.float32
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    with torch.no_grad():
        after = compute_loss(drafter, fixed)[0].item()
    return drafter.eval(), before, after


def _floating(module):
    return {k: v for k, v in module.state_dict().items() if v.is_floating_point()}


def assert_lossless(model, prompt, spec, plain) -> int:
    """spec == plain, or they part where the target's logits of the two tokens are within
    `ties.TIE_ULPS` spacings of its dtype (`ties.divergence`: one prefill of prompt +
    plain). Returns the number of identical leading tokens."""
    d = ties.divergence(model, prompt, spec, plain)
    if d is None:
        return len(plain)
    assert d["tie"], (f"not lossless at token {d['index']}: plain {d['plain']} vs speculative "
                      f"{d['spec']} (lengths {len(plain)} / {len(spec)}), logit gap {d['logit_gap']} "
                      f"> tolerance {d['tol']}")
    return d["index"]


def test_target_loads_in_bf16_and_few_rows_steps_aside(setup):
    """Every plain Linear of the target is routed through `few_rows_linear`, which must
    fall back to F.linear in bf16: the routed model computes exactly the unrouted one."""
    _, model, _, rows = setup
    assert model.dtype == BF16 and model.get_input_embeddings().weight.dtype == BF16
    linears = [m for m in model.modules() if type(m) is torch.nn.Linear]
    assert linears and all("forward" in vars(m) for m in linears)
    w = model.lm_head.weight
    for n in (1, 3, few_rows.MAX_ROWS):
        x = torch.randn(n, w.shape[1], dtype=BF16)
        assert torch.equal(few_rows.few_rows_linear(x, w), torch.nn.functional.linear(x, w))
    ids = torch.tensor([rows[0]["input_ids"][:64]])
    with torch.inference_mode():
        routed = [model(input_ids=ids[:, :n]).logits for n in (1, 5, 64)]
        for m in linears:
            del m.forward  # the class's own nn.Linear.forward again
        try:
            plain = [model(input_ids=ids[:, :n]).logits for n in (1, 5, 64)]
        finally:
            few_rows.install(model)
    assert all(torch.equal(r, p) and r.dtype == BF16 for r, p in zip(routed, plain))


@pytest.mark.parametrize("variant", ["dlite", "dlite_learned", "dspark"])
def test_bf16_train_export_reload_and_decode(setup, tmp_path, variant):
    cfg, model, tok, rows = setup
    drafter, before, after = _train_drafter(cfg, model, rows, variant)
    assert all(v.dtype == BF16 for v in _floating(drafter).values())
    assert after < before, f"{variant}: loss {before:.4f} -> {after:.4f} after {STEPS} bf16 steps"

    save_drafter(drafter, tmp_path, {"target_dtype": cfg.target.dtype})
    assert json.loads((tmp_path / "config.json").read_text())["dtype"] == "bfloat16"
    embed, lm_head, _ = tgt.shared_vocab(model, tok)  # evaluation: the bf16 target's own
    loaded = load_drafter(tmp_path, embed, lm_head).to(model.dtype)
    want, got = _floating(drafter), _floating(loaded)
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) and got[k].dtype == BF16
                                             for k in want)
    batch = collate(rows[2:3])
    with torch.no_grad():
        assert torch.equal(loaded.forward_train(batch), drafter.forward_train(batch))

    same, accepted = 0, 0
    for prompt in (rows[0]["input_ids"][:250], rows[1]["input_ids"][:350]):
        plain, _ = plain_generate(model, prompt, NEW_TOKENS)
        spec, rounds = speculative_generate(model, loaded, prompt, NEW_TOKENS)
        same += assert_lossless(model, prompt, spec, plain)
        accepted += sum(r["accepted"] for r in rounds)
    assert same >= NEW_TOKENS  # at least one whole output compared token for token
    if variant != "dspark":  # a 30-step DSpark may still propose nothing the target takes
        assert accepted > 0, f"{variant}: no draft accepted: losslessness was not exercised"
    _check_sampling(model, loaded, rows[0]["input_ids"][:200])


def _check_sampling(model, drafter, prompt):
    """T=1 runs: the budget is filled with real token ids, drafts come with their q (fp32
    distributions over the target's vocabulary, zero outside a draft vocabulary)."""
    drafts = []
    inner = drafter.draft

    def record(*args, **kw):
        tokens, probs, state = inner(*args, **kw)
        drafts.append((tokens, probs))
        return tokens, probs, state
    drafter.draft = record
    try:
        out, rounds = speculative_generate(model, drafter, prompt, 24, temperature=1.0,
                                           generator=torch.Generator().manual_seed(0))
    finally:
        del drafter.draft
    V = model.config.vocab_size
    assert len(out) == 24 and rounds and all(0 <= t < V for t in out)
    for tokens, probs in drafts:
        assert probs.dtype == torch.float32 and probs.shape == (len(tokens), V)
        torch.testing.assert_close(probs.sum(-1), torch.ones(len(tokens)))
        assert (probs.gather(1, tokens[:, None]) > 0).all()
        if drafter.vocab.draft_ids is not None:
            assert torch.isin(tokens, drafter.vocab.draft_ids).all()


def test_a_broken_crop_is_caught_in_bf16(setup, monkeypatch):
    """The tie allowance of `assert_lossless` does not hide a real loss: leaving the
    rejected drafts in the target's cache fails it."""
    cfg, model, tok, rows = setup
    torch.manual_seed(0)
    drafter = build_drafter(OmegaConf.to_object(cfg.drafter), *tgt.shared_vocab(model, tok)).to(BF16).eval()
    prompt = rows[0]["input_ids"][:200]
    plain, _ = plain_generate(model, prompt, NEW_TOKENS)
    monkeypatch.setattr(decode, "crop_cache", lambda cache, length: None)
    spec, _ = speculative_generate(model, drafter, prompt, NEW_TOKENS)
    with pytest.raises(AssertionError, match="not lossless"):
        assert_lossless(model, prompt, spec, plain)
    # The evaluation's own record of it: the divergence is no tie, so neither verdict holds.
    a = EvalArgs(max_new_tokens=NEW_TOKENS, buckets=(1024,))
    res = _run_task(model, drafter, {"id": "p", "turn": 0, "prompt_ids": prompt}, a, [], True, 0)
    d = res["divergence"]
    assert d and not d["tie"] and d["logit_gap"] > d["tol"] and d["plain"] == res["plain_ids"][d["index"]]
    report = aggregate([res], 0, a)
    assert report["lossless"] is False and report["lossless_up_to_ties"] is False
    assert report["n_tie_divergences"] == 0 and report["per_task"][0]["divergence"] == d
    assert ties.lossless_verdict(report, cfg.target.dtype) is False


def test_a_tie_is_told_from_a_real_divergence():
    """The rule on hand-made logits: the measured exact tie (two bf16 logits of 8.0625),
    up to TIE_ULPS spacings (0.0625 at 8..16) is a tie, one more is not; fp32's spacing
    makes the same rule strict."""
    logits = torch.zeros(1000, dtype=BF16)
    logits[282] = logits[562] = 8.0625
    assert ties.classify(logits, 282, 562, BF16) == {"logit_gap": 0.0, "tol": 0.5, "tie": True}
    logits[7] = 8.0625 + 0.0625 * ties.TIE_ULPS
    logits[9] = 8.0625 + 0.0625 * (ties.TIE_ULPS + 1)
    assert ties.classify(logits, 7, 562, BF16)["tie"] and not ties.classify(logits, 9, 562, BF16)["tie"]
    fp32 = logits.float()
    fp32[5] = 8.0625 + 1e-4
    assert ties.classify(fp32, 282, 562, torch.float32)["tie"]
    assert not ties.classify(fp32, 5, 562, torch.float32)["tie"]
    assert ties.first_mismatch([1, 2, 3], [1, 2, 3]) is None and ties.first_mismatch([1, 2], [1, 2, 3]) == 2


def _result(spec, plain, divergence):
    return {"id": "t", "turn": 0, "context_len": 10, "spec_ids": spec, "plain_ids": plain, "gamma": 4,
            "rounds": [], "spec_ms": 1.0, "plain_ms": 1.0, "spec_e2e_ms": 1.0, "plain_e2e_ms": 1.0,
            "divergence": divergence}


def test_aggregate_reports_ties_and_keeps_lossless_strict():
    """A task that parted at a tie: `lossless` is False (strict, unchanged), while
    `lossless_up_to_ties` holds, and the pipeline's verdict follows the target's dtype;
    one real divergence besides makes both False."""
    tie = {"index": 1, "spec": 5, "plain": 6, "logit_gap": 0.0, "tol": 0.5, "tie": True}
    a = EvalArgs(buckets=(1024,))
    rep = aggregate([_result([1, 2], [1, 2], None), _result([4, 5, 9], [4, 6, 7], tie)], 0, a)
    assert rep["lossless"] is False and rep["n_mismatched_tasks"] == 1
    assert rep["lossless_up_to_ties"] is True and rep["n_tie_divergences"] == 1
    assert ties.lossless_verdict(rep, "bfloat16") is True and ties.lossless_rule("bfloat16") == "up_to_ties(bf16)"
    assert ties.lossless_verdict(rep, "float32") is False and ties.lossless_rule(torch.float32) == "exact"
    real = dict(tie, tie=False, logit_gap=3.0)
    rep = aggregate([_result([4, 5], [4, 6], tie), _result([3, 8], [3, 1], real)], 0, a)
    assert rep["lossless_up_to_ties"] is False and rep["n_tie_divergences"] == 1
    assert ties.lossless_verdict(rep, "bfloat16") is False
    sampled = aggregate([_result([4, 5], [4, 6], None)], 0, EvalArgs(temperature=1.0, buckets=(1024,)))
    assert sampled["lossless"] is None and sampled["lossless_up_to_ties"] is None


@pytest.mark.parametrize("arch", ["dlite", "dspark"])
def test_an_artifact_serves_a_target_of_another_dtype(setup, tmp_path, arch):
    """The model card's recipe, without evaluation's cast: `load_drafter` keeps the stored
    weights' dtype around the target's vocabulary, so a bf16 artifact next to an fp32
    target (and an fp32 one next to the bf16 target) mixes dtypes inside the drafter.
    It drafts, and the output is the target's plain output."""
    cfg, model, tok, rows = setup
    fp32 = tgt.load_model(cfg.target, torch.float32)
    dcfg = _drafter_cfg(cfg, arch)
    prompt = rows[0]["input_ids"][:250]
    for saved, target in ((BF16, fp32), (torch.float32, model)):
        torch.manual_seed(0)
        drafter = build_drafter(dcfg, *tgt.shared_vocab(target, tok)).to(saved)
        save_drafter(drafter, tmp_path / str(saved), {})
        loaded = load_drafter(tmp_path / str(saved), *tgt.shared_vocab(target, tok)[:2])
        assert next(loaded.parameters()).dtype == saved != loaded.vocab.embed_weight.dtype
        plain, _ = plain_generate(target, prompt, 24)
        spec, rounds = speculative_generate(target, loaded, prompt, 24)
        assert rounds and assert_lossless(target, prompt, spec, plain) == 24
        out, _ = speculative_generate(target, loaded, prompt, 8, temperature=1.0,
                                      generator=torch.Generator().manual_seed(0))
        assert len(out) == 8
