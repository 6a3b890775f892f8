"""Prompt lookup in our loop against transformers' own (`generate(...,
prompt_lookup_num_tokens=N)`), on the same turns with the same target object: if our
loop's timing is honest, the two speedups over their own plain decoding agree within
noise. Both are end-to-end per turn (prefill included, the same work in both loops of a
pair); ours proposes like transformers' (n-grams `max_matching_ngram_size`..1, the
first occurrence, N tokens). Each pair runs interleaved, alternating which loop goes
first, so machine noise cancels in the ratios."""

import time
from typing import List, Sequence

import torch

from dlite.decoding.decode import plain_generate, speculative_generate
from dlite.decoding.lookup import PromptLookupDrafter


def _timed(fn) -> tuple:
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def _hf(model, prompt: List[int], max_new: int, eos, lookup: int = 0, ngram: int = 2):
    """New token ids from transformers' generate, greedy (prompt lookup when lookup > 0)."""
    kw = dict(prompt_lookup_num_tokens=lookup, max_matching_ngram_size=ngram) if lookup else {}
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new,
                         do_sample=False, eos_token_id=list(eos), pad_token_id=list(eos)[0], **kw)
    return out[0, len(prompt):].tolist()


def run(model, prompts: Sequence[List[int]], eos, max_new_tokens: int = 48, num_tokens: int = 7,
        ngram: int = 2) -> dict:
    """Per turn: HF plain, HF prompt lookup, our plain, our prompt lookup; the two
    speedups (pooled time ratios) and whether all four outputs agree."""
    vocab = model.get_output_embeddings().weight.shape[0]
    secs = {"hf_plain": 0.0, "hf_lookup": 0.0, "ours_plain": 0.0, "ours_lookup": 0.0}
    same, turns = True, []
    for i, prompt in enumerate(prompts):
        runs = {
            "hf_plain": lambda: _hf(model, prompt, max_new_tokens, eos),
            "hf_lookup": lambda: _hf(model, prompt, max_new_tokens, eos, num_tokens, ngram),
            "ours_plain": lambda: plain_generate(model, prompt, max_new_tokens, eos_ids=eos)[0],
            "ours_lookup": lambda: speculative_generate(
                model, PromptLookupDrafter(prompt, vocab, num_tokens, ngram, 1, "first"),
                prompt, max_new_tokens, eos_ids=eos)[0]}
        order = list(runs) if i % 2 == 0 else list(reversed(runs))
        outs = {}
        for name in order:
            outs[name], s = _timed(runs[name])
            secs[name] += s
        agree = len({tuple(o) for o in outs.values()}) == 1
        same = same and agree
        turns.append({"context_len": len(prompt), "new_tokens": len(outs["ours_plain"]), "outputs_agree": agree})
    hf, ours = secs["hf_plain"] / secs["hf_lookup"], secs["ours_plain"] / secs["ours_lookup"]
    return {"speedup_hf_prompt_lookup": hf, "speedup_ours_prompt_lookup": ours,
            "ours_over_hf": ours / hf, "outputs_agree": same, "seconds": secs, "turns": turns,
            "settings": {"max_new_tokens": max_new_tokens, "prompt_lookup_num_tokens": num_tokens,
                         "max_matching_ngram_size": ngram}}
