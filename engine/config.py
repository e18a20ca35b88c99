"""Model and engine configuration: what a checkpoint says, and how the engine runs it."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

import torch

from engine.architectures import ARCHITECTURES
from engine.errors import ModelLoadError, read_json_file
from engine.speculation import SpeculativeConfig

logger = logging.getLogger(__name__)

SUPPORTED_ARCHITECTURES = tuple(ARCHITECTURES)

DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


KV_CACHE_DTYPES = ("auto", "int8", "fp8_e4m3")

ROPE_TYPES = ("default", "linear", "llama3", "yarn", "dynamic", "longrope")


# engine.attention.registry's names (kept here so the config imports no backend).
ATTENTION_BACKEND_NAMES = ("auto", "cpu", "sdpa", "flashinfer", "triton")


@dataclass(slots=True)
class RopeConfig:
    """Rotary embedding parameters; ``scaling_type`` is one of ROPE_TYPES (engine/rope.py)."""

    theta: float = 10000.0
    scaling_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    original_max_position: int = 8192  # llama3, yarn, longrope: the pretraining context
    max_position: int = 2048  # the config's max_position_embeddings (dynamic NTK scales from it)
    attention_factor: float | None = None  # yarn, longrope: cos/sin scale; None: derived from factor
    beta_fast: float = 32.0  # yarn
    beta_slow: float = 1.0  # yarn
    mscale: float | None = None  # yarn
    mscale_all_dim: float | None = None  # yarn
    truncate: bool = True  # yarn
    short_factor: list[float] | None = None  # longrope
    long_factor: list[float] | None = None  # longrope


@dataclass(slots=True)
class ModelConfig:
    """The parts of a Hugging Face ``config.json`` the engine's model code needs."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope: RopeConfig
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    checkpoint_dtype: torch.dtype
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    # Per layer: the sliding window it attends through (the latest this many keys), None for
    # full attention.
    layer_windows: list[int | None] = field(default_factory=list)
    o_bias: bool = False  # o_proj has a bias
    mlp_bias: bool = False  # gate, up and down projections have biases

    @classmethod
    def from_model_dir(cls, model_dir: Path) -> "ModelConfig":
        config_path = Path(model_dir) / "config.json"
        if not config_path.is_file():
            raise ModelLoadError(f"{model_dir}: no config.json (is this a Hugging Face model directory?)")
        return cls.from_dict(read_json_file(config_path), source=str(config_path))

    @classmethod
    def from_dict(cls, raw: dict, source: str = "config") -> "ModelConfig":
        raw = _with_family_defaults(raw)
        architectures = raw.get("architectures") or []
        arch = next((a for a in architectures if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise ModelLoadError(
                f"{source}: architecture {architectures or '(none)'} is not supported; "
                f"supported architectures: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        quantization = raw.get("quantization_config")
        if quantization:
            method = quantization.get("quant_method", "unknown") if isinstance(quantization, dict) else quantization
            raise ModelLoadError(
                f"{source}: a quantized checkpoint (quantization_config: {method}) is not supported; "
                "give an unquantized float32, bfloat16 or float16 checkpoint"
            )
        activation = raw.get("hidden_act", "silu")
        if activation not in ("silu", "swish"):  # (transformers' ACT2FN: swish is SiLU)
            raise ModelLoadError(f"{source}: hidden_act {activation!r} is not supported (only silu, which every layer's MLP computes)")
        dtype_name = str(raw.get("dtype") or raw.get("torch_dtype") or "float32").removeprefix("torch.")
        if dtype_name not in DTYPES:
            raise ModelLoadError(f"{source}: dtype {dtype_name!r} is not supported ({', '.join(DTYPES)})")
        try:
            traits = ARCHITECTURES[arch].traits(raw, int(raw["num_hidden_layers"]))
            hidden = int(raw["hidden_size"])
            num_heads = int(raw["num_attention_heads"])
            head_dim = raw.get("head_dim") or hidden // num_heads
            return cls(
                architecture=arch,
                vocab_size=int(raw["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(raw["intermediate_size"]),
                num_layers=int(raw["num_hidden_layers"]),
                num_heads=num_heads,
                num_kv_heads=int(raw.get("num_key_value_heads") or num_heads),
                head_dim=int(head_dim),
                max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
                rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
                rope=_parse_rope(raw, source),
                tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
                qkv_bias=traits.qkv_bias,
                o_bias=traits.o_bias,
                mlp_bias=traits.mlp_bias,
                qk_norm=traits.qk_norm,
                checkpoint_dtype=DTYPES[dtype_name],
                bos_token_id=raw.get("bos_token_id"),
                eos_token_ids=_as_id_list(raw.get("eos_token_id")),
                layer_windows=list(traits.layer_windows),
            )
        except KeyError as exc:
            raise ModelLoadError(f"{source}: missing required field {exc.args[0]!r}") from exc

    def compat_fields(self) -> dict[str, object]:
        """Everything two workers must agree on for their KV caches to be interchangeable."""
        return {
            "architecture": self.architecture,
            "num_layers": self.num_layers,
            "num_kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_size": self.hidden_size,
            "vocab_size": self.vocab_size,
        }


# Fields whose default differs by model family, as transformers' config classes fill them in
# (Qwen3's head_dim 128, Qwen's 32 KV heads and 28 max_window_layers, Mistral's 4096-token
# window and 131072 positions): a config.json without one took Llama's everywhere (a Qwen3 one
# without head_dim failed on a tensor's size; a Qwen2 one computed other windows).
_FAMILY_FIELDS = {
    "llama": ("num_key_value_heads", "head_dim", "max_position_embeddings", "rms_norm_eps"),
    "mistral": ("num_key_value_heads", "head_dim", "max_position_embeddings", "rms_norm_eps", "sliding_window"),
    "qwen2": ("num_key_value_heads", "max_position_embeddings", "rms_norm_eps", "max_window_layers"),
    "qwen3": ("num_key_value_heads", "head_dim", "max_position_embeddings", "rms_norm_eps", "max_window_layers"),
}


def _with_family_defaults(raw: dict) -> dict:
    """``raw`` with the family fields it leaves out as transformers reads them from it (its config
    class built from ``raw``, so a default derived from other fields is derived from these);
    transformers is imported only for a config that leaves one out."""
    missing = [name for name in _FAMILY_FIELDS.get(raw.get("model_type"), ()) if name not in raw]
    if not missing:
        return raw
    try:
        from transformers import CONFIG_MAPPING

        read = CONFIG_MAPPING[raw["model_type"]](**{k: v for k, v in raw.items() if k != "model_type"})
    except Exception:  # (transformers refuses it: the fields are then read as they are)
        return raw
    return {**raw, **{name: getattr(read, name) for name in missing if getattr(read, name, None) is not None}}


def _parse_rope(raw: dict, source: str) -> RopeConfig:
    # transformers 5 writes "rope_parameters" (theta inside); 4.x wrote rope_theta + rope_scaling.
    params = dict(raw.get("rope_parameters") or {})
    scaling = raw.get("rope_scaling") or {}
    merged = {**scaling, **params}
    theta = float(merged.get("rope_theta", raw.get("rope_theta", 10000.0)))
    rope_type = merged.get("rope_type") or merged.get("type") or "default"
    if rope_type not in ROPE_TYPES:
        raise ModelLoadError(f"{source}: rope scaling type {rope_type!r} is not supported ({', '.join(ROPE_TYPES)})")
    partial = merged.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0))
    if partial not in (None, 1, 1.0):
        raise ModelLoadError(f"{source}: partial_rotary_factor {partial} is not supported (only 1.0)")
    max_position = int(raw.get("max_position_embeddings", 2048))
    # As transformers: a top-level original_max_position_embeddings (Phi-3 style) wins, and
    # without one the pretraining context is max_position_embeddings.
    original = raw.get("original_max_position_embeddings") or merged.get("original_max_position_embeddings") or max_position
    factor = merged.get("factor")
    if factor is None and rope_type in ("yarn", "longrope"):
        factor = max_position / int(original)
    optional = {name: merged.get(name) for name in ("attention_factor", "mscale", "mscale_all_dim")}
    return RopeConfig(
        theta=theta,
        scaling_type=rope_type,
        factor=float(1.0 if factor is None else factor),
        low_freq_factor=float(merged.get("low_freq_factor", 1.0)),
        high_freq_factor=float(merged.get("high_freq_factor", 4.0)),
        original_max_position=int(original),
        max_position=max_position,
        attention_factor=None if optional["attention_factor"] is None else float(optional["attention_factor"]),
        beta_fast=float(merged.get("beta_fast") or 32.0),
        beta_slow=float(merged.get("beta_slow") or 1.0),
        mscale=None if optional["mscale"] is None else float(optional["mscale"]),
        mscale_all_dim=None if optional["mscale_all_dim"] is None else float(optional["mscale_all_dim"]),
        truncate=bool(merged.get("truncate", True)),
        short_factor=_factor_list(merged.get("short_factor")),
        long_factor=_factor_list(merged.get("long_factor")),
    )


def _factor_list(value: object) -> list[float] | None:
    return None if value is None else [float(v) for v in value]


def _as_id_list(value: object) -> list[int]:
    if value is None:
        return []
    if isinstance(value, (list, tuple)):
        return [int(v) for v in value]
    return [int(value)]


@dataclass(slots=True)
class EngineConfig:
    """How an engine instance runs a model.

    ``max_num_batched_tokens`` is the per-step token budget shared by decode tokens and
    prefill chunks; ``long_prefill_chunk`` caps how many tokens of one prompt a single step
    may take (None: as many as the budget allows). KV size comes from ``num_kv_blocks`` if
    given, else from ``kv_cache_bytes``.
    """

    dtype: str | None = None  # None: the checkpoint's dtype; "auto": the fastest the device computes natively (engine.device_caps)
    device: str = "cpu"
    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_bytes: int = 256 * 1024 * 1024
    max_num_batched_tokens: int = 512
    long_prefill_chunk: int | None = None
    max_num_seqs: int = 64
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    num_threads: int | None = None
    # CPU: up to this many intra-op threads while the host's other processes leave whole cores
    # idle (engine.elastic_threads; e.g. a decode actor taking its prefill neighbour's core in the
    # tail of a burst). None: ``num_threads`` always.
    max_num_threads: int | None = None
    seed: int = 0
    # CPU: run linears with weights repacked at load (engine.cpu_linear: pdserve's bfloat16
    # pair kernel where the CPU has avx512_bf16, else oneDNN); False keeps torch's matmul.
    prepack_linear: bool = True
    # Which attention backend reads the paged cache (engine.attention.registry): auto (the CPU
    # kernels built for this machine on a CPU, FlashInfer on CUDA where installed and the cache
    # is float16/bfloat16, else SDPA), cpu, sdpa or flashinfer.
    attention_backend: str = "auto"
    # CUDA: replay decode steps of up to this many rows from captured CUDA graphs (one per batch
    # bucket, captured when the engine starts), where the attention backend can (flashinfer) and the
    # engine is one rank. 0: every step runs eagerly.
    cuda_graph_max_batch: int = 256
    # Overlapped steps (engine.overlap): the host schedules and prepares the next step while the
    # device computes this one, which samples on the device; a step whose rows need the host
    # between steps (grammars, bad words, drafts, a thinking budget at its end, several ranks)
    # runs after the one in flight instead (penalties, logprobs and seeded draws overlap).
    # Worth it where the device computes asynchronously: None (the default) turns it on for
    # CUDA, where an H200 ran the 1.5B shape's batch-64 decode step in 3.08 ms overlapped against
    # 4.22 ms one at a time (the 135M shape's batch 32: 1.48 / 2.38), and off on a CPU, whose
    # cores compute the step the host would prepare beside.
    async_scheduling: bool | None = None
    # Priority aging: a request waiting this long since it arrived is served ahead of every
    # priority, oldest first, so a low priority bounds a wait instead of starving it. None:
    # strict priority.
    priority_max_wait_s: float | None = 30.0
    # Full prompt blocks stay cached after their request ends and a later request with the
    # same prefix reuses them instead of computing them again (engine.block_allocator).
    enable_prefix_caching: bool = True
    # Decoding sequences verify drafted tokens in their step (engine.speculation); None: off.
    speculative: SpeculativeConfig | None = None
    # KV cache elements: "auto" (the model's dtype), or quantized to one byte with a scale per
    # block, layer and KV head: "int8", "fp8_e4m3" (engine.kv_cache).
    kv_cache_dtype: str = "auto"
    # Adaptive chunk size: a step that also decodes carries as many prompt tokens as the
    # measured step-time model says fit in this many ms (engine.chunk_sizer), at least
    # ``block_size`` and at most the budget and ``long_prefill_chunk``; None: fixed chunks.
    target_step_ms: float | None = None
    # Ranks the model is split over (engine.parallel): this process is rank 0, the others are
    # started by the engine's rank launcher. KV sizes (kv_cache_bytes) are per rank.
    tensor_parallel_size: int = 1
    # LoRA adapters served beside the model (engine.lora): a request's ``SamplingParams.lora_name``
    # names one. Name -> PEFT adapter directory; every rank loads each (its slices) at start.
    lora_adapters: dict[str, str] = field(default_factory=dict)
    # vLLM's --max-lora-rank: the largest rank an adapter may have (each slot's stacks grow with
    # it, and every step through any adapter with them). None: no bound.
    max_lora_rank: int | None = None

    def validate(self) -> None:
        if self.speculative is not None:
            self.speculative.validate()
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype: must be one of {list(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")
        if self.dtype is not None and self.dtype != "auto" and self.dtype not in DTYPES:
            raise ValueError(f"dtype: must be one of {sorted([*DTYPES, 'auto'])}, got {self.dtype!r}")
        if self.block_size < 1:
            raise ValueError(f"block_size: must be >= 1, got {self.block_size}")
        if self.max_num_threads is not None and self.max_num_threads < (self.num_threads or 1):
            raise ValueError(f"max_num_threads: must be >= num_threads ({self.num_threads or 1}), got {self.max_num_threads}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks: must be >= 1, got {self.num_kv_blocks}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens: must be >= 1, got {self.max_num_batched_tokens}")
        if self.long_prefill_chunk is not None and self.long_prefill_chunk < 1:
            raise ValueError(f"long_prefill_chunk: must be >= 1, got {self.long_prefill_chunk}")
        if self.priority_max_wait_s is not None and not self.priority_max_wait_s > 0:
            raise ValueError(f"priority_max_wait_s: must be > 0 or None, got {self.priority_max_wait_s}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs: must be >= 1, got {self.max_num_seqs}")
        if self.target_step_ms is not None and not self.target_step_ms > 0:
            raise ValueError(f"target_step_ms: must be > 0 or None, got {self.target_step_ms}")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size: must be >= 1, got {self.tensor_parallel_size}")
        if self.attention_backend not in ATTENTION_BACKEND_NAMES:
            raise ValueError(f"attention_backend: must be one of {list(ATTENTION_BACKEND_NAMES)}, got {self.attention_backend!r}")
        if self.cuda_graph_max_batch < 0:
            raise ValueError(f"cuda_graph_max_batch: must be >= 0, got {self.cuda_graph_max_batch}")
        for name, path in self.lora_adapters.items():
            if not isinstance(name, str) or not name or not isinstance(path, str) or not path:
                raise ValueError(f"lora_adapters: must map non-empty names to adapter directories, got {name!r}: {path!r}")
        if self.max_lora_rank is not None and self.max_lora_rank < 1:
            raise ValueError(f"max_lora_rank: must be >= 1 or None, got {self.max_lora_rank}")
