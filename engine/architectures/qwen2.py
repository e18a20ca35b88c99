"""Qwen2: q/k/v biases always (o_proj and the MLP have none); sliding windows by Qwen's rule."""

from engine.architectures.base import Architecture, Traits, windows_from_max_window_layers


def _traits(raw: dict, num_layers: int) -> Traits:
    return Traits(qkv_bias=True, layer_windows=windows_from_max_window_layers(raw, num_layers))


ARCHITECTURE = Architecture("Qwen2ForCausalLM", _traits)
