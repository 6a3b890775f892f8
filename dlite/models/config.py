"""The drafter's architecture config: one dataclass shared by DLite, the teacher and
the DSpark-style baseline, so a student can be built from a teacher's config and the
run config (`dlite.config`) embeds it unchanged as its `drafter` section."""

import sysconfig
from dataclasses import dataclass, field
from pathlib import Path
from typing import List, Optional

DRAFT_VOCAB_PRIORS = ("low_ids", "python_stdlib")


def prior_root(prior: str) -> Optional[Path]:
    """Where `draft_vocab_prior` reads its text: None for "low_ids" (no text), this
    interpreter's standard-library directory for "python_stdlib", else the given file or
    directory. The one rule the config check and the vocabulary builder share; raises
    ValueError naming the key when the path does not exist."""
    if prior == "low_ids":
        return None
    root = Path(sysconfig.get_paths()["stdlib"]) if prior == "python_stdlib" else Path(prior)
    if not root.exists():
        raise ValueError(f"drafter.draft_vocab_prior: {prior!r} is neither one of "
                         f"{DRAFT_VOCAB_PRIORS} nor an existing text file or directory")
    return root


@dataclass
class DrafterConfig:
    # Which architecture: "dlite" (history-free), "teacher" (DLite + history KV),
    # "dspark" (history KV + logit-space Markov head), "dlite_v1" (the authors' published
    # design, `dlite.models.dlite_v1`: one context slot per target layer, own r -> V head).
    arch: str = "dlite"
    # gamma = number of drafted tokens per round; the block is [anchor, MASK x (gamma-1)].
    gamma: int = 7
    # Target layers whose raw decoder-layer outputs form the context feature
    # (concatenated). Negative ids are not allowed; ids index decoder layers 0..L-1.
    target_layer_ids: List[int] = field(default_factory=lambda: [0, 1])
    # Backbone size.
    hidden_size: int = 256
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 64
    intermediate_size: int = 768
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    # How the context feature enters the backbone: "kv" = the K layers fused into one
    # extra key/value every layer attends to; "add" = that state added to every slot's
    # input embedding; "slots" = one key/value per target layer (a shared projection
    # plus a depth embedding: the published design's context at this width).
    context_injection: str = "kv"
    # Sequential head: "gru" (default), "attn" (one causal attention layer), "none" --
    # all in hidden space through the target's lm_head (and the draft vocabulary);
    # "rank" = the published recurrent head of rank `sequential_rank` with its own V x r
    # embedding and r -> V output (full vocabulary: draft_vocab_size must be null).
    head: str = "gru"
    head_hidden: int = 256
    # DSpark-style baseline only: rank of the logit-space Markov head.
    markov_rank: int = 64
    # Draft vocabulary: project onto these N most useful target tokens instead of the
    # whole vocabulary (ids chosen from the training data by
    # `dlite.data.draft_vocab.build_draft_vocab`, kept with the artifact). None: all V.
    draft_vocab_size: Optional[int] = None
    # What fills the draft vocabulary after the training data's tokens
    # (`dlite.data.draft_vocab.prior_order`): "low_ids" (the earliest BPE merges),
    # "python_stdlib" (token frequency over this interpreter's standard-library source:
    # code text a coding agent reads and writes), or a path to a text file / directory.
    draft_vocab_prior: str = "low_ids"
    # dlite_v1 only. Real tokens leading its query block: 2 = [anchor-1, anchor], 1 = [anchor].
    anchor_group_size: int = 2
    # dlite_v1 only: rank r of its recurrent sequential head (token embedding V x r,
    # output projection r -> V). Its context layers are `target_layer_ids` (one slot each).
    sequential_rank: int = 256
    # dlite_v1 only: the published teacher ("swa_teacher"): the same model whose block
    # also attends to the projected features of the history before the anchor.
    v1_teacher: bool = False
    # Teacher only: the history it attends to is the last `history_window` positions
    # before the anchor (the authors' sliding-window teacher: 512); null = all of it.
    history_window: Optional[int] = None
