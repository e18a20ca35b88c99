"""LoRA adapters served beside the base model: each request may name one (multi-LoRA serving,
as vLLM's ``--lora-modules`` and S-LoRA do it), and a step's rows of different adapters share
the base model's matmuls.

An adapter is a PEFT LoRA directory (``adapter_config.json``, ``adapter_model.safetensors``)
for the base checkpoint's attention and MLP projections. At load each targeted projection's
pair becomes one pair per engine projection: q/k/v (and gate/up) are fused there, so their
A matrices are stacked and their B matrices placed block-diagonally in the fused output, B
pre-multiplied by the adapter's scaling (``lora_alpha / r``, or ``/ sqrt(r)`` with rsLoRA).
A tensor-parallel rank holds its slices: B's rows of its heads or MLP columns for the
column-parallel projections, A's columns of its heads or MLP columns for o_proj and
down_proj, whose partial deltas the layer's all-reduce sums with the base's.

A step adds ``(x[rows] @ A^T) @ B^T`` to each projection's output for each adapter's rows
(``AdapterRows``): in place where an adapter's rows are contiguous, else through two batched
matmuls over every slot's stacked pairs (``SlotStack``), whatever the number of adapters; the
base matmuls stay shared.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from engine.architectures.base import ShardReader
from engine.config import ModelConfig
from engine.errors import ModelLoadError
from engine.host_to_device import to_device
from engine.parallel.shard import TPShard

logger = logging.getLogger(__name__)

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
        try:
            raw = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise ModelLoadError(f"{path}: not valid JSON ({exc})") from exc
        if raw.get("peft_type", "LORA") != "LORA":
            raise ModelLoadError(f"{path}: peft_type {raw.get('peft_type')!r} is not supported (only LORA)")
        for key, what in _REFUSED_FIELDS.items():
            if raw.get(key):
                raise ModelLoadError(f"{path}: {key} is set; {what} are not supported")
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
        alpha = next((v for key, v in self.alpha_pattern.items() if re.match(rf"(.*\.)?{key}$", module_name)), self.alpha)
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

    adapter_dir = Path(adapter_dir)
    if not adapter_dir.is_dir():
        raise ModelLoadError(f"LoRA adapter directory {adapter_dir} does not exist")
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


class SlotStack:
    """One engine projection's pairs of every adapter slot, stacked for batched matmuls:
    ``a`` [slots, in, rank] and ``b`` [slots, rank, out], ranks zero-padded to the largest, a slot
    whose adapter leaves the projection alone (or an empty slot) all zeros."""

    def __init__(self, a: torch.Tensor, b: torch.Tensor, present: list[bool]):
        self.a, self.b, self.present = a, b, present

    @classmethod
    def of(cls, pairs: list["LoraPair | None"], like: "LoraPair") -> "SlotStack":
        rank = max(p.a_t.shape[1] for p in pairs if p is not None)
        a = like.a_t.new_zeros((len(pairs), like.a_t.shape[0], rank))
        b = like.b_t.new_zeros((len(pairs), rank, like.b_t.shape[1]))
        for slot, pair in enumerate(pairs):
            if pair is not None:
                a[slot, :, : pair.a_t.shape[1]] = pair.a_t
                b[slot, : pair.b_t.shape[0]] = pair.b_t
        return cls(a, b, [p is not None for p in pairs])

    def pairs(self) -> list["LoraPair | None"]:
        """Each slot's pair back (views into the stack), None where empty."""
        return [LoraPair(self.a[s], self.b[s]) if here else None for s, here in enumerate(self.present)]


