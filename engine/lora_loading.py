"""Reading a PEFT LoRA adapter for the engine's model (engine.lora serves it).

An adapter is a PEFT LoRA directory (``adapter_config.json``, ``adapter_model.safetensors``)
for the base checkpoint's attention and MLP projections. Each targeted projection's pair
becomes one pair per engine projection: q/k/v (and gate/up) are fused there, so their A
matrices are stacked and their B matrices placed block-diagonally in the fused output, B
pre-multiplied by the adapter's scaling (``lora_alpha / r``, or ``/ sqrt(r)`` with rsLoRA, per
module with ``rank_pattern`` and ``alpha_pattern``). A tensor-parallel rank reads its slices: B's
rows of its heads or MLP columns for the column-parallel projections, A's columns of its heads
or MLP columns for o_proj and down_proj, whose partial deltas the layer's all-reduce sums with
the base's. What PEFT can express and this engine would compute differently is refused, by name.
"""

from __future__ import annotations

import hashlib
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.architectures.base import ShardReader
from engine.config import ModelConfig
from engine.errors import ModelLoadError, read_json_file
from engine.model_source import is_hub_id, resolve_model
from engine.parallel.shard import TPShard

PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
_TENSOR_NAME = re.compile(r"^base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")
# The checkpoint projections an adapter may target, and the block each belongs to.
_BLOCK_OF = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn", "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}
# adapter_config.json fields that change what the adapter computes, and are refused when set:
# pdserve would otherwise serve something else than the adapter was trained as.
_REFUSED_FIELDS = {
    "use_dora": "DoRA adapters",
    "modules_to_save": "adapters that replace whole modules (modules_to_save)",
    "lora_bias": "LoRA B biases",
    "fan_in_fan_out": "fan_in_fan_out (GPT-2 Conv1D) layouts",
    "target_parameters": "adapters on parameters (target_parameters)",
    "alora_invocation_tokens": "activated LoRA (aLoRA)",
    "layer_replication": "adapters that replicate layers (layer_replication)",
    "arrow_config": "Arrow routing over several LoRAs",
    "use_bdlora": "block-diagonal LoRA (BD-LoRA)",
}


# PEFT initialisations that rewrite the base weights the adapter then trains against (prefixes:
# "pissa_niter_16", "corda" modes).
_BASE_CHANGING_INITS = ("pissa", "corda", "olora", "loftq", "lora_ga")


@dataclass(frozen=True, slots=True)
class AdapterConfig:
    """The parts of a PEFT ``adapter_config.json`` that decide what a LoRA adapter computes."""

    rank: int
    alpha: float
    use_rslora: bool
    alpha_pattern: dict[str, float]

    @classmethod
    def from_dir(cls, adapter_dir: Path) -> "AdapterConfig":
        path = adapter_dir / "adapter_config.json"
        if not path.is_file():
            raise ModelLoadError(f"{adapter_dir}: no adapter_config.json (not a PEFT LoRA adapter directory)")
        raw = read_json_file(path)
        if raw.get("peft_type", "LORA") != "LORA":
            raise ModelLoadError(f"{path}: peft_type {raw.get('peft_type')!r} is not supported (only LORA)")
        for key, what in _REFUSED_FIELDS.items():
            if raw.get(key):
                raise ModelLoadError(f"{path}: {key} is set; {what} are not supported")
        init = raw.get("init_lora_weights", True)
        if isinstance(init, str) and init.lower().startswith(_BASE_CHANGING_INITS):
            # Trained on a residual base (W - BA, or a quantized one): on the untouched base the
            # adapter computes something else. PEFT redoes the init at load; converted, it is plain.
            raise ModelLoadError(
                f"{path}: init_lora_weights {init!r} adapters change the base weights they were trained on; convert it to a "
                "plain LoRA first (PEFT's save_pretrained(..., path_initial_model_for_weight_conversion=...))"
            )
        if raw.get("bias", "none") != "none":
            raise ModelLoadError(f"{path}: bias {raw['bias']!r} is not supported (only 'none': LoRA without trained biases)")
        rank, alpha = raw.get("r"), raw.get("lora_alpha")
        if not isinstance(rank, int) or rank < 1:
            raise ModelLoadError(f"{path}: r must be a positive integer, got {rank!r}")
        if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
            raise ModelLoadError(f"{path}: lora_alpha must be a number, got {alpha!r}")
        pattern = raw.get("alpha_pattern") or {}
        if not isinstance(pattern, dict) or not all(isinstance(v, (int, float)) for v in pattern.values()):
            raise ModelLoadError(f"{path}: alpha_pattern must map module names to numbers")
        for key in pattern:
            try:
                re.compile(str(key))
            except re.error as exc:
                raise ModelLoadError(f"{path}: alpha_pattern key {key!r} is not a valid pattern ({exc})") from None
        return cls(rank, float(alpha), bool(raw.get("use_rslora", False)), {str(k): float(v) for k, v in pattern.items()})

    def scaling(self, module_name: str, rank: int) -> float:
        """PEFT's scaling of one module (its own rank, from its tensors; rank_pattern included)."""
        # (The key as one group, as PEFT's get_pattern_key: "q_proj|v_proj" ends the name either way.)
        alpha = next((v for key, v in self.alpha_pattern.items() if re.match(rf"(.*\.)?({key})$", module_name)), self.alpha)
        return alpha / math.sqrt(rank) if self.use_rslora else alpha / rank


