"""In-place KV caches for one request (`dlite.decoding.slack`, `decode.loop_cache`): the
same logits as transformers' concatenating cache, forwards that write into one buffer
instead of reallocating it, a prefill's cache never written by the loops that copy it,
and both loops still lossless on top of it."""

import torch
from transformers import DynamicCache

from dlite.decoding.decode import (crop_cache, loop_cache, plain_generate, prefill, speculative_generate,
                                   target_forward)
from dlite.decoding.lookup import PromptLookupDrafter
from dlite.decoding.slack import SlackLayer
from tests.unit.test_spec_decode import tiny_target

PROMPT = [5, 17, 99, 3, 42, 8, 61, 7, 5, 17, 99, 3, 42]


def _snapshot(cache):
    return [(la.keys.clone(), la.values.clone()) for la in cache.layers]


@torch.no_grad()
def test_same_logits_and_no_reallocation_per_forward():
    target = tiny_target()
    pre = prefill(target, PROMPT)
    before = _snapshot(pre.cache)
    slack, plain = loop_cache(pre.cache, 16, copy_of=True), loop_cache(pre.cache, 16, copy_of=True)
    plain.layers = [type(pre.cache.layers[0])() for _ in plain.layers]  # a concatenating twin
    for la, src in zip(plain.layers, pre.cache.layers):
        la.lazy_initialization(src.keys, src.values)
        la.keys, la.values = src.keys.clone(), src.values.clone()
    assert all(type(la) is SlackLayer for la in slack.layers)
    buffers = [la.keys.data_ptr() for la in slack.layers]
    t = pre.t
    for block in ([11, 12, 13], [14], [15, 16, 17, 18, 19]):
        ids = torch.tensor(block)
        assert torch.equal(target_forward(target, ids, t, slack), target_forward(target, ids, t, plain))
        t += 1  # keep the first token of the block, as a round that accepts nothing does
        crop_cache(slack, t), crop_cache(plain, t)
    assert [la.keys.data_ptr() for la in slack.layers] == buffers  # written in place throughout
    assert slack.get_seq_length() == plain.get_seq_length() == pre.t + 3
    for (k, v), la in zip(before, pre.cache.layers):  # the prefill's own tensors untouched
        assert torch.equal(k, la.keys) and torch.equal(v, la.values)


@torch.no_grad()
def test_past_its_room_a_layer_grows_once_and_keeps_every_entry():
    target = tiny_target()
    pre = prefill(target, PROMPT)
    cache = loop_cache(pre.cache, 2, copy_of=True)
    ref = DynamicCache(config=target.config)
    target_forward(target, torch.tensor(PROMPT), 0, ref)
    ids = torch.tensor([21, 22, 23, 24, 25, 26])  # 6 new positions into room for 2
    assert torch.equal(target_forward(target, ids, pre.t, cache), target_forward(target, ids, pre.t, ref))
    for mine, theirs in zip(cache.layers, ref.layers):
        assert torch.equal(mine.keys, theirs.keys) and torch.equal(mine.values, theirs.values)


def test_both_loops_stay_lossless_from_one_prefill_and_leave_it_as_it_was():
    target = tiny_target()
    pre = prefill(target, PROMPT)
    before = _snapshot(pre.cache)
    ref, _ = plain_generate(target, PROMPT, 40)  # its own prefill, no copy
    out, _ = plain_generate(target, PROMPT, 40, prefilled=pre)
    spec, rounds = speculative_generate(target, PromptLookupDrafter(PROMPT, 128, gamma=4), PROMPT, 40, prefilled=pre)
    assert out == ref and spec == ref and rounds
    for (k, v), la in zip(before, pre.cache.layers):
        assert torch.equal(k, la.keys) and torch.equal(v, la.values)
    assert all(type(la) is not SlackLayer for la in pre.cache.layers)
