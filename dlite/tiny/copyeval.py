"""Held-out measurements of the tiny target: next-token accuracy, copy accuracy
(accuracy on tokens that repeat text seen earlier in the same context) and accuracy on
the second half of a repeated random sequence (a direct probe of the induction
mechanism that copying needs). Used by the build and reported by `dlite.tiny info`."""

import torch

# A token counts as "copy" when the n-gram ending at it already occurred earlier in the
# context: the model has seen the continuation and can copy it. n=6 keeps short,
# common phrases (", self." ) from counting as copies.
COPY_NGRAM = 6


def copy_mask(ids: list[int], start: int, n: int = COPY_NGRAM) -> list[bool]:
    """mask[t] is True when ids[t-n+1..t] occurred earlier, ending before t, and t >= start."""
    seen: set[tuple] = set()
    mask = [False] * len(ids)
    for t in range(n - 1, len(ids)):
        gram = tuple(ids[t - n + 1:t + 1])
        mask[t] = t >= start and gram in seen
        seen.add(gram)
    return mask


def repeated_random(gen: torch.Generator, n: int, half: int, lo: int, hi: int) -> torch.Tensor:
    """`n` sequences of `half` uniform random ids in [lo, hi) followed by the same ids."""
    x = torch.randint(lo, hi, (n, half), generator=gen)
    return torch.cat([x, x], dim=1)


@torch.no_grad()
def _predictions(model, windows: torch.Tensor, batch: int = 4) -> torch.Tensor:
    """Greedy next-token predictions for every position: preds[:, t] predicts ids[:, t+1]."""
    out = []
    for i in range(0, len(windows), batch):
        out.append(model(input_ids=windows[i:i + batch]).logits.argmax(-1))
    return torch.cat(out)


@torch.no_grad()
def evaluate(model, windows: list[list[int]], starts: list[int], probe: torch.Tensor) -> dict:
    """Accuracy metrics on held-out token windows (equal lengths) and the repeat probe."""
    model.eval()
    x = torch.tensor(windows)
    preds = _predictions(model, x)[:, :-1]
    target = x[:, 1:]
    hit = preds == target
    masks = torch.tensor([copy_mask(w, s)[1:] for w, s in zip(windows, starts)])
    half = probe.shape[1] // 2
    probe_hit = (_predictions(model, probe)[:, half:-1] == probe[:, half + 1:])
    return {
        "heldout_next_token_acc": round(hit.float().mean().item(), 4),
        "heldout_copy_acc": round(hit[masks].float().mean().item(), 4),
        "heldout_copy_fraction": round(masks.float().mean().item(), 4),
        "repeat_probe_acc": round(probe_hit.float().mean().item(), 4),
        "heldout_tokens": int(target.numel()),
    }
