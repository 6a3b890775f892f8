"""The batched regenerator (`dlite.decoding.regenerate`) on the tiny built-in target in fp32:
greedy answers token for token those of batch-1 plain decoding and of `HFRegenerator`
(several multi-turn conversations of very different lengths, batch of 3 with rows
admitted as others finish), the cache carried between turns (prefill only of what is
new), sampling reproducible whatever the batch, failures as quarantine entries, and the
stage's place in the DAG and its config keys."""

import copy

import pytest
from omegaconf import OmegaConf

from dlite import tiny
from dlite.corpus import trajectories as corpus
from dlite.data import chat, formats
from dlite.decoding.regenerate import BatchedRegenerator
from dlite.data.render import HFRegenerator
from dlite.decoding.decode import plain_generate
from dlite.target import eos_ids

NEW = 32


@pytest.fixture(scope="module")
def target():
    return tiny.load_target(), tiny.load_tokenizer()


def _first_turns(messages: list, n: int) -> list:
    """The messages before the (n+1)-th assistant turn."""
    out, seen = [], 0
    for m in messages:
        if m["role"] == "assistant":
            if seen == n:
                break
            seen += 1
        out.append(m)
    return out


@pytest.fixture(scope="module")
def records():
    """5 conversations, ~1K to ~4K tokens of history, 2-4 assistant turns (the cut after a
    tool result makes the regenerator add a final turn)."""
    raw = list(corpus.generate("train", 3, 1, 3000, 5000)) + list(corpus.generate("heldout", 2, 2, 9000, 16000))
    out = []
    for i, r in enumerate(raw):
        r = formats.normalise(formats.to_canonical(r, f"c:{i}"))
        out.append({**r, "index": i, "messages": _first_turns(r["messages"], 2 + i % 3)})
    return out


def test_greedy_equals_batch1_plain_decoding_and_hf_regenerator(target, records):
    model, tok = target
    regen = BatchedRegenerator(model, tok, NEW, batch_size=3)
    done, bad = regen.regenerate_many(records)
    assert bad == [] and [d["id"] for d in done] == [r["id"] for r in records]
    hf = HFRegenerator(model, tok, NEW)
    eos = eos_ids(model, tok)
    for rec, d in zip(records, done):
        assert d["messages"] == hf.regenerate(rec["messages"], rec["tools"])
        k = 0
        for i, m in enumerate(d["messages"]):
            if m["role"] != "assistant":
                continue
            prompt = tok(chat.render(tok, d["messages"][:i], rec["tools"], True),
                         add_special_tokens=False)["input_ids"]
            assert d["tokens"][k] == plain_generate(model, prompt, NEW, eos_ids=eos)[0]
            k += 1
        assert k == d["turns"] >= 2
    s = regen.stats
    assert s["turns"] == sum(d["turns"] for d in done) and s["tokens_generated"] > 0
    # Carried caches: every history token is prefilled once (not once per turn).
    full = sum(len(tok(chat.render(tok, d["messages"], rec["tools"]), add_special_tokens=False)["input_ids"])
               for rec, d in zip(records, done))
    assert s["prefill_tokens"] <= full
    assert s["decode_steps"] < s["tokens_generated"]  # rows shared decode steps
    assert s["shared_prefix_tokens"] > 0  # one system prompt + tools, prefilled once


@pytest.mark.parametrize("batch_size", [1, 3])
def test_lookup_drafts_change_the_steps_not_the_tokens(target, records, batch_size):
    """Verified prompt-lookup drafts (`lookup`): the same greedy tokens as without them,
    batched (rejected drafts masked) or alone (cropped), in fewer decode steps; the next
    turn's cache still extends the last (no prefix miss), so only new text is prefilled."""
    model, tok = target
    plain = BatchedRegenerator(model, tok, NEW, batch_size=batch_size)
    fast = BatchedRegenerator(model, tok, NEW, batch_size=batch_size, lookup=5)
    ref, got = plain.regenerate_many(records)[0], fast.regenerate_many(records)[0]
    assert [d["tokens"] for d in got] == [d["tokens"] for d in ref]
    assert [d["messages"] for d in got] == [d["messages"] for d in ref]
    s, p = fast.stats, plain.stats
    assert s["accepted"] > 0 and s["drafted"] > s["accepted"]  # some drafts kept, some rejected
    assert s["decode_steps"] < p["decode_steps"] and plain.stats["drafted"] == 0
    assert s["prefill_tokens"] == p["prefill_tokens"] and s["prefix_misses"] == p["prefix_misses"] == 0


