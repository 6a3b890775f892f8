"""The drafter models: DLite (history-free), the history-aware teacher, the
DSpark-style baseline and the authors' published design (`dlite_v1`), picked by
`DrafterConfig.arch` from one table."""

import torch

from dlite.models.common import LEARNED_MASK, Drafter, param_count
from dlite.models.config import DrafterConfig
from dlite.models.drafter import DLiteDrafter
from dlite.models.dlite_v1 import DLiteV1Drafter
from dlite.models.dspark import DSparkDrafter
from dlite.models.teacher import HistoryTeacher, init_student_from_teacher

ARCHS = {"dlite": DLiteDrafter, "teacher": HistoryTeacher, "dspark": DSparkDrafter,
         "dlite_v1": DLiteV1Drafter}


def build_drafter(cfg: DrafterConfig, embed_weight: torch.Tensor, lm_head_weight: torch.Tensor,
                  mask_token_id: int, draft_vocab=None, **target_parts):
    """Build the model named by cfg.arch around the target's frozen embedding / lm_head.
    `mask_token_id` = LEARNED_MASK when the target has no spare row for MASK;
    `draft_vocab` = the sorted target ids of the draft vocabulary (cfg.draft_vocab_size
    of them), or None for the full vocabulary. `target_parts`: further frozen target
    tensors an architecture reads (dlite_v1: `final_norm_weight`)."""
    if cfg.arch not in ARCHS:
        raise ValueError(f"drafter.arch must be one of {sorted(ARCHS)}, got {cfg.arch!r}")
    return ARCHS[cfg.arch](cfg, embed_weight, lm_head_weight, mask_token_id, draft_vocab, **target_parts)


__all__ = ["ARCHS", "LEARNED_MASK", "DLiteDrafter", "DLiteV1Drafter", "DSparkDrafter", "Drafter",
           "DrafterConfig", "HistoryTeacher", "build_drafter", "init_student_from_teacher", "param_count"]
