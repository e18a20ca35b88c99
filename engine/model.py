"""The Llama-family decoder (Llama, Mistral, Qwen2, Qwen3) over a packed, paged batch.

Projections are fused (q|k|v, gate|up) so a step does few, large matmuls. The four
architectures differ only in q/k/v biases (Qwen2) and a per-head RMSNorm on q and k
before the rotation (Qwen3).

Under tensor parallelism (``engine.parallel``) a model holds one rank's shard: its heads'
rows of q|k|v, its slice of gate|up, the matching input columns of o_proj and down_proj
(whose partial sums one all-reduce each per layer adds up) and its rows of the vocabulary.
With one rank every collective is a no-op and the model is the whole checkpoint.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from engine import fused_ops
from engine.attention import AttentionMetadata, paged_attention
from engine.config import ModelConfig
from engine.kv_cache import KVCache
from engine.lora import AdapterRows, SlotStack
from engine.parallel.group import SINGLE, TPGroup
from engine.parallel.shard import TPShard
from engine.rope import RopeTables, RotaryEmbedding


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fused_ops.add_rms_norm(None, x, self.weight, self.eps)[0]

    def add_and_norm(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm of ``residual + x``, ``residual + x``); ``residual`` may be updated in place."""
        return fused_ops.add_rms_norm(x, residual, self.weight, self.eps)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_index: int, shard: TPShard, group: TPGroup = SINGLE):
        super().__init__()
        self.layer_index = layer_index
        self.group = group
        self.num_heads = shard.num_heads
        self.num_kv_heads = shard.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size = shard.num_heads * config.head_dim
        self.kv_size = shard.num_kv_heads * config.head_dim
        self.input_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=config.o_bias)
        self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.post_attention_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * shard.intermediate_size, bias=config.mlp_bias)
        self.down_proj = nn.Linear(shard.intermediate_size, config.hidden_size, bias=config.mlp_bias)
        self.window = config.layer_windows[layer_index] if config.layer_windows else None  # sliding window, or None
        # LoRA adapters' pairs by projection, every slot's stacked (engine.lora.SlotStack); a
        # projection no adapter targets is absent. Filled by engine.lora.install_adapter.
        self.lora: dict[str, SlotStack] = {}

    def forward(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        rope_tables: RopeTables,
        kv_cache: KVCache,
        meta: AttentionMetadata,
        adapters: AdapterRows | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The previous layer's output and the residual stream before it (None for the first
        layer, whose input is the residual) -> this layer's output and the stream before it.
        Each add into the residual is fused with the norm that follows it (vLLM's layout).
        ``adapters``: the step's rows that go through LoRA adapters (None: none do)."""
        num_tokens = hidden.shape[0]
        if residual is None:
            normed, residual = self.input_norm(hidden), hidden
        else:
            normed, residual = self.input_norm.add_and_norm(hidden, residual)
        qkv = self._project("qkv_proj", normed, adapters)
        # Rotated in place in qkv where the kernel takes it (no per-head norm to apply first).
        rotated = self.q_norm is None and fused_ops.rotate_heads_(qkv, self.num_heads + self.num_kv_heads, self.head_dim, rope_tables)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        # Not rotated yet: the attention rotates q and k as it writes the KV (one launch on CUDA).
        attended = paged_attention(
            q,
            k,
            v,
            kv_cache.key_views[self.layer_index],
            kv_cache.value_views[self.layer_index],
            meta,
            self.window,
            kv_cache.key_scales[self.layer_index],
            kv_cache.value_scales[self.layer_index],
            None if rotated else rope_tables,
        )
        # Row-parallel: each rank's partial product, summed over the ranks (its bias on rank 0 only).
        attention_out = self.group.all_reduce(self._project("o_proj", attended.view(num_tokens, self.q_size), adapters))
        normed, residual = self.post_attention_norm.add_and_norm(attention_out, residual)
        activated = fused_ops.silu_mul(self._project("gate_up_proj", normed, adapters))
        return self.group.all_reduce(self._project("down_proj", activated, adapters)), residual

    def _project(self, name: str, x: torch.Tensor, adapters: AdapterRows | None) -> torch.Tensor:
        """Projection ``name`` of ``x``, plus its LoRA deltas on the rows that have an adapter (a
        row-parallel one's partial delta, summed with its partial product by the all-reduce)."""
        out = getattr(self, name)(x)
        stack = None if adapters is None else self.lora.get(name)
        return out if stack is None else adapters.add_deltas(out, x, stack)


@dataclass(slots=True)
class StageActivations:
    """What a pipeline stage hands the next for one step's tokens: the output of its last layer
    and the residual stream before it (both [tokens, hidden])."""

    hidden: torch.Tensor
    residual: torch.Tensor | None


class CausalLM(nn.Module):
    """Embedding, decoder layers, final norm and LM head of one checkpoint (or of one rank's shard).

    ``run_stage`` runs a contiguous range of the layers (a pipeline stage: the first embeds, the
    last scores); ``forward`` is the stage of every layer."""

    def __init__(self, config: ModelConfig, rotary: RotaryEmbedding, shard: TPShard | None = None, group: TPGroup = SINGLE):
        super().__init__()
        self.config = config
        self.shard = shard = shard or TPShard.of(config)
        self.group = group
        # Handed its (empty) weight, the embedding skips its random init: the loader builds the
        # model on the meta device, where nn.Embedding's normal_ goes through torch._refs and
        # imports torch._dynamo (about 2 s of CPU in every worker process) for values it discards.
        self.embed_tokens = nn.Embedding(shard.vocab_size, config.hidden_size, _weight=torch.empty(shard.vocab_size, config.hidden_size))
        self.layers = nn.ModuleList(DecoderLayer(config, i, shard, group) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, shard.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.rotary = rotary

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: KVCache,
        meta: AttentionMetadata,
        logits_indices: torch.Tensor,
        logits_out: torch.Tensor | None = None,
        adapters: AdapterRows | None = None,
    ) -> torch.Tensor | None:
        """Run the packed batch; return float32 logits only at ``logits_indices`` (on rank 0 of a
        tensor-parallel group; None on the others), written into ``logits_out`` where given (one
        model rank: the CUDA graphs' shared output, engine.cuda_graphs)."""
        return self.run_stage(
            input_ids, positions, kv_cache, meta, logits_indices, range(len(self.layers)), logits_out=logits_out, adapters=adapters
        )

    @torch.inference_mode()
    def run_stage(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: KVCache,
        meta: AttentionMetadata,
        logits_indices: torch.Tensor,
        layers: range,
        incoming: StageActivations | None = None,
        logits_out: torch.Tensor | None = None,
        adapters: AdapterRows | None = None,
    ) -> torch.Tensor | StageActivations | None:
        """Layers ``layers`` of the packed batch, writing their KV: a stage from layer 0 embeds
        ``input_ids``, a later one starts from the previous stage's ``incoming``; a stage through
        the last layer returns the logits (as ``forward``), an earlier one its activations."""
        if layers.start == 0:
            hidden, residual = self._embed(input_ids), None
        else:
            hidden, residual = incoming.hidden, incoming.residual
        rope_tables = self.rotary.tables(positions)
        for index in layers:
            hidden, residual = self.layers[index](hidden, residual, rope_tables, kv_cache, meta, adapters)
        if layers.stop < len(self.layers):
            return StageActivations(hidden, residual)
        # Only the rows that need logits: the last add and the final norm are per row.
        hidden, _ = self.norm.add_and_norm(hidden[logits_indices], residual[logits_indices])
        logits = self.lm_head(hidden)
        if self.shard.is_whole:
            return logits.float() if logits_out is None else logits_out.copy_(logits)  # one conversion either way
        # Vocabulary-parallel: each rank scored its rows; rank 0 (the sampler's) joins them.
        gathered = self.group.gather_to_first(logits)
        return None if gathered is None else gathered[:, : self.config.vocab_size].float()

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.shard.is_whole:
            return self.embed_tokens(input_ids)
        # Each rank looks up the ids in its rows, zeros for the rest; the sum is every id's row.
        local = input_ids - self.shard.vocab_start
        outside = (local < 0) | (local >= self.shard.vocab_size)
        hidden = self.embed_tokens(local.masked_fill(outside, 0))
        hidden.masked_fill_(outside.unsqueeze(-1), 0)
        return self.group.all_reduce(hidden)
