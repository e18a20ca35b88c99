"""Qwen3: RMSNorm on each head's q and k; optional attention biases; sliding windows by Qwen's rule."""

from engine.architectures.base import Architecture, Traits, windows_from_max_window_layers


def _traits(raw: dict, num_layers: int) -> Traits:
    attention = bool(raw.get("attention_bias", False))
    return Traits(qkv_bias=attention, o_bias=attention, qk_norm=True, layer_windows=windows_from_max_window_layers(raw, num_layers))


ARCHITECTURE = Architecture("Qwen3ForCausalLM", _traits)
