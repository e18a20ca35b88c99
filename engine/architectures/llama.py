"""Llama (and Llama-shaped checkpoints): optional attention and MLP biases, no sliding window."""

from engine.architectures.base import Architecture, Traits


def _traits(raw: dict, num_layers: int) -> Traits:
    attention = bool(raw.get("attention_bias", False))  # q, k, v and o_proj, as transformers builds them
    return Traits(qkv_bias=attention, o_bias=attention, mlp_bias=bool(raw.get("mlp_bias", False)), layer_windows=(None,) * num_layers)


ARCHITECTURE = Architecture("LlamaForCausalLM", _traits)
