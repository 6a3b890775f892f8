"""The target's KV cache as the loops that carry one make it: collection's forked rows
(dlite.data.features), decoding and regeneration (dlite.decoding). Here, beside where
the target's layers are found, so data never reaches into decoding for it.

transformers 5.24: the forward kwarg is `cache=` (`past_key_values=` still works but
warns that it is deprecated); older versions and this project's own Qwen3 bench model
take `past_key_values=`. transformers is imported where a DynamicCache is made, not at
module load (a target of this project's own, dlite.bench.qwen3, needs none of it)."""

import functools
import inspect


@functools.lru_cache(maxsize=None)
def cache_kwarg(model_cls) -> str:
    """The name `model_cls.forward` takes its KV cache under."""
    params = inspect.signature(model_cls.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def new_cache(model):
    """An empty KV cache: the target's own kind where it makes one (`new_cache()`), else
    transformers' DynamicCache (no HF model defines `new_cache`)."""
    own = getattr(model, "new_cache", None)
    if callable(own):
        return own()
    from transformers import DynamicCache
    return DynamicCache(config=model.config)


def crop_cache(cache, length: int) -> None:
    """Keep the first `length` positions of every layer of the cache."""
    extra = cache.get_seq_length() - length
    if extra < 0:
        raise ValueError(f"cannot crop a cache of {cache.get_seq_length()} to {length}")
    if extra:  # transformers 5: a negative n removes n positions, a positive one raises
        cache.crop(-extra)
