"""The speculative decoding loop over a real target with a KV cache, and the plain
autoregressive loop it is measured against (same cache code, same sampling function,
same stopping rules: the fair denominator of every speedup).

Positions: the target has processed tokens 0..t-1; the anchor x_t (last accepted or
bonus token) is not yet processed. One round: the drafter proposes d_1..d_γ from the
features of the positions verified since its last call; the target runs
[x_t, d_1..d_γ] at positions t..t+γ in ONE cached forward; `verify_block` keeps a
drafts and picks the next token; the cache is cropped to t+a+1 entries and the
captured features of positions t..t+a (only t+a for a history-free drafter) feed the
next draft, whose anchor is the new token at position t+a+1.

Cache API (transformers 5.24): the forward kwarg is `cache=` (`past_key_values=` still
works but warns that it is deprecated); `DynamicCache.crop(n)` REMOVES n tokens when
n < 0 and raises for n > 0 (4.x read a positive n as the new length), so `crop_cache`
always passes a negative count, which both major versions understand.

A drafter proposing several branches (`draft_tree`: the tree hybrids) gets a tree round
instead: the branches merged into a token tree, verified in one forward under a tree
attention mask, the accepted path's cache entries gathered into place and the rest
dropped (`dlite.decoding.tree`); the round record then says how many tokens the target
checked (`verified`), which source the accepted path came from and each branch's match.

`prefill` runs a prompt through the target once and keeps what both loops start from
(cache, last logits, captured features); `speculative_generate` / `plain_generate` take
it as `prefilled=` and start from a copy of its cache, so an evaluation replays many
methods on one history with one prefill (at 4K tokens a SmolLM2 prefill costs ~11 s on
2 cores, ~200 decode steps).

transformers is imported where a DynamicCache is made (`dlite.target.cache`), not at
module load: a target that makes its own cache (`new_cache()`: the torch-only Qwen3 of
`dlite.bench.qwen3`) decodes through this loop where transformers is not installed
(`dlite.bench.device`)."""

from __future__ import annotations

import copy
import dataclasses
import time
from typing import TYPE_CHECKING, Iterable, List, Optional, Sequence, Tuple

import torch

from dlite.decoding.capture import LayerCapture
from dlite.decoding.tree import build_tree, keep_path, tree_mask, tree_positions, verify_tree
from dlite.decoding.verify import sample_token, verify_block
from dlite.target.cache import cache_kwarg, crop_cache, new_cache  # noqa: F401 (crop_cache, new_cache: re-exported)

if TYPE_CHECKING:  # annotations only: the import itself happens in new_cache
    from transformers import DynamicCache


ROOM = 64  # positions reserved beyond max_new_tokens: a round's block or tree


def _new_state(drafter, prompt_ids):
    """The drafter's per-generation state; one whose query reads the token before the
    anchor (`reads_prompt`: dlite_v1's G=2 group) is given the prompt, so its first round
    knows that token as every later one does."""
    if getattr(drafter, "reads_prompt", False):
        return drafter.new_state([int(x) for x in torch.as_tensor(prompt_ids).reshape(-1)])
    return drafter.new_state()


def target_forward(target, ids: torch.Tensor, start: int, cache: DynamicCache,
                   logits_to_keep: int = 0, position_ids: Optional[torch.Tensor] = None,
                   attention_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Run ids [n] at positions start..start+n-1 (or `position_ids` [1, n]) through the
    target, extending `cache`; `attention_mask`: a custom 4D mask (a token tree's).
    Returns logits [n or logits_to_keep, V] for batch row 0. Rows of a batch (ids
    [B, n], with `position_ids` [B, n] and a mask: `dlite.decoding.batch`) get
    logits [B, n, V]."""
    rows = ids.dim() == 2
    pos = position_ids if position_ids is not None else torch.arange(start, start + ids.shape[-1], device=ids.device)[None]
    kw = {cache_kwarg(type(target)): cache}
    if attention_mask is not None:
        kw["attention_mask"] = attention_mask
    out = target(input_ids=ids if rows else ids[None], position_ids=pos, use_cache=True,
                 logits_to_keep=logits_to_keep, **kw)
    return out.logits if rows else out.logits[0]


def _device(model) -> torch.device:
    return next(model.parameters()).device


def _sync(device: torch.device) -> None:
    # Timings split draft / verify only if queued GPU work is finished at each mark.
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _as_ids(prompt_ids, device) -> torch.Tensor:
    ids = torch.as_tensor(prompt_ids, dtype=torch.long, device=device).reshape(-1)
    if ids.numel() == 0:
        raise ValueError("prompt_ids is empty")
    return ids


def _extend(out: List[int], tokens: Iterable[int], eos: set, max_new: int) -> bool:
    """Append tokens until EOS (kept) or the budget; True when generation is over."""
    for tok in tokens:
        out.append(tok)
        if tok in eos or len(out) >= max_new:
            return True
    return False


@dataclasses.dataclass
class Prefill:
    """A prompt after the target's prefill: its cache (never extended: each loop takes a
    copy), the last position's logits, the outputs of `layer_ids` (every position when
    `all_rows`, else the last one) and the prefill's wall time `ms`."""
    cache: DynamicCache
    logits: torch.Tensor
    feats: torch.Tensor
    layer_ids: Tuple[int, ...]
    all_rows: bool
    t: int
    ms: float

    def fresh_cache(self, room: int = 0) -> DynamicCache:
        """A copy of the cache for one loop, with room for `room` more positions."""
        return loop_cache(self.cache, room, copy_of=True)

    def features(self, layer_ids: Sequence[int], needs_history: bool) -> torch.Tensor:
        """What a drafter reading `layer_ids` starts from: every position for a drafter
        with a history (DSpark-style), the last one otherwise."""
        if not layer_ids:
            return torch.zeros(0, 0)
        missing = sorted(set(layer_ids) - set(self.layer_ids))
        if missing:
            raise ValueError(f"this prefill captured layers {list(self.layer_ids)}, not {missing}")
        if needs_history and not self.all_rows:
            raise ValueError("this prefill kept the last position only; the drafter reads every position")
        width = self.feats.shape[-1] // len(self.layer_ids)
        f = torch.cat([self.feats[:, j * width:(j + 1) * width]
                       for j in map(self.layer_ids.index, layer_ids)], dim=-1)
        return f if needs_history else f[-1:]


