"""The drafter models: DLite (history-free), the history-aware teacher and the
DSpark-style baseline, picked by `DrafterConfig.arch` from one table."""

import torch

from dlite.models.common import Drafter, param_count
from dlite.models.config import DrafterConfig
from dlite.models.drafter import DLiteDrafter
from dlite.models.dspark import DSparkDrafter
from dlite.models.teacher import HistoryTeacher, init_student_from_teacher

ARCHS = {"dlite": DLiteDrafter, "teacher": HistoryTeacher, "dspark": DSparkDrafter}


def build_drafter(cfg: DrafterConfig, embed_weight: torch.Tensor, lm_head_weight: torch.Tensor,
                  mask_token_id: int):
    """Build the model named by cfg.arch around the target's frozen embedding / lm_head."""
    if cfg.arch not in ARCHS:
        raise ValueError(f"drafter.arch must be one of {sorted(ARCHS)}, got {cfg.arch!r}")
    return ARCHS[cfg.arch](cfg, embed_weight, lm_head_weight, mask_token_id)


__all__ = ["ARCHS", "DLiteDrafter", "DSparkDrafter", "Drafter", "DrafterConfig", "HistoryTeacher",
           "build_drafter", "init_student_from_teacher", "param_count"]
