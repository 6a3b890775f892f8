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
`assert_lossless` fails on any divergence a tie cannot explain, and
`test_a_broken_crop_is_caught_in_bf16` shows that it has teeth."""

import dataclasses
import json
import math

import pytest
import torch
from omegaconf import OmegaConf

from dlite import few_rows
from dlite import target as tgt
from dlite.bench.draft_cost import CONFIG_DIR, load_drafter_yaml
from dlite.config import load_config
from dlite.corpus import trajectories as corpus
from dlite.data.draft_vocab import build_draft_vocab, supervised_counts
from dlite.decoding import decode
from dlite.decoding.decode import plain_generate, speculative_generate
from dlite.export import load_drafter, save_drafter
from dlite.models import LEARNED_MASK, build_drafter
from dlite.train.data import collate, epoch_batches, inprocess_rows
from dlite.train.optim import adamw
from dlite.train.plan import load_vocab
from dlite.train.step import compute_loss

BF16 = torch.bfloat16
STEPS, NEW_TOKENS = 30, 48
TIE_ULPS = 8  # bf16 spacings between two logits that count as a tie (measured noise: <= 4)


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
    TIE_ULPS bf16 spacings (judged on one prefill of prompt + plain). Returns the
    number of identical leading tokens."""
    k = next((i for i, (s, p) in enumerate(zip(spec, plain)) if s != p), min(len(spec), len(plain)))
    if spec == plain:
        return k
    assert k < min(len(spec), len(plain)), f"lengths differ: {len(spec)} vs {len(plain)}"
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([list(prompt) + plain[:k]])).logits[0, -1].float()
    a, b = logits[plain[k]].item(), logits[spec[k]].item()
    ulp = 2.0 ** (math.floor(math.log2(max(abs(a), abs(b), 1e-3))) - 7)  # bf16: 8 significant bits
    assert abs(a - b) <= TIE_ULPS * ulp, (
        f"not lossless at token {k}: plain {plain[k]} (logit {a:.4f}) vs speculative {spec[k]} "
        f"(logit {b:.4f}), {abs(a - b) / ulp:.1f} bf16 spacings apart")
    return k


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