@dataclass(slots=True)
class LoraPair:
    """One adapter's delta on one engine projection: ``x @ a_t @ b_t`` (b_t carries the scaling)."""

    a_t: torch.Tensor  # [in_features (this rank's), rank]
    b_t: torch.Tensor  # [rank, out_features (this rank's)]


def load_adapter(adapter_dir: str | Path, config: ModelConfig, shard: TPShard, dtype: torch.dtype, device: str) -> list[dict[str, LoraPair]]:
    """Per decoder layer, the adapter's pairs by engine projection (a projection it leaves
    alone is absent), on ``device`` in ``dtype``, this rank's slices."""
    from engine.loader import CheckpointReader  # engine.loader imports the model, which imports this

    adapter_dir = _existing(adapter_dir)
    adapter = AdapterConfig.from_dir(adapter_dir)
    with CheckpointReader(adapter_dir) as reader:
        modules: dict[tuple[int, str], set[str]] = {}
        for name in reader.names:
            match = _TENSOR_NAME.match(name)
            if match is None or _BLOCK_OF.get(match.group(3)) != match.group(2) or int(match.group(1)) >= config.num_layers:
                raise ModelLoadError(
                    f"{adapter_dir}: tensor {name!r} is not a LoRA A/B weight of a {config.architecture} decoder layer's "
                    f"projection ({', '.join(_BLOCK_OF)}): embeddings, LM head and other modules are not supported"
                )
            modules.setdefault((int(match.group(1)), match.group(3)), set()).add(match.group(4))
        for (layer, module), halves in modules.items():
            if halves != {"A", "B"}:
                raise ModelLoadError(f"{adapter_dir}: layer {layer}'s {module} has lora_{''.join(halves)} but not its other half")
        layers = [_layer_pairs(reader, adapter, adapter_dir, layer, config, shard, dtype) for layer in range(config.num_layers)]
    return [{projection: LoraPair(a.to(device).contiguous(), b.to(device).contiguous()) for projection, (a, b) in pairs.items()} for pairs in layers]


