"""KV caches that grow in place: what every decoding loop here writes its new positions
into, so that no step pays to copy the history.

transformers' DynamicLayer appends by concatenation, which copies a layer's whole cache
on every forward. Measured on this project's 2-core CPU (SmolLM2-135M, fp32, one
request): a decode step 69.8 -> 58.1 ms at 4K context and 84.6 -> 68.8 ms at 7K once
the copy is gone, a 4-token verification 103.6 -> 92.1 / 125.9 -> 104.8 ms, with
bitwise-equal logits. No paged serving engine pays that copy, and it flatters
speculation (one forward per round instead of one per token), so the plain loop and the
speculative loops (`dlite.decoding.decode`), the cost curve the hybrids choose by
(`dlite.decoding.calibrate`) and batched decoding (`dlite.decoding.ragged`) all decode
into `SlackLayer`s. A cache with other kinds of layers (sliding windows) or a target's
own cache (`dlite.bench.qwen3`) is left as it is."""

import copy

from transformers.cache_utils import DynamicLayer

SLACK = 64  # spare slots per reallocation beyond 1.25x: a round appends gamma + 1


class SlackLayer(DynamicLayer):
    """A DynamicLayer whose keys / values are views of buffers with spare room (rows and
    slots), so a forward writes its new slots in place, a cut is a view, and dropping
    the last rows is a view. Anything that replaces the tensors (a gather, growth past
    the room) is adopted into a new buffer at the next update: one copy then, none per
    forward. Slots a view newly exposes are zeroed (`widen`): padding must be finite,
    masked or not, or a masked score of NaN would poison the softmax."""

    _kbuf = _vbuf = None

    def _owns(self, rows: int, need: int) -> bool:
        k, kb = self.keys, self._kbuf
        return kb is not None and k.data_ptr() == kb.data_ptr() and rows <= kb.shape[0] and need <= kb.shape[-2]

    def _adopt(self, need: int, cap: int = 0) -> None:
        k, v, n = self.keys, self.values, self.keys.shape[-2]
        cap = max(cap, need) if cap else max(need + SLACK, int(need * 1.25))
        self._kbuf = k.new_empty(*k.shape[:2], cap, k.shape[3])
        self._vbuf = v.new_empty(*v.shape[:2], cap, v.shape[3])
        self._kbuf[..., :n, :], self._vbuf[..., :n, :] = k, v
        self._view(k.shape[0], n)

    def _view(self, rows: int, n: int) -> None:
        self.keys, self.values = self._kbuf[:rows, :, :n], self._vbuf[:rows, :, :n]

    def reserve(self, cap: int) -> None:
        """Room for `cap` slots per row from now on (one allocation, no copy later)."""
        if not self._owns(self.keys.shape[0], cap):
            self._adopt(cap, cap)

    def widen(self, length: int) -> None:
        """`length` slots per row; the new ones zeroed (padding)."""
        rows, n = self.keys.shape[0], self.keys.shape[-2]
        if not self._owns(rows, length):
            self._adopt(length)
        self._kbuf[:rows, :, n:length].zero_()
        self._vbuf[:rows, :, n:length].zero_()
        self._view(rows, length)

    def first_rows(self, rows: int) -> None:
        """Keep rows 0..rows-1 (a view when the buffer is ours)."""
        if self._owns(self.keys.shape[0], self.keys.shape[-2]):
            self._view(rows, self.keys.shape[-2])
        else:
            self.keys, self.values = self.keys[:rows], self.values[:rows]

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized or self.keys.dim() != 4:
            self.lazy_initialization(key_states, value_states)
            shape = (*key_states.shape[:2], 0, key_states.shape[3])
            self.keys, self.values = key_states.new_zeros(shape), value_states.new_zeros(shape)
        rows, n, m = key_states.shape[0], self.keys.shape[-2], key_states.shape[-2]
        if not self._owns(rows, n + m):
            self._adopt(n + m)
        self._kbuf[:rows, :, n:n + m], self._vbuf[:rows, :, n:n + m] = key_states, value_states
        self._view(rows, n + m)
        return self.keys, self.values


def _full_attention(layers) -> bool:
    """Only transformers' plain DynamicLayers (no sliding windows, no other kinds)."""
    return layers is not None and all(type(la) is DynamicLayer for la in layers)


def slack_cache(target):
    """An empty DynamicCache of `SlackLayer`s (full-attention layers only)."""
    from dlite.decoding.decode import new_cache
    cache = new_cache(target)
    layers = getattr(cache, "layers", None)
    if not _full_attention(layers):
        kinds = sorted({type(la).__name__ for la in layers or []}) or [type(cache).__name__]
        raise TypeError(f"batched decoding needs a DynamicCache of full-attention layers, got {kinds}")
    cache.layers = [SlackLayer() for _ in layers]
    if getattr(cache, "layer_class_to_replicate", None) is DynamicLayer:  # layers made on first use
        cache.layer_class_to_replicate = SlackLayer
    return cache


def with_room(cache, room: int, copy_of: bool = True):
    """`cache` (a prefill's) as one whose layers have room for `room` more positions,
    written in place: a copy when `copy_of` (the prefill's own tensors are never
    written), else `cache` itself with its layers replaced (one copy either way, then
    none per forward). Anything but a filled DynamicCache of full-attention layers comes
    back as it was (a copy of it when `copy_of`)."""
    layers = getattr(cache, "layers", None)
    if not (layers and _full_attention(layers) and all(la.is_initialized for la in layers)):
        return copy.deepcopy(cache) if copy_of else cache
    out = copy.copy(cache) if copy_of else cache
    layers = []
    for la in cache.layers:
        mine = SlackLayer()
        mine.lazy_initialization(la.keys, la.values)
        mine.keys, mine.values = la.keys, la.values
        mine.reserve(la.keys.shape[-2] + room)  # not ours yet: copied into a new buffer
        layers.append(mine)
    out.layers = layers
    return out
