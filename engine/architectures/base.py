"""What the shared decoder code (engine/model.py) needs to know about one architecture.

An ``Architecture`` reads its family's fields of ``config.json`` into ``Traits`` (biases, QK
norm, per-layer sliding windows) and maps the checkpoint's tensors onto the engine's fused
projections. The four supported families share Hugging Face's Llama tensor names
(``llama_layout_weights``); an architecture with other names brings its own mapping.

A mapping reads, for a tensor-parallel rank, only that rank's slices (``engine.parallel.shard``):
its heads' rows of q, k and v, its MLP columns, its vocabulary rows.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from engine.config import ModelConfig
    from engine.parallel.shard import TPShard

# Reads one checkpoint tensor by name (in the engine's dtype), ModelLoadError if absent:
# ``take(name)`` whole, ``take(name, dim, start, stop)`` indices [start, stop) along ``dim``.
Take = Callable[..., torch.Tensor]


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
    weights: Callable[[Take, "ModelConfig", "TPShard"], dict[str, torch.Tensor]] | None = None

    def state_dict(self, take: Take, config: "ModelConfig", shard: "TPShard") -> dict[str, torch.Tensor]:
        """The engine model's state dict (``shard``'s part of it) from the checkpoint's tensors."""
        return (self.weights or llama_layout_weights)(take, config, shard)


class ShardReader:
    """``take`` narrowed to one rank's slices; the whole tensor for a model of one rank."""

    def __init__(self, take: Take, config: "ModelConfig", shard: "TPShard"):
        self.take, self.config, self.shard = take, config, shard

    def whole(self, name: str) -> torch.Tensor:
        return self.take(name)

    def part(self, name: str, dim: int, start: int, count: int) -> torch.Tensor:
        """Indices [start, start + count) of ``name`` along ``dim`` (the whole tensor at TP 1)."""
        if self.shard.is_whole:
            return self.take(name)
        return self.take(name, dim, start, start + count)

    def heads(self, name: str, dim: int = 0) -> torch.Tensor:
        """This rank's query heads of a q projection (rows) or of o_proj (columns)."""
        head_dim = self.config.head_dim
        return self.part(name, dim, self.shard.head_start * head_dim, self.shard.num_heads * head_dim)

    def kv_heads(self, name: str) -> torch.Tensor:
        """This rank's KV heads' rows of a k or v projection (a replicated head on several ranks)."""
        head_dim = self.config.head_dim
        return self.part(name, 0, self.shard.kv_head_start * head_dim, self.shard.num_kv_heads * head_dim)

    def mlp(self, name: str, dim: int = 0) -> torch.Tensor:
        """This rank's MLP columns: rows of gate/up, columns of down_proj."""
        return self.part(name, dim, self.shard.intermediate_start, self.shard.intermediate_size)

    def vocab(self, name: str) -> torch.Tensor:
        """This rank's rows of an embedding or LM head, zero rows past the vocabulary's end."""
        start, count = self.shard.vocab_start, self.shard.vocab_size
        rows = self.part(name, 0, start, min(count, self.config.vocab_size - start))
        if rows.shape[0] == count:
            return rows
        return torch.cat([rows, rows.new_zeros(count - rows.shape[0], rows.shape[1])])

    def row_parallel_bias(self, name: str) -> torch.Tensor:
        """A row-parallel layer's bias: added once, after the all-reduce sums the ranks' partial
        products, so only rank 0 keeps it (the others hold zeros)."""
        bias = self.take(name)
        return bias if self.shard.rank == 0 else torch.zeros_like(bias)


def llama_layout_weights(take: Take, config: "ModelConfig", shard: "TPShard") -> dict[str, torch.Tensor]:
    """Hugging Face's Llama-family names, with q/k/v and gate/up fused as the engine computes them."""
    read = ShardReader(take, config, shard)
    state = {"embed_tokens.weight": read.vocab("model.embed_tokens.weight"), "norm.weight": take("model.norm.weight")}
    state["lm_head.weight"] = state["embed_tokens.weight"] if config.tie_word_embeddings else read.vocab("lm_head.weight")
    for i in range(config.num_layers):
        src, dst = f"model.layers.{i}.", f"layers.{i}."
        attn, mlp = src + "self_attn.", src + "mlp."
        state[dst + "input_norm.weight"] = take(src + "input_layernorm.weight")
        state[dst + "post_attention_norm.weight"] = take(src + "post_attention_layernorm.weight")
        state[dst + "qkv_proj.weight"] = torch.cat(
            [read.heads(attn + "q_proj.weight"), read.kv_heads(attn + "k_proj.weight"), read.kv_heads(attn + "v_proj.weight")]
        )
        if config.qkv_bias:
            state[dst + "qkv_proj.bias"] = torch.cat(
                [read.heads(attn + "q_proj.bias"), read.kv_heads(attn + "k_proj.bias"), read.kv_heads(attn + "v_proj.bias")]
            )
        state[dst + "o_proj.weight"] = read.heads(attn + "o_proj.weight", dim=1)
        if config.o_bias:
            state[dst + "o_proj.bias"] = read.row_parallel_bias(attn + "o_proj.bias")
        if config.qk_norm:
            state[dst + "q_norm.weight"] = take(attn + "q_norm.weight")
            state[dst + "k_norm.weight"] = take(attn + "k_norm.weight")
        state[dst + "gate_up_proj.weight"] = torch.cat([read.mlp(mlp + "gate_proj.weight"), read.mlp(mlp + "up_proj.weight")])
        state[dst + "down_proj.weight"] = read.mlp(mlp + "down_proj.weight", dim=1)
        if config.mlp_bias:
            state[dst + "gate_up_proj.bias"] = torch.cat([read.mlp(mlp + "gate_proj.bias"), read.mlp(mlp + "up_proj.bias")])
            state[dst + "down_proj.bias"] = read.row_parallel_bias(mlp + "down_proj.bias")
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
