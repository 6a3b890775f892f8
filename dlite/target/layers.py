"""Where a target's decoder layers are, and the architecture check that names an
unsupported model clearly.

Feature capture (`dlite.decoding.capture`) and collection (`dlite.data.features`) both
hook the target's decoder layers; the knowledge of where those live belongs with the
target, not with either consumer (it kept `dlite/data` importing `dlite/decoding`).
Every HF decoder DLite supports (Qwen3, Qwen2, Llama / SmolLM2, Mistral-style) keeps
them at `model.model.layers`; anything else is refused at load time, naming its class."""

from torch import nn

SUPPORTED = "HF causal decoders with `.model.layers` (Qwen3, Qwen2, Llama/SmolLM2, Mistral-style)"


class UnsupportedTarget(ValueError):
    """The target's architecture has no decoder-layer list DLite can hook."""


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The decoder layer list of a HF causal LM (`model.model.layers`)."""
    inner = getattr(model, "model", model)
    layers = getattr(inner, "layers", None)
    if not isinstance(layers, nn.ModuleList) or len(layers) == 0:
        kind = getattr(getattr(model, "config", None), "model_type", None)
        raise UnsupportedTarget(
            f"target {type(model).__name__} (model_type {kind!r}) has no .model.layers to hook: "
            f"DLite supports {SUPPORTED}")
    return layers


def final_norm_weight(model: nn.Module):
    """The weight of the target's final norm (`model.model.norm`): a drafter that reads
    HF `hidden_states[-1]` (the published DLite layout) applies it to the last layer's
    pre-norm output, which is what our capture hooks see."""
    norm = getattr(getattr(model, "model", model), "norm", None)
    if norm is None or getattr(norm, "weight", None) is None:
        raise UnsupportedTarget(f"target {type(model).__name__} has no .model.norm.weight")
    return norm.weight.detach()
