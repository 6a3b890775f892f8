"""The verification rule of speculative decoding (DLITE.md §1), as pure functions.

Greedy: accept drafts while they equal the target's argmax; the next token is the
target's argmax at the first mismatch (or the bonus after the last draft).
Sampling: accept draft x with probability min(1, p(x)/q(x)); on the first rejection
sample from the normalised residual max(0, p - q); if all γ pass, sample a bonus from
p. The output then follows p exactly, whatever q is.

Temperature / top-p / top-k. `process_logits` (temperature, then `warp_probs`: top-k,
then top-p, renormalised) turns target logits into p, and `plain_generate` samples
through the same function, so "the target's distribution" means the same thing in
both loops. The drafter's probs q are used AS RETURNED, never re-warped here: the
rule is exact only when q is the distribution each draft token was actually drawn
from, and drafters sample at their temperature without top-p/top-k (see
`dlite.models.common.sample_block`). Truncating q after the fact would break
exactness (a drawn token could get q'(x) = 0). A drafter that wants the identical
warp applies `warp_probs` to its own probs before sampling and returns the warped q;
the rule below is then unchanged. Greedy decoding ignores top-p/top-k (the argmax
always survives both)."""

from typing import Callable, Optional, Tuple

import torch


def warp_probs(probs: torch.Tensor, top_p: float = 1.0, top_k: int = 0) -> torch.Tensor:
    """Keep the top-k, then the smallest top set whose mass reaches top_p; renormalise.
    Works on [..., V]; with top_p >= 1 and top_k <= 0 it returns `probs` unchanged."""
    if top_k and 0 < top_k < probs.shape[-1]:
        kth = probs.topk(top_k, dim=-1).values[..., -1:]
        probs = probs.masked_fill(probs < kth, 0.0)
    if top_p < 1.0:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        csum = sorted_p.cumsum(-1)
        # Drop a token when the mass strictly before it already reaches top_p, so the
        # token that crosses the threshold is kept (HF's convention) and the top one always is.
        drop_sorted = (csum - sorted_p) >= top_p * csum[..., -1:]
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
    if (top_k and 0 < top_k < probs.shape[-1]) or top_p < 1.0:
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def process_logits(logits: torch.Tensor, temperature: float, top_p: float = 1.0,
                   top_k: int = 0) -> torch.Tensor:
    """Target logits [..., V] -> sampling distribution p (float32). Needs temperature > 0."""
    if temperature <= 0:
        raise ValueError("process_logits needs temperature > 0 (greedy uses argmax)")
    return warp_probs(torch.softmax(logits.float() / temperature, dim=-1), top_p, top_k)


def sample_token(logits: torch.Tensor, temperature: float, top_p: float = 1.0, top_k: int = 0,
                 generator: Optional[torch.Generator] = None) -> int:
    """One token from logits [V]: argmax at temperature 0, else from `process_logits`."""
    if temperature <= 0:
        return int(logits.argmax(-1))
    p = process_logits(logits, temperature, top_p, top_k)
    return int(torch.multinomial(p, 1, generator=generator))


def residual_distribution(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Normalised max(0, p - q). Falls back to p when the residual has no mass, which
    only happens when p == q up to rounding (and then a rejection is itself ~impossible)."""
    r = (p - q).clamp_min(0.0)
    total = r.sum()
    return r / total if total > 0 else p


def _leading_true(mask: torch.Tensor) -> int:
    """Length of the all-True prefix of a 1-D bool tensor (one host sync)."""
    return int(mask.long().cumprod(0).sum())


def verify_greedy(draft_tokens: torch.Tensor, target_logits: torch.Tensor) -> Tuple[int, int]:
    """draft_tokens [γ], target_logits [γ+1, V] (row j judges draft j+1) -> (a, next)."""
    best = target_logits.argmax(-1)
    a = _leading_true(draft_tokens == best[: draft_tokens.shape[0]])
    return a, int(best[a])


def verify_sampling(draft_tokens: torch.Tensor, draft_probs: torch.Tensor,
                    target_probs: torch.Tensor, generator: Optional[torch.Generator] = None,
                    residual: Optional[Callable] = None) -> Tuple[int, int]:
    """draft_tokens [γ], draft_probs q [γ, V], target_probs p [γ+1, V] -> (a, next).

    `residual` is looked up at call time (default `residual_distribution`) so tests can
    swap in a wrong one and check that the statistics notice."""
    residual = residual or residual_distribution
    g = draft_tokens.shape[0]
    rows = torch.arange(g, device=draft_tokens.device)
    p_x, q_x = target_probs[rows, draft_tokens], draft_probs[rows, draft_tokens]
    # u < p/q written as u*q < p: no division, and q(x) = 0 (impossible for a token
    # drawn from q) degrades to "accept iff p(x) > 0" instead of a NaN.
    u = torch.rand(g, generator=generator, device=draft_tokens.device)
    a = _leading_true(u * q_x < p_x)
    dist = target_probs[a] if a == g else residual(target_probs[a], draft_probs[a])
    return a, int(torch.multinomial(dist, 1, generator=generator))


def verify_block(draft_tokens: torch.Tensor, draft_probs: torch.Tensor, target_logits: torch.Tensor,
                 temperature: float, top_p: float = 1.0, top_k: int = 0,
                 generator: Optional[torch.Generator] = None) -> Tuple[int, int]:
    """The rule for one round: greedy at temperature 0, else rejection sampling against
    p = process_logits(target_logits). Returns (accepted drafts a, next token)."""
    if temperature <= 0:
        return verify_greedy(draft_tokens, target_logits)
    p = process_logits(target_logits, temperature, top_p, top_k)
    return verify_sampling(draft_tokens, draft_probs.float(), p, generator)
