"""Collection's target states, captured while the target regenerates a conversation
(`data.regen_features`). Regeneration prefills every token of a conversation's trunk on
the conversation's own KV cache, turn by turn (`dlite.decoding.regenerate`): the same
states collection would compute again in its own forward over the same tokens. So:

  prefill  `StateCapture.prefill` runs a regeneration prefill through
           `TargetFeatures.cached_forward` and keeps the captured layers' and the final
           norm's states per position of the row's cache (`RowStates`; positions the
           decode steps fed have none, so the next prefill re-runs them instead);
  finish   `StateCapture.finish`: the conversation's training rows, made by collection's
           own `render.training_rows`; each row's trunk is read from the kept states as
           far as the cache holds the same tokens, the rest of it and every branch run
           on that cache (`TargetFeatures.forked`), so only the answers and the trunk's
           last turn are run again. The rows carry collection's stored arrays
           (`features._stored`), which `collect` takes instead of its forward when its
           own rows are the same (`pipelines/stages/collect.py`).

Exactness: a kept state reads the same tokens at the same positions as collection's
one-forward trunk; the two differ in the last float bits (a prefill in pieces sums in
another order), as regeneration's batched steps differ from batch 1's.
torch only: the Ray stage (pipelines/stages/regenerate.py) writes the rows."""

from typing import Callable, List, Optional

import numpy as np
import torch

from dlite.data.features import TargetFeatures, _stored
from dlite.data.formats import Quarantine
from dlite.target.cache import crop_cache


def common_prefix(a: List[int], b: List[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


class RowStates:
    """The kept states of one row's cache positions [0, n): never written in place, so a
    head shares storage safely."""

    def __init__(self, feats: Optional[torch.Tensor] = None, final: Optional[torch.Tensor] = None):
        self.feats, self.final = feats, final

    @property
    def n(self) -> int:
        return 0 if self.feats is None else len(self.feats)

    def put(self, start: int, feats: torch.Tensor, final: torch.Tensor) -> None:
        """Positions start.. are these (whatever was kept from `start` on is dropped)."""
        if start > self.n:
            raise ValueError(f"states from position {start}, but only {self.n} are kept")
        if self.feats is None:
            self.feats, self.final = feats, final
        else:
            self.feats = torch.cat([self.feats[:start], feats])
            self.final = torch.cat([self.final[:start], final])

    def head(self, n: int) -> "RowStates":
        return RowStates(self.feats[:n], self.final[:n]) if n else RowStates()


class StateCapture:
    """What the regenerator calls when collection's states are kept (see the module
    docstring). `rows(record)`: the training rows collection makes of a finished record
    (raises Quarantine); `spec`: collection's storage_mode, reference, topk, gamma."""

    def __init__(self, model, layer_ids, spec: dict, rows: Callable[[dict], list]):
        self.tf, self.spec, self.rows = TargetFeatures(model, layer_ids), spec, rows
        self.lm_head = model.get_output_embeddings()

    def prefill(self, states: RowStates, ids: torch.Tensor, start: int, cache) -> torch.Tensor:
        """The next token's logits [V] after `ids` at positions start.. on `cache`; their
        states kept in `states`."""
        feats, final = self.tf.cached_forward(ids, start, cache)
        states.put(start, feats.cpu(), final.cpu())  # host memory: a GPU keeps only the caches
        return self.lm_head(final[-1:])[0]

    @torch.no_grad()
    def finish(self, states: RowStates, record: dict, cache, cache_ids: List[int]) -> tuple:
        """(the record's training rows with their stored arrays, positions read from kept
        states, positions run here). No rows where collection would quarantine the record,
        or a row's states overflow float16: collection then runs or quarantines it itself.
        `cache` holds `cache_ids`, of which the first `states.n` have kept states; it is
        cropped and extended here (the row is done)."""
        try:
            seqs = self.rows(record)
        except Quarantine:
            return [], 0, 0
        valid, out, kept, ran = list(cache_ids[:states.n]), [], 0, 0
        for s in seqs:
            ids = list(s["input_ids"])
            br = s.get("branch_ids")
            br = np.zeros(len(ids), dtype=np.int64) if br is None else np.asarray(br)
            pos = s.get("position_ids")
            pos = np.arange(len(ids)) if pos is None else np.asarray(pos)
            trunk = ids[:int((br == 0).sum())]
            c = common_prefix(valid, trunk)
            crop_cache(cache, c)
            known = (states.feats[:c], states.final[:c]) if c else None
            feats, final = self.tf.forked(ids, pos, br, cache, known)
            kept, ran = kept + c, ran + len(ids) - c
            # the next part may share this trunk's start: its states, the branches dropped
            crop_cache(cache, len(trunk))
            states, valid = RowStates(feats[:len(trunk)], final[:len(trunk)]), trunk
            arrays = _stored(self.tf, feats, final, len(ids), s["anchors"], self.spec)
            if "error" not in arrays:
                out.append({**s, **arrays})
        return out, kept, ran
