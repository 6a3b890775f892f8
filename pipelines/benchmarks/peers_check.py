"""Our replay of a SpecForge DFlash export (`dlite.models.dflash_peer`, through
`dlite.decoding.decode.speculative_generate`) against SpecForge's own decode loop
(`DFlashDraftModel.spec_generate`, its class, loaded by its `from_pretrained`), greedy,
prompt by prompt: the accepted length of every round, and both outputs against plain
greedy decoding (issue 31). The only module here that imports specforge.

`spec_generate` does not return its accepted lengths, so they are read off its target
calls: a hook records each verification's block and the target's argmax, and the
accepted length is the matching prefix (theirs: `(block[1:] == posterior[:-1]).cumprod`);
the next call's start position confirms it. Its loop runs while the output is shorter
than `max_new_tokens + 1`, ours until it is `max_new_tokens` long, so it may verify one
round more at the end; that round is reported, not compared.

Patch P1 (run time, only inside `spec_loop`): transformers 5.24's `DynamicCache.crop(n)`
raises for n > 0 (it removes -n tokens; 4.x and SpecForge's pinned 5.8.1 path read a
positive n as the length to keep), and `spec_generate` crops with positive lengths; its
module's `DynamicCache` is swapped for a subclass reading a positive n as before."""

import contextlib
from typing import List, Sequence

import torch

PATCHES = {"P1": "specforge.modeling.draft.dflash.DynamicCache: crop(n > 0) keeps the first n "
                 "positions (transformers 5.24 raises; run time, inside spec_generate only)"}


@contextlib.contextmanager
def spec_loop():
    """SpecForge's dflash module with patch P1 applied for the duration."""
    import specforge.modeling.draft.dflash as sf_dflash
    base = sf_dflash.DynamicCache

    class KeepCrop(base):
        def crop(self, n: int) -> None:
            if n > 0:  # a length to keep, as 4.x read it; nothing to do past the end
                n = n - self.get_seq_length()
                if n >= 0:
                    return
            super().crop(n)

    sf_dflash.DynamicCache = KeepCrop
    try:
        yield sf_dflash
    finally:
        sf_dflash.DynamicCache = base


class _VerifyLog:
    """Forward hooks on the target recording, per call after the prefill, the start
    position, the block and the argmax of its logits."""

    def __init__(self, target):
        self.calls: List[dict] = []
        self._handle = target.register_forward_hook(self._hook, with_kwargs=True)

    def _hook(self, module, args, kwargs, out):
        ids = kwargs.get("input_ids", args[0] if args else None)
        pos = kwargs["position_ids"]
        self.calls.append({"start": int(pos[0, 0]), "ids": ids[0].clone(), "post": out.logits[0].argmax(-1)})

    def accepted(self) -> List[int]:
        """Accepted drafts per verification (prefill excluded); start diffs must agree."""
        rounds = self.calls[1:]
        acc = [int((c["ids"][1:] == c["post"][:-1]).long().cumprod(0).sum()) for c in rounds]
        for a, c, nxt in zip(acc, rounds, rounds[1:]):
            if nxt["start"] - c["start"] != a + 1:
                raise RuntimeError(f"spec_generate moved {nxt['start'] - c['start']} positions after "
                                   f"accepting {a}: the log misreads its loop")
        return acc

    def close(self):
        self._handle.remove()


def load_theirs(export_dir, target):
    """The export as SpecForge's own DFlashDraftModel, in the target's dtype."""
    from specforge.modeling.draft.dflash import DFlashDraftModel
    return DFlashDraftModel.from_pretrained(str(export_dir), dtype=target.dtype).eval()


def theirs(model, target, prompt_ids: Sequence[int], max_new: int, eos: Sequence[int]):
    """(new tokens, accepted per round) from SpecForge's spec_generate, greedy."""
    ids = torch.tensor([list(prompt_ids)])
    log = _VerifyLog(target)
    try:
        with spec_loop():
            out = model.spec_generate(target, ids, max_new, list(eos), temperature=0.0)
    finally:
        log.close()
    return out[0, ids.shape[1]:].tolist(), log.accepted()


def compare(export_dir, target, drafter, prompts: Sequence[Sequence[int]], max_new: int,
            eos: Sequence[int]) -> dict:
    """Per prompt: ours vs theirs accepted lengths round by round, both outputs vs plain."""
    from dlite.decoding.decode import plain_generate, prefill, speculative_generate
    rows, model = [], load_theirs(export_dir, target)
    for p in prompts:
        pre = prefill(target, p, drafter.target_layer_ids, all_rows=True)
        plain, _ = plain_generate(target, p, max_new, eos_ids=eos, prefilled=pre)
        ours, rounds = speculative_generate(target, drafter, p, max_new, eos_ids=eos, prefilled=pre)
        their_out, their_acc = theirs(model, target, p, max_new, eos)
        our_acc = [r["accepted"] for r in rounds]
        rows.append({"context": len(p), "ours_accepted": our_acc, "theirs_accepted": their_acc,
                     "same_accepts": their_acc[:len(our_acc)] == our_acc and len(their_acc) - len(our_acc) in (0, 1),
                     "ours_equal_plain": ours == plain, "theirs_equal_plain": their_out == plain})
    ok = all(r["same_accepts"] and r["ours_equal_plain"] and r["theirs_equal_plain"] for r in rows)
    rounds = sum(len(r["ours_accepted"]) for r in rows)
    return {"prompts": len(rows), "rounds": rounds, "all_agree": ok,
            "tau_ours": (sum(sum(r["ours_accepted"]) for r in rows) + rounds) / max(rounds, 1),
            "patches": PATCHES, "rows": rows}