class AdapterRows:
    """Which rows of one step go through which adapter: built once per step by the model
    runner, handed to every layer, which adds each adapter's delta to those rows' projections.

    Where each adapter's rows are already contiguous (a prompt chunk, a batch of one adapter)
    its delta is one pair of matmuls added in place. Else the rows with an adapter are gathered
    once per projection, grouped by adapter and padded to the largest group, and every group's
    delta comes from one batched matmul pair over the stacked weights (``SlotStack``), added back
    with one ``index_add_``: a step's cost in calls does not grow with its adapters."""

    def __init__(self, runs: list[tuple[int, int, int]], grouped: "_Grouped | None" = None):
        self.runs = runs  # (adapter slot, first, end) of contiguous rows (used where ``grouped`` is None)
        self.grouped = grouped

    @classmethod
    def of_slices(cls, slice_adapters: list[int], slice_lengths: list[int], device: str) -> "AdapterRows | None":
        """From each slice's adapter slot (-1: none) and row count, in step order; None when no
        row of the step has an adapter."""
        rows: dict[int, list[int]] = {}
        first = 0
        for slot, length in zip(slice_adapters, slice_lengths):
            if slot >= 0:
                rows.setdefault(slot, []).extend(range(first, first + length))
            first += length
        if not rows:
            return None
        if all(indices[-1] - indices[0] + 1 == len(indices) for indices in rows.values()):
            return cls([(slot, indices[0], indices[-1] + 1) for slot, indices in rows.items()])
        return cls([], _Grouped.of(rows, device))

    def add_deltas(self, out: torch.Tensor, x: torch.Tensor, stack: SlotStack) -> torch.Tensor:
        """``out`` (a projection's output for ``x``) with each adapter's delta added to its rows."""
        if self.grouped is None:
            for slot, first, end in self.runs:
                if stack.present[slot]:
                    out[first:end].addmm_(x[first:end] @ stack.a[slot], stack.b[slot])
            return out
        return self.grouped.add_deltas(out, x, stack)


class _Grouped:
    """A step's adapter rows grouped by adapter, each group padded to ``size`` rows."""

    def __init__(self, slots: list[int], size: int, gather: torch.Tensor, targets: torch.Tensor, real: torch.Tensor | None, device: str):
        self.slots = slots
        self.slot_index = to_device(slots, torch.long, device)
        self.size = size
        self.gather = gather  # [groups * size] rows of x (padding repeats a group's first row)
        self.targets = targets  # the real rows, in the order of ``real``
        self.real = real  # positions of the real rows among the padded ones (None: no padding)

    @classmethod
    def of(cls, rows: dict[int, list[int]], device: str) -> "_Grouped":
        size = max(len(indices) for indices in rows.values())
        gather, targets, real = [], [], []
        for group, indices in enumerate(rows.values()):
            targets.extend(indices)
            real.extend(range(group * size, group * size + len(indices)))
            gather.extend(indices + [indices[0]] * (size - len(indices)))
        padded = len(gather) != len(targets)
        return cls(list(rows), size, to_device(gather, torch.long, device), to_device(targets, torch.long, device),
                   to_device(real, torch.long, device) if padded else None, device)

    def add_deltas(self, out: torch.Tensor, x: torch.Tensor, stack: SlotStack) -> torch.Tensor:
        if not any(stack.present[slot] for slot in self.slots):
            return out
        if self.slots == list(range(len(stack.present))):  # every slot, in order: the stack as it is
            a, b = stack.a, stack.b
        else:
            a, b = stack.a.index_select(0, self.slot_index), stack.b.index_select(0, self.slot_index)
        gathered = x.index_select(0, self.gather).view(len(self.slots), self.size, x.shape[-1])
        deltas = torch.bmm(torch.bmm(gathered, a), b).view(-1, out.shape[-1])
        if self.real is not None:
            deltas = deltas.index_select(0, self.real)
        return out.index_add_(0, self.targets, deltas)


def adapter_digest(adapter_dir: str | Path) -> str:
    """What identifies an adapter's weights wherever its files are: a hash of its config and
    tensors. Its requests' prefix-cache hashes are salted with it, so blocks computed through
    one version of an adapter are never reused by another loaded under the same name."""
    adapter_dir = Path(adapter_dir)
    if not adapter_dir.is_dir():
        raise ModelLoadError(f"LoRA adapter directory {adapter_dir} does not exist")
    digest = hashlib.sha256()
    for path in [adapter_dir / "adapter_config.json", *sorted(adapter_dir.glob("*.safetensors"))]:
        if path.is_file():
            digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:32]