def test_recorded_history_answers_each_turn_to_the_real_history(target, records):
    """history="recorded": turn k is the target's greedy answer to the RECORDED
    conversation before it (as the held-out replay asks), not to its own earlier answers;
    every assistant turn of the output is still the target's, with lookup drafts too."""
    model, tok = target
    eos = eos_ids(model, tok)
    regen = BatchedRegenerator(model, tok, NEW, batch_size=3, history="recorded", lookup=5)
    done, bad = regen.regenerate_many(records[:3])
    assert bad == [] and regen.stats["prefix_misses"] > 0  # the cache cropped to the recorded turn
    for rec, d in zip(records[:3], done):
        recorded = [i for i, m in enumerate(rec["messages"]) if m["role"] == "assistant"]
        if rec["messages"][-1]["role"] != "assistant":
            recorded.append(len(rec["messages"]))  # the final turn after a tool result
        assert len(recorded) == d["turns"] >= 2
        for k, i in enumerate(recorded):
            prompt = tok(chat.render(tok, rec["messages"][:i], rec["tools"], True),
                         add_special_tokens=False)["input_ids"]
            assert d["tokens"][k] == plain_generate(model, prompt, NEW, eos_ids=eos)[0]
        gen = [m for m in d["messages"] if m["role"] == "assistant"]
        assert [m["content"] for m in gen] != [m["content"] for m in rec["messages"] if m["role"] == "assistant"]
    with pytest.raises(ValueError, match="history"):
        BatchedRegenerator(model, tok, 4, history="both")


def test_sampling_is_reproducible_whatever_the_batch(target, records):
    model, tok = target
    runs = [BatchedRegenerator(model, tok, 12, temperature=1.0, top_p=0.9, samples=2, batch_size=b,
                               seed=3).regenerate_many(records[:3])[0] for b in (1, 4)]
    assert [d["id"] for d in runs[0]] == [i for r in records[:3] for i in (r["id"], r["id"] + "#s1")]
    assert [d["tokens"] for d in runs[0]] == [d["tokens"] for d in runs[1]]
    assert runs[0][0]["tokens"] != runs[0][1]["tokens"]  # two samples, two answers


def test_failures_are_quarantined_not_raised(target, records):
    model, tok = target
    huge = {"id": "huge", "index": 7, "where": "f:8", "tools": [],
            "messages": [{"role": "user", "content": "read this " * 40000}]}  # > 32768 positions
    done, bad = BatchedRegenerator(model, tok, 4, batch_size=2).regenerate_many([records[0], huge])
    assert [d["id"] for d in done] == [records[0]["id"]]
    assert [(b["id"], b["index"], b["where"], b["reason"]) for b in bad] == [("huge", 7, "f:8", "too_long")]
    broken = copy.deepcopy(tok)
    broken.chat_template = "{{ raise_exception('this template renders nothing') }}"
    done, bad = BatchedRegenerator(model, broken, 4).regenerate_many(records[:1])
    assert done == [] and bad[0]["reason"] == "template_error" and "renders nothing" in bad[0]["detail"]
    with pytest.raises(formats.Quarantine, match="too_long"):
        BatchedRegenerator(model, tok, 4).regenerate(huge["messages"], [])


def test_a_cut_answer_still_extends_the_cache(target):
    """An answer cut by the token budget ends without <|im_end|>; the next prompt (the
    template closes the turn) still starts with the cached tokens, so turn 2 prefills
    only what follows them."""
    model, tok = target
    regen = BatchedRegenerator(model, tok, 6)
    msgs = [{"role": "user", "content": "list the files"}, {"role": "assistant", "content": "x"},
            {"role": "user", "content": "now read setup.py"}, {"role": "assistant", "content": "y"}]
    (d,), _ = regen.regenerate_many([{"id": "a", "messages": msgs, "tools": []}])
    assert d["turns"] == 2 and len(d["tokens"][0]) == 6 and regen.stats["prefix_misses"] == 0
    second = tok(chat.render(tok, d["messages"][:3], [], True), add_special_tokens=False)["input_ids"]
    assert regen.stats["prefill_tokens"] == len(second) - 5  # the first answer's fed tokens