def loop_cache(cache: DynamicCache, room: int, copy_of: bool) -> DynamicCache:
    """The cache a loop decodes into: a prefill's `cache` (a copy when `copy_of`), with
    room for `room` more positions written in place (`dlite.decoding.slack`: no step
    copies the history, in the plain loop as in the speculative ones). A target's own
    kind of cache (`new_cache()`, where transformers may not be installed) is kept."""
    if not type(cache).__module__.startswith("transformers"):
        return copy.deepcopy(cache) if copy_of else cache
    from dlite.decoding.slack import with_room
    return with_room(cache, room, copy_of)


@torch.inference_mode()
def prefill(target, prompt_ids, layer_ids: Sequence[int] = (), all_rows: bool = False) -> Prefill:
    """Run the prompt once, capturing `layer_ids` (any order; kept sorted, distinct) at
    every position when `all_rows`, else at the last one only (a long prefill then never
    holds all rows for drafters that read one)."""
    dev = _device(target)
    prompt, ids = _as_ids(prompt_ids, dev), tuple(sorted({int(i) for i in layer_ids}))
    with LayerCapture(target, list(ids)) as cap:
        cap.last_only = not all_rows
        cache = new_cache(target)
        t0 = time.perf_counter()
        logits = target_forward(target, prompt, 0, cache, logits_to_keep=1)[-1]
        _sync(dev)
        ms = (time.perf_counter() - t0) * 1e3
        feats = cap.features()
    return Prefill(cache, logits, feats, ids, all_rows, prompt.shape[0], ms)


def _tree_round(target, drafter, cap, cache, state, feats, anchor: int, t: int, sampling: dict):
    """One round of a drafter proposing several branches (`draft_tree`): merged into a
    token tree, verified in one forward (`dlite.decoding.tree`), the accepted path's
    cache kept. Returns what `_round` does, the record's extras last."""
    dev = _device(target)
    t0 = time.perf_counter()
    branches, state = drafter.draft_tree(state, feats, anchor, t, sampling["temperature"], sampling["generator"])
    tree = build_tree(anchor, branches)
    _sync(dev)
    t1 = time.perf_counter()
    mask = tree_mask(tree, t, target.dtype, dev)
    logits = target_forward(target, torch.tensor(tree.tokens, device=dev), t, cache,
                            position_ids=tree_positions(tree, t, dev), attention_mask=mask)
    _sync(dev)
    t2 = time.perf_counter()
    path, nxt = verify_tree(tree, branches, logits, **sampling)
    keep_path(cache, t, [0] + path)
    f = cap.features()
    last = path[-1] if path else 0
    emit = [tree.tokens[n] for n in path] + [nxt]
    state, extra = drafter.tree_verified(state, branches, emit)
    depth = max([len(b.tokens) for b in branches] or [0])
    return (emit, len(path), f[last: last + 1], state, depth, (t1 - t0) * 1e3, (t2 - t1) * 1e3,
            {"verified": tree.size, **extra})


