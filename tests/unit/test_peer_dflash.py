"""A SpecForge DFlash drafter in our harness (issue 31), against SpecForge's own code:
a `DFlashDraftModel` built with SpecForge's class and written by its `save_pretrained`
(what `specforge export --to hf` calls) is read by `dlite.models.dflash_peer`; over
several rounds with a growing context cache our draft logits equal its forward's on the
same context and block, and on 20 prompts of the built-in tiny Qwen3 target our replay
(`speculative_generate`) and its `spec_generate` accept the same length every round,
both equal to plain greedy decoding. So that rounds accept more than nothing, the drafter
is first fitted with SpecForge's own DFlash loss (`OnlineDFlashModel`) to the target's
greedy continuations of those prompts. Skipped without specforge (the `peers` extra)."""

import pytest
import torch

specforge_dflash = pytest.importorskip("specforge.modeling.draft.dflash", reason="specforge not installed "
                                       "(pip install specforge==0.2.0 --no-deps; the peers extra)")

from transformers import Qwen3Config  # noqa: E402

from dlite import tiny  # noqa: E402
from dlite.decoding.decode import plain_generate  # noqa: E402
from dlite.export import check_artifact, load_drafter  # noqa: E402
from dlite.models.dflash_peer import DFlashPeerDrafter  # noqa: E402

MASK, BLOCK = 7, 5  # the tiny tokenizer's <|mask|>; anchor + 4 drafts


@pytest.fixture(scope="module")
def target():
    return tiny.load_target()


N_NEW = 12


@pytest.fixture(scope="module")
def prompts():
    tok = tiny.load_tokenizer()
    texts = [f"def f{i}(x):\n    return x * {i} + {i * i}\n# call f{i}" for i in range(20)]
    return [tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True)["input_ids"]
            for t in texts]


def fit(model, target, prompts, steps=150):
    """SpecForge's DFlash loss on [prompt | the target's greedy continuation], the
    continuation supervised; layer 0's output (HF hidden_states[1]) as the feature."""
    from specforge.algorithms.common.dflash_family_model import OnlineDFlashModel
    seqs = [p + plain_generate(target, p, N_NEW)[0] for p in prompts]
    L = max(map(len, seqs))
    ids, mask = torch.zeros(len(seqs), L, dtype=torch.long), torch.zeros(len(seqs), L, dtype=torch.long)
    for i, (s, p) in enumerate(zip(seqs, prompts)):
        ids[i, :len(s)], mask[i, len(p):len(s)] = torch.tensor(s), 1
    with torch.no_grad():
        feats = target(input_ids=ids, output_hidden_states=True).hidden_states[1]
    train = OnlineDFlashModel(model, target.lm_head, target.get_input_embeddings(), MASK, block_size=BLOCK,
                              attention_backend="sdpa", num_anchors=16)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    model.train()
    for _ in range(steps):
        loss, _, _ = train(input_ids=ids, hidden_states=feats, loss_mask=mask)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model.eval()


@pytest.fixture(scope="module")
def export(tmp_path_factory, target, prompts):
    """A DFlash drafter at the tiny target's width, fitted by SpecForge's loss, saved by SpecForge."""
    tc = target.config
    cfg = Qwen3Config(hidden_size=tc.hidden_size, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=32, intermediate_size=256, vocab_size=tc.vocab_size,
                      rms_norm_eps=1e-6, max_position_embeddings=4096, initializer_range=0.2,
                      tie_word_embeddings=False)
    cfg.architectures = ["DFlashDraftModel"]
    cfg.block_size, cfg.num_target_layers = BLOCK, tc.num_hidden_layers
    cfg.layer_types = ["full_attention"] * 2
    cfg.dflash_config = {"target_layer_ids": [0], "mask_token_id": MASK}
    torch.manual_seed(0)
    model = fit(specforge_dflash.DFlashDraftModel(cfg), target, prompts)
    out = tmp_path_factory.mktemp("dflash")
    model.save_pretrained(out)
    return out, model


def ours(export_dir, target):
    return load_drafter(export_dir, target.get_input_embeddings().weight, target.lm_head.weight)


def test_reads_the_export_and_checks_it(export, target):
    d = ours(export[0], target)
    assert isinstance(d, DFlashPeerDrafter) and d.gamma == BLOCK - 1 and d.target_layer_ids == [0]
    assert d.needs_history and d.mask_token_id == MASK
    assert check_artifact(export[0]).startswith("DFlashDraftModel export, model.safetensors size ok")


def test_draft_logits_equal_specforge_forward_over_rounds(export, target):
    """Three rounds, the context cache growing by 9, 3, 1 positions: our slot logits vs
    its forward over [all context so far | block] (no cache: its training-free path)."""
    d, theirs = ours(export[0], target), export[1]
    g = torch.Generator().manual_seed(1)
    feats = torch.randn(13, target.config.hidden_size, generator=g)
    state, seen = d.new_state(), 0
    for n, anchor in ((9, 11), (3, 40), (1, 99)):
        tokens, probs, state = d.draft(state, feats[seen:seen + n], anchor, seen + n, 0.0)
        seen += n
        block = torch.full((1, BLOCK), MASK)
        block[0, 0] = anchor
        with torch.no_grad():
            h = theirs(position_ids=torch.arange(seen + BLOCK)[None], target_hidden=feats[None, :seen],
                       noise_embedding=target.get_input_embeddings()(block), is_causal=False)
            want = target.lm_head(h[:, 1:])[0]
        assert probs is None and state.length == seen
        assert torch.equal(tokens, want.argmax(-1))
        _, p, _ = d.draft(d.new_state(), feats[:seen], anchor, seen, 1.0, torch.Generator().manual_seed(0))
        assert torch.allclose(p, torch.softmax(want, -1), atol=1e-5)


def test_same_accepts_as_spec_generate_and_lossless(export, target, prompts):
    from pipelines.benchmarks.peers_check import compare
    report = compare(export[0], target, ours(export[0], target), prompts, N_NEW, [tiny.load_tokenizer().eos_token_id])
    assert report["prompts"] == 20 and report["rounds"] >= 20
    bad = [r for r in report["rows"] if not (r["same_accepts"] and r["ours_equal_plain"] and r["theirs_equal_plain"])]
    assert not bad and report["all_agree"]
    accepted = [a for r in report["rows"] for a in r["ours_accepted"]]
    # Rounds of several lengths, so agreement is more than "both reject everything".
    assert max(accepted) >= 2 and len(set(accepted)) >= 3, accepted


def test_the_peer_row_sits_beside_the_training_free_methods():
    """The peers benchmark evaluates prompt lookup and SuffixDecoding whatever the
    config lists, keeping the config's own baselines and their order."""
    from dlite.config import load_config
    from pipelines.benchmarks.peers import with_training_free
    cfg = load_config("configs/experiments/smollm2.yaml", ["eval.baselines=[]"])
    assert list(cfg.eval.baselines) == [] and list(with_training_free(cfg).eval.baselines) == ["prompt_lookup", "suffix"]
    cfg = load_config("configs/experiments/smollm2.yaml", ["eval.baselines=[suffix]"])
    assert list(with_training_free(cfg).eval.baselines) == ["suffix", "prompt_lookup"]