def test_the_dag_runs_regenerate_before_collect_only_when_asked(tmp_path):
    """`data.regenerate=true` adds the stage (not a run.stages name) and feeds collect;
    off, the plan and collect's hash are what they were before the stage existed (the
    new data.regen_* keys are hash-neutral at their defaults)."""
    import dataclasses
    from dlite.config import ConfigError, load_config
    from pipelines.orchestration import dag
    out = [f"run.output_dir={tmp_path}"]
    on = {s.name: s for s in dag.plan(load_config("configs/experiments/tiny.yaml", out + ["data.regenerate=true"]))}
    assert list(on)[:2] == ["regenerate", "collect"] and on["collect"].deps == ["regenerate"]
    cfg = load_config("configs/experiments/tiny.yaml", out)
    off = {s.name: s for s in dag.plan(cfg)}
    assert "regenerate" not in off and off["collect"].deps == []
    before = dataclasses.replace(dag.BY_NAME["collect"], deps=())
    plain = OmegaConf.create(OmegaConf.to_container(cfg))
    for k in ("regen_temperature", "regen_top_p", "regen_samples", "regen_batch_size", "regen_lookup",
              "regen_history", "regen_features"):
        del plain.data[k]  # the config as it was before these keys
    assert off["collect"].hash == dag._stage_hash(plain, before, {}, dag.target_identity(cfg))
    with pytest.raises(ConfigError, match="data.regen_samples"):
        load_config("configs/experiments/tiny.yaml", ["data.regen_samples=2"])
    with pytest.raises(ConfigError, match="data.regen_top_p"):
        load_config("configs/experiments/tiny.yaml", ["data.regen_top_p=0"])
    with pytest.raises(ConfigError, match="data.regen_history"):
        load_config("configs/experiments/tiny.yaml", ["data.regen_history=mine"])
    hist = {s.name: s.hash for s in dag.plan(load_config("configs/experiments/tiny.yaml", out + [
        "data.regenerate=true", "data.regen_history=recorded"]))}
    assert hist["regenerate"] != on["regenerate"].hash and hist["collect"] != on["collect"].hash
    # Keeping collection's states while regenerating: the same conversations and rows.
    kept = {s.name: s.hash for s in dag.plan(load_config("configs/experiments/tiny.yaml", out + [
        "data.regenerate=true", "data.regen_features=true"]))}
    assert kept == {name: s.hash for name, s in on.items()}


@pytest.mark.parametrize("knob,moves", [
    ("data.regen_batch_size=4", []), ("data.regen_lookup=7", []), ("data.regen_features=true", []),
    ("data.batch_tokens=4096", []),
    ("data.cache_bytes=1000", []),
    ("data.shuffle_buffer=16", ["teacher", "align", "align_no_teacher", "dspark", "evaluate", "publish"]),
    ("data.val_group=^(.+)-[0-9]+$", ["teacher", "align", "align_no_teacher", "dspark", "evaluate", "publish"]),
    ("data.n_train=3", ["collect", "teacher", "align", "align_no_teacher", "dspark", "evaluate", "publish"])])
def test_how_fast_a_stage_runs_leaves_its_hash(tmp_path, knob, moves):
    """Keys that say how fast collection and regeneration run (or what only training
    reads) keep a finished collection reusable; the shuffle buffer still moves the
    training stages, which read it, and a real data change moves everything."""
    from dlite.config import load_config
    from pipelines.orchestration import dag
    out = [f"run.output_dir={tmp_path}"]
    base = {s.name: s.hash for s in dag.plan(load_config("configs/experiments/tiny.yaml", out))}
    new = {s.name: s.hash for s in dag.plan(load_config("configs/experiments/tiny.yaml", out + [knob]))}
    assert [k for k in base if base[k] != new[k]] == moves


def test_the_regeneration_benchmark_times_lookup_beside_the_batched_and_hf_loops():
    """`jobs.benchmark regenerate` with `data.regen_lookup`: the lookup variant on the same
    conversations of the configured corpus, greedy tokens identical to HFRegenerator's
    for both batched variants, its drafts counted."""
    from dlite.config import load_config
    from pipelines.benchmarks.regenerate import run
    cfg = load_config("configs/experiments/tiny.yaml", ["data.regen_lookup=5", "data.regen_batch_size=2"])
    rep = run(cfg, n=2, max_new_tokens=16)
    assert rep["corpus"] == "builtin" and rep["assistant_turns"] == [2, 3]
    assert rep["identical_tokens"] and rep["lookup_identical_tokens"]
    fast = rep["batched_lookup"]
    assert fast["lookup"] == 5 and fast["drafted"] > 0 and fast["tokens_generated"] == rep["hf_regenerator"]["tokens_generated"]
    assert fast["decode_steps"] < rep["batched_regenerator"]["decode_steps"]
    assert "batched_lookup" not in run(load_config("configs/experiments/tiny.yaml"), n=1, max_new_tokens=4)
