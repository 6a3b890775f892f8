"""Capturing the target's context features during its own forward passes.

A drafter's features are the raw OUTPUTS of chosen decoder layers
(`model.model.layers[i]`), concatenated over `layer_ids` in that order. We hook only
those layers instead of passing `output_hidden_states=True`, which would keep every
layer's states alive for the whole forward (at 32K tokens × 36 layers that is most of
the memory a long verification needs).

Note for anyone comparing with HF outputs: `hidden_states[i + 1]` equals layer i's
output for every layer but the last; HF replaces `hidden_states[-1]` by the final-norm
output (`last_hidden_state`), while the hook sees the pre-norm layer output.

In transformers 5.x a `Qwen3DecoderLayer` returns a plain tensor; 4.x returned a tuple
whose first element is the hidden states, so both are accepted."""

from typing import List, Optional

import torch
from torch import nn

from dlite.target.layers import decoder_layers


class LayerCapture:
    """Context manager: forward hooks on `layer_ids`, keeping each layer's output of the
    LATEST forward (each forward overwrites the previous one's).

    `last_only=True` keeps only the last position, copied out, so a long prefill does not
    keep K full [L, H] tensors alive for a drafter that reads one row."""

    def __init__(self, model: nn.Module, layer_ids: List[int]):
        layers = decoder_layers(model)
        bad = [i for i in layer_ids if not 0 <= i < len(layers)]
        if bad:
            raise ValueError(f"target_layer_ids {list(layer_ids)} must be within 0..{len(layers) - 1}")
        self.model, self.layer_ids = model, list(layer_ids)
        self.last_only = False
        self._outputs: List[Optional[torch.Tensor]] = [None] * len(self.layer_ids)
        self._handles = []

    def _hook(self, slot: int):
        def fn(module, args, output):
            h = output[0] if isinstance(output, (tuple, list)) else output
            # Copy the single row so the full layer output can be freed after the forward.
            self._outputs[slot] = h[:, -1:].clone() if self.last_only else h
        return fn

    def __enter__(self) -> "LayerCapture":
        layers = decoder_layers(self.model)
        self._handles = [layers[i].register_forward_hook(self._hook(s))
                         for s, i in enumerate(self.layer_ids)]
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()
        self._handles, self._outputs = [], [None] * len(self.layer_ids)

    def features(self) -> torch.Tensor:
        """[positions, K*H] for batch row 0 of the latest forward (K = len(layer_ids));
        [0, 0] for a drafter that reads no features (it reads tokens: prompt lookup)."""
        if not self.layer_ids:
            return torch.zeros(0, 0)
        if any(o is None for o in self._outputs):
            raise RuntimeError("no forward captured yet (or hooks already removed)")
        return torch.cat([o[0] for o in self._outputs], dim=-1)

    def row_features(self) -> torch.Tensor:
        """[B, positions, K*H]: every batch row of the latest forward (batched decoding)."""
        if not self.layer_ids:
            return torch.zeros(0, 0, 0)
        if any(o is None for o in self._outputs):
            raise RuntimeError("no forward captured yet (or hooks already removed)")
        return torch.cat(self._outputs, dim=-1)
