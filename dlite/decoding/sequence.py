"""The token sequence, rebuilt by a drafter that reads tokens rather than (or besides)
the target's features: the decoding loop only passes the anchor and its position, so
between two `draft` calls the drafter infers what was accepted -- a prefix of its own
previous draft of `anchor_pos - previous_anchor_pos - 1` tokens, then the previous
anchor before it. Shared by prompt lookup, the hybrid and the target-as-drafter oracle."""

from typing import List, Sequence


class AcceptedSequence:
    """Tokens at positions 0..anchor_pos-1 of the sequence being decoded."""

    def __init__(self, prompt_ids: Sequence[int]):
        self.ids: List[int] = [int(x) for x in prompt_ids]
        self._anchor = None
        self._anchor_pos = None
        self._draft: List[int] = []

    def advance(self, anchor_id: int, anchor_pos: int) -> List[int]:
        """Append what the last round accepted; returns the tokens before the anchor
        (the live list: read it, do not keep it)."""
        if self._anchor_pos is not None:
            a = anchor_pos - self._anchor_pos - 1
            if not 0 <= a <= len(self._draft):
                raise ValueError(f"anchor moved from {self._anchor_pos} to {anchor_pos} "
                                 f"with a draft of {len(self._draft)}")
            self.ids += [self._anchor] + self._draft[:a]
        if len(self.ids) != anchor_pos:
            raise ValueError(f"rebuilt {len(self.ids)} tokens before the anchor, expected {anchor_pos}")
        self._anchor, self._anchor_pos, self._draft = int(anchor_id), anchor_pos, []
        return self.ids

    def drafted(self, tokens: Sequence[int]) -> None:
        """What this round proposes (the accepted part is read back at the next advance)."""
        self._draft = [int(x) for x in tokens]
