"""Greedy divergences at target ties: is a speculative output that parts from plain
decoding a bug, or the target's own rounding?

A bf16 (or fp16) forward's logits depend on the forward's shape: a 1-token decode step,
a verification block and a prefill round differently (measured: up to ~0.2 on logits of
~8, where one bf16 spacing is 0.0625). Where the two top logits are tied within that
noise, plain and speculative greedy decoding may legitimately pick different tokens.
`divergence` classifies a task's FIRST mismatch (everything after it differs anyway):
one extra target prefill over prompt + plain[:k] gives the two tokens' logits, and the
mismatch is a *tie* when they lie within `TIE_ULPS` spacings of the target's dtype at
that magnitude. For an fp32 target the same rule is effectively strict.

`lossless_rule` / `lossless_verdict` say which of a report's `lossless` (strict, token
identical) and `lossless_up_to_ties` decides for a target dtype."""

import math
from typing import Optional, Sequence

import torch

from dlite.decoding.decode import new_cache, target_forward

TIE_ULPS = 8  # spacings between two logits that count as a tie (measured bf16 noise: <= 4)
_SHORT = {"bfloat16": "bf16", "float16": "fp16"}


def spacing(value: float, dtype: torch.dtype) -> float:
    """One unit in the last place of `dtype` at |value| (floored at 1e-3 so that a zero
    logit still has a spacing)."""
    return torch.finfo(dtype).eps * 2.0 ** math.floor(math.log2(max(abs(value), 1e-3)))


def classify(logits: torch.Tensor, spec_token: int, plain_token: int, dtype: torch.dtype,
             ulps: int = TIE_ULPS) -> dict:
    """{logit_gap, tol, tie} for the two tokens' logits in `logits` [V], judged in `dtype`."""
    a, b = logits[plain_token].float().item(), logits[spec_token].float().item()
    tol = ulps * spacing(max(abs(a), abs(b)), dtype)
    return {"logit_gap": abs(a - b), "tol": tol, "tie": abs(a - b) <= tol}


def first_mismatch(spec: Sequence[int], plain: Sequence[int]) -> Optional[int]:
    """Index of the first position where the outputs differ (a missing token counts),
    None when they are identical."""
    for k in range(max(len(spec), len(plain))):
        if k >= len(spec) or k >= len(plain) or spec[k] != plain[k]:
            return k
    return None


def mismatch_at(spec: Sequence[int], plain: Sequence[int]) -> Optional[dict]:
    """{index, spec, plain} at the first mismatch (a token past an output's end is None),
    None when the outputs are identical."""
    k = first_mismatch(spec, plain)
    if k is None:
        return None
    return {"index": k, "spec": spec[k] if k < len(spec) else None,
            "plain": plain[k] if k < len(plain) else None}


def divergence(target, prompt_ids: Sequence[int], spec: Sequence[int], plain: Sequence[int],
               ulps: int = TIE_ULPS) -> Optional[dict]:
    """None when spec == plain, else {index, spec, plain, logit_gap, tol, tie} at the
    first mismatch (one fresh prefill of prompt + plain[:index], the plain path's call)."""
    out = mismatch_at(spec, plain)
    if out is None:
        return None
    if out["spec"] is None or out["plain"] is None:
        # One output stopped where the other went on (same budget, same EOS): no pair of
        # tokens a tie could explain.
        return {**out, "logit_gap": None, "tol": None, "tie": False}
    param = next(target.parameters())
    ids = torch.as_tensor(list(prompt_ids) + list(plain[:out["index"]]), dtype=torch.long, device=param.device)
    with torch.inference_mode():
        logits = target_forward(target, ids, 0, new_cache(target), logits_to_keep=1)[-1]
    return {**out, **classify(logits, out["spec"], out["plain"], param.dtype, ulps)}


def lossless_rule(target_dtype) -> str:
    """"exact" for an fp32 (or fp64) target; "up_to_ties(bf16)" / "up_to_ties(fp16)" for a
    low-precision one, whose shape-dependent rounding can part outputs at a tie."""
    name = str(target_dtype).replace("torch.", "")
    return "exact" if name in ("float32", "float64") else f"up_to_ties({_SHORT.get(name, name)})"


def lossless_verdict(report: dict, target_dtype) -> Optional[bool]:
    """The report's (or a method's) losslessness under `lossless_rule(target_dtype)`:
    strict `lossless`, or `lossless_up_to_ties` for a low-precision target. A report
    written before ties were classified has no `lossless_up_to_ties` (None): strict then."""
    strict, up_to_ties = report.get("lossless"), report.get("lossless_up_to_ties")
    if lossless_rule(target_dtype) == "exact" or up_to_ties is None:
        return strict
    return up_to_ties