def _round(target, drafter, cap, cache, state, feats, anchor: int, t: int, sampling: dict):
    """One draft + verify round. Returns (tokens to emit, accepted a, new features,
    drafter state, drafted n, draft_ms, verify_ms, extras for the round record). A
    drafter may propose fewer than gamma tokens, even none (the round is then one plain
    target step)."""
    if hasattr(drafter, "draft_tree"):
        return _tree_round(target, drafter, cap, cache, state, feats, anchor, t, sampling)
    dev = _device(target)
    t0 = time.perf_counter()
    tokens, probs, state = drafter.draft(state, feats, anchor, t, sampling["temperature"],
                                         sampling["generator"])
    tokens = tokens.reshape(-1).to(dev)
    _sync(dev)
    t1 = time.perf_counter()
    block = torch.cat([torch.tensor([anchor], device=dev), tokens])
    logits = target_forward(target, block, t, cache)
    _sync(dev)
    t2 = time.perf_counter()
    probs = probs.to(dev) if probs is not None else None  # greedy never reads them
    a, nxt = verify_block(tokens, probs, logits, **sampling)
    crop_cache(cache, t + a + 1)
    f = cap.features()
    feats = f[: a + 1] if drafter.needs_history else f[a: a + 1]
    extra = drafter.round_info(state) if hasattr(drafter, "round_info") else {}
    return (tokens[:a].tolist() + [nxt], a, feats, state, tokens.numel(), (t1 - t0) * 1e3,
            (t2 - t1) * 1e3, {"verified": tokens.numel(), **extra})


@torch.inference_mode()
def speculative_generate(target, drafter, prompt_ids, max_new_tokens: int, temperature: float = 0.0,
                         top_p: float = 1.0, top_k: int = 0, eos_ids: Sequence[int] = (),
                         generator: Optional[torch.Generator] = None,
                         prefilled: Optional[Prefill] = None) -> Tuple[List[int], List[dict]]:
    """Generate up to `max_new_tokens` tokens (stopping after an EOS) with `drafter`,
    starting from a copy of `prefilled` (this prompt's `prefill`) when given.
    Returns (new token ids, one record per round: context_len, accepted, drafted,
    emitted, draft_ms, verify_ms, other_ms, cache_bytes, verified (draft tokens the
    target checked: a tree's nodes), and what a hybrid adds: `source`, `branches`).
    The prefill's token is not a round."""
    eos = {int(e) for e in eos_ids}
    out, rounds = [], []
    if max_new_tokens <= 0:
        return out, rounds
    sampling = dict(temperature=temperature, top_p=top_p, top_k=top_k, generator=generator)
    layers, history = drafter.target_layer_ids, drafter.needs_history
    pre = prefilled or prefill(target, prompt_ids, layers, history)
    with LayerCapture(target, layers) as cap:
        cache = loop_cache(pre.cache, max_new_tokens + ROOM, copy_of=prefilled is not None)
        feats = pre.features(layers, history)
        t, anchor, state = pre.t, sample_token(pre.logits, **sampling), _new_state(drafter, prompt_ids)
        done = _extend(out, [anchor], eos, max_new_tokens)
        while not done:
            start = time.perf_counter()
            emit, a, feats, state, n, d_ms, v_ms, extra = _round(target, drafter, cap, cache, state, feats,
                                                       anchor, t, sampling)
            n_before = len(out)
            done = _extend(out, emit, eos, max_new_tokens)
            total_ms = (time.perf_counter() - start) * 1e3
            rounds.append(dict(context_len=t, accepted=a, drafted=n, emitted=len(out) - n_before,
                               draft_ms=d_ms, verify_ms=v_ms, other_ms=total_ms - d_ms - v_ms,
                               cache_bytes=int(drafter.cache_bytes(state)), **extra))
            t, anchor = t + a + 1, emit[-1]
        if hasattr(drafter, "finish"):  # e.g. SuffixDecoding indexes the whole response
            drafter.finish(state, out)
    return out, rounds


@torch.inference_mode()
def plain_generate(target, prompt_ids, max_new_tokens: int, temperature: float = 0.0,
                   top_p: float = 1.0, top_k: int = 0, eos_ids: Sequence[int] = (),
                   generator: Optional[torch.Generator] = None,
                   prefilled: Optional[Prefill] = None) -> Tuple[List[int], dict]:
    """Plain autoregressive decoding with the same cache and stopping rules, starting
    from a copy of `prefilled` when given (whose `ms` is then the reported prefill time).
    Returns (new token ids, {prefill_ms, decode_ms, steps}); decode_ms counts from the
    first token on (as the speculative loop's rounds)."""
    dev, eos = _device(target), {int(e) for e in eos_ids}
    out: List[int] = []
    timing = dict(prefill_ms=0.0, decode_ms=0.0, steps=0)
    if max_new_tokens <= 0:
        return out, timing
    sampling = dict(temperature=temperature, top_p=top_p, top_k=top_k, generator=generator)
    pre = prefilled or prefill(target, prompt_ids)
    cache = loop_cache(pre.cache, max_new_tokens + ROOM, copy_of=prefilled is not None)
    tok = sample_token(pre.logits, **sampling)
    t1 = time.perf_counter()
    done, t = _extend(out, [tok], eos, max_new_tokens), pre.t
    while not done:
        logits = target_forward(target, torch.tensor([tok], device=dev), t, cache)
        tok, t = sample_token(logits[-1], **sampling), t + 1
        done = _extend(out, [tok], eos, max_new_tokens)
        timing["steps"] += 1
    timing.update(prefill_ms=pre.ms, decode_ms=(time.perf_counter() - t1) * 1e3)
    return out, timing
