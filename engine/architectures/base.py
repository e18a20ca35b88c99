"""What the shared decoder code (engine/model.py) needs to know about one architecture.

An ``Architecture`` reads its family's fields of ``config.json`` into ``Traits`` (biases, QK
norm, per-layer sliding windows) and maps the checkpoint's tensors onto the engine's fused
projections. The four supported families share Hugging Face's Llama tensor names
(``llama_layout_weights``); an architecture with other names brings its own mapping.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from engine.config import ModelConfig

# Reads one checkpoint tensor by name (in the engine's dtype), ModelLoadError if absent.
Take = Callable[[str], torch.Tensor]


@dataclass(frozen=True, slots=True)
class Traits:
    qkv_bias: bool = False  # q, k and v projections have biases
    o_bias: bool = False  # o_proj has a bias
    mlp_bias: bool = False  # gate, up and down projections have biases
    qk_norm: bool = False  # RMSNorm on each head's q and k before RoPE
    layer_windows: tuple[int | None, ...] = ()  # per layer: its sliding window, None for full attention


@dataclass(frozen=True, slots=True)
class Architecture:
    name: str  # the config.json "architectures" entry
    traits: Callable[[dict, int], Traits]  # (config.json, number of layers) -> traits
    # Checkpoint tensors -> the engine's state dict; None: Hugging Face's Llama-family names.
    weights: Callable[[Take, "ModelConfig"], dict[str, torch.Tensor]] | None = None

    def state_dict(self, take: Take, config: "ModelConfig") -> dict[str, torch.Tensor]:
        """The engine model's state dict from the checkpoint's tensors."""
        return (self.weights or llama_layout_weights)(take, config)


def llama_layout_weights(take: Take, config: "ModelConfig") -> dict[str, torch.Tensor]:
    """Hugging Face's Llama-family names, with q/k/v and gate/up fused as the engine computes them."""
    state = {"embed_tokens.weight": take("model.embed_tokens.weight"), "norm.weight": take("model.norm.weight")}
    state["lm_head.weight"] = state["embed_tokens.weight"] if config.tie_word_embeddings else take("lm_head.weight")
    for i in range(config.num_layers):
        src, dst = f"model.layers.{i}.", f"layers.{i}."
        attn, mlp = src + "self_attn.", src + "mlp."
        state[dst + "input_norm.weight"] = take(src + "input_layernorm.weight")
        state[dst + "post_attention_norm.weight"] = take(src + "post_attention_layernorm.weight")
        state[dst + "qkv_proj.weight"] = torch.cat([take(attn + f"{p}_proj.weight") for p in "qkv"])
        if config.qkv_bias:
            state[dst + "qkv_proj.bias"] = torch.cat([take(attn + f"{p}_proj.bias") for p in "qkv"])
        state[dst + "o_proj.weight"] = take(attn + "o_proj.weight")
        if config.o_bias:
            state[dst + "o_proj.bias"] = take(attn + "o_proj.bias")
        if config.qk_norm:
            state[dst + "q_norm.weight"] = take(attn + "q_norm.weight")
            state[dst + "k_norm.weight"] = take(attn + "k_norm.weight")
        state[dst + "gate_up_proj.weight"] = torch.cat([take(mlp + "gate_proj.weight"), take(mlp + "up_proj.weight")])
        state[dst + "down_proj.weight"] = take(mlp + "down_proj.weight")
        if config.mlp_bias:
            state[dst + "gate_up_proj.bias"] = torch.cat([take(mlp + "gate_proj.bias"), take(mlp + "up_proj.bias")])
            state[dst + "down_proj.bias"] = take(mlp + "down_proj.bias")
    return state


def windows_from_max_window_layers(raw: dict, num_layers: int) -> tuple[int | None, ...]:
    """Qwen's rule: with use_sliding_window, the layers ``layer_types`` names
    "sliding_attention", else those from max_window_layers on, attend through sliding_window."""
    window = raw.get("sliding_window") if raw.get("use_sliding_window", False) else None
    if not window:
        return (None,) * num_layers
    types = raw.get("layer_types")
    if isinstance(types, list) and len(types) == num_layers:
        return tuple(int(window) if kind == "sliding_attention" else None for kind in types)
    first = int(raw.get("max_window_layers", num_layers))
    return tuple(int(window) if i >= first else None for i in range(num_layers))