def _layer_pairs(reader, adapter: AdapterConfig, adapter_dir: Path, layer: int, config: ModelConfig, shard: TPShard, dtype: torch.dtype):
    """One layer's (a_t, b_t) by engine projection, from the checkpoint projections' A and B."""
    read = ShardReader(lambda name, *slice_args: reader.read(name, torch.float32, *slice_args), config, shard)
    head_dim = config.head_dim
    # Each engine projection's parts: (checkpoint module, its rows of the fused output on this rank).
    q_rows, kv_rows = shard.num_heads * head_dim, shard.num_kv_heads * head_dim
    parts = {
        "qkv_proj": [("self_attn", "q_proj", q_rows), ("self_attn", "k_proj", kv_rows), ("self_attn", "v_proj", kv_rows)],
        "o_proj": [("self_attn", "o_proj", config.hidden_size)],
        "gate_up_proj": [("mlp", "gate_proj", shard.intermediate_size), ("mlp", "up_proj", shard.intermediate_size)],
        "down_proj": [("mlp", "down_proj", config.hidden_size)],
    }
    in_features = {"qkv_proj": config.hidden_size, "o_proj": q_rows, "gate_up_proj": config.hidden_size, "down_proj": shard.intermediate_size}
    out: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for projection, members in parts.items():
        a_blocks, b_blocks, row = [], [], 0
        for block, module, num_rows in members:
            base = f"base_model.model.model.layers.{layer}.{block}.{module}."
            if base + "lora_A.weight" not in reader.names:
                row += num_rows
                continue
            a, b = _read_pair(read, base, module, adapter_dir, layer, config)
            if a.shape[1] != in_features[projection] or b.shape[0] != num_rows:
                raise ModelLoadError(
                    f"{adapter_dir}: layer {layer}'s {module} maps {a.shape[1]} -> {b.shape[0]} features on this rank, "
                    f"the base model's {in_features[projection]} -> {num_rows}: the adapter was trained for another model"
                )
            rank = a.shape[0]
            b = b * adapter.scaling(f"model.layers.{layer}.{block}.{module}", rank)
            a_blocks.append(a)
            b_blocks.append((row, b))
            row += num_rows
        if not a_blocks:
            continue
        # Fused: A's ranks stacked; each part's B in its own rows and its own rank's columns.
        a_fused = torch.cat(a_blocks)
        b_fused = torch.zeros(row, a_fused.shape[0])
        col = 0
        for first_row, b in b_blocks:
            b_fused[first_row : first_row + b.shape[0], col : col + b.shape[1]] = b
            col += b.shape[1]
        out[projection] = (a_fused.t().to(dtype), b_fused.t().to(dtype))
    return out


def _read_pair(read: ShardReader, base: str, module: str, adapter_dir: Path, layer: int, config: ModelConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """(A [rank, in], B [out, rank]) of one checkpoint projection, sliced as its base weight is."""
    a_name, b_name = base + "lora_A.weight", base + "lora_B.weight"
    if module in ("o_proj", "down_proj"):  # row-parallel: A's input columns, B whole
        a = read.heads(a_name, dim=1) if module == "o_proj" else read.mlp(a_name, dim=1)
        b = read.whole(b_name)
    else:  # column-parallel: A whole, B's output rows
        a = read.whole(a_name)
        b = read.heads(b_name) if module == "q_proj" else read.kv_heads(b_name) if module in ("k_proj", "v_proj") else read.mlp(b_name)
    if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1]:
        raise ModelLoadError(f"{adapter_dir}: layer {layer}'s {module}: lora_A {list(a.shape)} and lora_B {list(b.shape)} do not share a rank")
    return a, b


def adapter_rank(adapter_dir: str | Path) -> int:
    """The largest rank an adapter's modules have (its ``r``, or a ``rank_pattern``'s)."""
    path = _existing(adapter_dir) / "adapter_config.json"
    raw = read_json_file(path) if path.is_file() else {}
    ranks = [raw.get("r"), *(raw.get("rank_pattern") or {}).values()]
    return max((r for r in ranks if isinstance(r, int) and not isinstance(r, bool)), default=0)


def adapter_digest(adapter_dir: str | Path) -> str:
    """What identifies an adapter's weights wherever its files are: a hash of its config and
    tensors. Its requests' prefix-cache hashes are salted with it, so blocks computed through
    one version of an adapter are never reused by another loaded under the same name."""
    adapter_dir = _existing(adapter_dir)
    digest = hashlib.sha256()
    for path in [adapter_dir / "adapter_config.json", *sorted(adapter_dir.glob("*.safetensors"))]:
        if path.is_file():
            digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:32]


def _existing(adapter: str | Path) -> Path:
    """An adapter's directory: a local one, or a Hugging Face id's snapshot in this node's cache
    (``org/name[@revision]``, as vLLM's --lora-modules takes them; engine.model_source: never
    downloaded). Each worker resolves an id on its own node, as it does the model's."""
    path = Path(adapter).expanduser()
    if path.is_dir():
        return path
    if is_hub_id(str(adapter)):
        return resolve_model(str(adapter), what="LoRA adapter").path
    raise ModelLoadError(f"LoRA adapter directory {adapter} does not exist")