def install_adapter(model: torch.nn.Module, slot: int, adapter_dir: str | Path, dtype: torch.dtype, device: str) -> None:
    """Load an adapter for ``model``'s shard into slot ``slot`` of every decoder layer (replacing
    whatever the slot held)."""
    loaded = load_adapter(adapter_dir, model.config, model.shard, dtype, device)
    # Every projection's stack covers every slot a step may name (a row's slot indexes them all).
    num_slots = max([slot + 1, *(len(stack.present) for layer in model.layers for stack in layer.lora.values())])
    for layer, pairs in zip(model.layers, loaded):
        for projection in PROJECTIONS:
            _set_slot(layer, projection, slot, pairs.get(projection), num_slots)
    logger.info("LoRA adapter %s loaded into slot %d", adapter_dir, slot)


def remove_adapter(model: torch.nn.Module, slot: int) -> None:
    """Free slot ``slot``'s weights in every decoder layer."""
    for layer in model.layers:
        for projection in list(layer.lora):
            _set_slot(layer, projection, slot, None, len(layer.lora[projection].present))


def _set_slot(layer: torch.nn.Module, projection: str, slot: int, pair: LoraPair | None, num_slots: int) -> None:
    """Restack one projection's ``num_slots`` slots with ``pair`` in ``slot`` (the projection
    dropped where no slot has a pair left)."""
    stack = layer.lora.get(projection)
    pairs = stack.pairs() if stack is not None else []
    pairs.extend([None] * (num_slots - len(pairs)))
    pairs[slot] = pair
    like = next((p for p in pairs if p is not None), None)
    if like is None:
        layer.lora.pop(projection, None)
    else:
        layer.lora[projection] = SlotStack.of(pairs, like)


@dataclass(slots=True)
class AdapterTable:
    """The adapter versions an engine holds, each by digest in a slot of the model, and the
    version each name gives a new request.

    A request keeps the version it started with (``Sequence.adapter_slot``), or the one its
    router pinned (``SamplingParams.lora_digest``): a version replaced under its name stays held
    until dropped (``drop``), and a dropped one until no running request uses it (``release``)."""

    names: dict[str, str] = field(default_factory=dict)  # name -> digest new requests by that name get
    slots: dict[str, int] = field(default_factory=dict)  # digest -> slot, every version held
    retiring: set[str] = field(default_factory=set)  # dropped digests, freed once unused

    def __bool__(self) -> bool:
        return bool(self.slots)

    @property
    def served(self) -> dict[str, str]:
        """Name -> digest of the adapters new requests may name."""
        return dict(self.names)

    def resolve(self, name: str, digest: str | None) -> str | None:
        """The digest a request through ``name`` (pinned to ``digest`` where given) computes with;
        None if this engine does not hold it."""
        if digest is None:
            return self.names.get(name)
        return digest if digest in self.slots else None

    def free_slot(self) -> int:
        taken = set(self.slots.values())
        return next(slot for slot in range(len(taken) + 1) if slot not in taken)

    def add(self, name: str, digest: str, slot: int) -> None:
        self.names[name], self.slots[digest] = digest, slot
        self.retiring.discard(digest)

    def drop(self, digest: str) -> bool:
        """No new request gets this version (its names are forgotten); False if not held."""
        if digest not in self.slots:
            return False
        self.retiring.add(digest)
        for name in [n for n, d in self.names.items() if d == digest]:
            del self.names[name]
        return True

    def release(self, slots_in_use: set[int]) -> list[int]:
        """The slots of dropped versions no request uses any more (forgotten here)."""
        freed = []
        for digest in sorted(self.retiring):
            if self.slots[digest] not in slots_in_use:
                freed.append(self.slots.pop(digest))
                self.retiring.discard(digest)
        return freed
