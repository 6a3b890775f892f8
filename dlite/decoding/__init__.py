"""Speculative decoding against a real target: the verification rule (`verify`), layer
feature capture by hooks (`capture`), the decoding loop and its plain baseline
(`decode`), reference drafters (`oracle`), metrics (`metrics`) and trajectory replay
with the report of DLITE.md §4 (`replay`); training-free drafters (`lookup`, `suffix`)
and the hybrids pairing them with a learned drafter (`lookup`'s match-length rule;
`hybrid`: choose by calibrated value per verify cost, or verify both as a token tree,
`tree`; calibration in `calibration` / `calibrate`)."""

from dlite.decoding.capture import LayerCapture
from dlite.decoding.decode import crop_cache, new_cache, plain_generate, speculative_generate
from dlite.decoding.metrics import accept_at_k, bucket_labels, summarize_rounds, tau
from dlite.decoding.oracle import RandomDrafter, TargetAsDrafter
from dlite.decoding.replay import EvalArgs, evaluate_prompts, iter_tasks
from dlite.decoding.verify import (process_logits, sample_token, verify_block, verify_greedy,
                               verify_sampling, warp_probs)

__all__ = [
    "LayerCapture", "crop_cache", "new_cache", "plain_generate", "speculative_generate",
    "accept_at_k", "bucket_labels", "summarize_rounds", "tau", "RandomDrafter",
    "TargetAsDrafter", "EvalArgs", "evaluate_prompts", "iter_tasks", "process_logits",
    "sample_token", "verify_block", "verify_greedy", "verify_sampling", "warp_probs",
]
