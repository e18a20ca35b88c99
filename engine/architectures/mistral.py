"""Mistral: no biases; a sliding window (when the config sets one) on every layer."""

from engine.architectures.base import Architecture, Traits


def _traits(raw: dict, num_layers: int) -> Traits:
    window = raw.get("sliding_window")
    return Traits(layer_windows=(int(window) if window else None,) * num_layers)


ARCHITECTURE = Architecture("MistralForCausalLM", _traits)
