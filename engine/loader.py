"""Load a Hugging Face checkpoint directory into the engine's model.

Reads ``config.json``, single-file or sharded (``model.safetensors.index.json``)
safetensors weights and ``generation_config.json``. Separate q/k/v and gate/up weights
are fused into the engine's projections while loading. Every problem names the file or
tensor at fault.

A tensor-parallel rank (``shard``) reads only its own slices of each tensor straight from the
files (safetensors' sliced reads through its memory map): no rank ever holds the whole model.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from engine import device_caps
from engine.architectures import ARCHITECTURES
from engine.config import ModelConfig
from engine.cpu_linear import can_prepack, prepack_linears
from engine.errors import ModelLoadError
from engine.lora import install_adapter
from engine.model import CausalLM
from engine.parallel.group import SINGLE, TPGroup
from engine.parallel.shard import TPShard
from engine.rope import RotaryEmbedding

logger = logging.getLogger(__name__)

_SKIPPED_SUFFIXES = ("rotary_emb.inv_freq",)
# safetensors' element types the engine computes with (others are quantized or unknown).
_FLOAT_TYPES = {"F64": "float64", "F32": "float32", "BF16": "bfloat16", "F16": "float16"}


@dataclass(slots=True)
class LoadedModel:
    model: CausalLM
    config: ModelConfig
    dtype: torch.dtype
    eos_token_ids: list[int]
    model_dir: Path


def resolve_dtype(config: ModelConfig, dtype: str | None, device: str = "cpu") -> torch.dtype:
    try:
        return device_caps.resolve_dtype(dtype, config.checkpoint_dtype, device)
    except ValueError as exc:
        raise ModelLoadError(str(exc)) from None


def load_model(
    model_dir: str | Path,
    dtype: str | None = None,
    device: str = "cpu",
    max_positions: int | None = None,
    prepack_linear: bool = False,
    tp_size: int = 1,
    group: TPGroup = SINGLE,
    lora_adapters: dict[str, str] | None = None,
) -> LoadedModel:
    """Build the model for ``model_dir`` (rank ``group.rank``'s shard of it when ``tp_size`` > 1)
    and fill it with the checkpoint's weights; ``lora_adapters`` (name -> PEFT adapter directory)
    are loaded beside it, a slot each in that order (engine.lora)."""
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise ModelLoadError(f"model directory {model_dir} does not exist")
    config = ModelConfig.from_model_dir(model_dir)
    torch_dtype = resolve_dtype(config, dtype, device)
    try:
        shard = TPShard.of(config, tp_size, group.rank)
    except ValueError as exc:
        raise ModelLoadError(f"{model_dir}: {exc}") from None
    rotary = RotaryEmbedding(
        config.rope, config.head_dim, max_positions or config.max_position_embeddings, torch_dtype, device
    )
    # Built on the meta device and then handed the checkpoint's tensors: no double allocation.
    with torch.device("meta"):
        model = CausalLM(config, rotary, shard, group)
    with CheckpointReader(model_dir) as reader:
        state = _engine_state_dict(reader, config, torch_dtype, shard)
    model.load_state_dict(state, strict=True, assign=True)
    model = model.to(device).eval()
    num_packed = prepack_linear and can_prepack(device, torch_dtype) and prepack_linears(model)
    for slot, adapter_dir in enumerate((lora_adapters or {}).values()):
        install_adapter(model, slot, adapter_dir, torch_dtype, device)
    eos_ids = _generation_eos_ids(model_dir) or config.eos_token_ids
    logger.info(
        "loaded %s from %s: %d layers, hidden %d, dtype %s, rank %d of %d, %d linears prepacked (oneDNN or bfloat16 pairs)",
        config.architecture,
        model_dir,
        config.num_layers,
        config.hidden_size,
        torch_dtype,
        shard.rank,
        shard.tp_size,
        num_packed or 0,
    )
    return LoadedModel(model=model, config=config, dtype=torch_dtype, eos_token_ids=eos_ids, model_dir=model_dir)


def weights_digest(model_dir: str | Path) -> str:
    """A short digest of the checkpoint's weights: each tensor's name, shape, and first and last
    rows (a row's elements; a 1-d tensor's first 64) as float32 values, read whole from the
    files, so every tensor-parallel size, every split of the files and every dtype the engines
    run in gives the same. Two workers whose KV blocks are copied between them must hold the same
    weights: a fine-tune with its base's config.json computes other KV, and its blocks decode to
    garbage. (Rotary frequency buffers some checkpoints save are no weights: left out.)"""
    digest = hashlib.sha256()
    with CheckpointReader(Path(model_dir)) as reader:
        for name in sorted(reader.names):
            if name.endswith("rotary_emb.inv_freq"):
                continue
            shape = reader.shape(name)
            rows = shape[0] if shape else 1
            if not shape:
                pieces = [reader.read(name, torch.float32)]
            elif len(shape) == 1 or rows == 0:
                pieces = [reader.read(name, torch.float32, 0, 0, min(rows, 64))]
            else:
                pieces = [reader.read(name, torch.float32, 0, 0, 1), reader.read(name, torch.float32, 0, rows - 1, rows)]
            digest.update(f"{name}:{shape};".encode())
            for piece in pieces:
                digest.update(piece.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()[:16]


def checkpoint_files(model_dir: Path) -> list[str]:
    """The weight files a model's weights are read from: those its safetensors index names, or
    every ``*.safetensors`` (a repository's other copies, ``.bin`` files or a consolidated file
    beside an index, are never read)."""
    index_path = model_dir / "model.safetensors.index.json"
    if index_path.is_file():
        try:
            weight_map = json.loads(index_path.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as exc:
            raise ModelLoadError(f"{index_path}: not a valid safetensors index ({exc})") from exc
        return sorted(set(weight_map.values()))
    files = sorted(p.name for p in model_dir.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{model_dir}: no *.safetensors weight file (PyTorch .bin checkpoints are not supported)")
    return files


class CheckpointReader:
    """The checkpoint's tensors by name, read on demand (whole, or a slice along one dimension).

    Reads go through ``pread`` into memory the model then owns, not through a memory map: a
    tensor-parallel rank touches only the bytes of its slices (row slices are one read, column
    slices a read per band of rows), so its peak memory is its shard, not the files.
    """

    _BAND_BYTES = 4 * 1024 * 1024  # column slices are read this many bytes of rows at a time

    def __init__(self, model_dir: Path):
        self.model_dir = model_dir
        self._files: dict[str, int] = {}  # file name -> descriptor
        self._entries: dict[str, tuple[str, str, list[int], int]] = {}  # name -> (file, dtype, shape, data start)
        try:
            for name in checkpoint_files(model_dir):
                self._index_file(name)
        except BaseException:
            self.close()
            raise

    def _index_file(self, name: str) -> None:
        path = self.model_dir / name
        if not path.is_file():
            raise ModelLoadError(f"{self.model_dir}: weight file {name} is listed in the index but missing")
        fd = os.open(path, os.O_RDONLY)
        self._files[name] = fd
        try:
            (header_len,) = struct.unpack("<Q", os.pread(fd, 8, 0))
            header = json.loads(os.pread(fd, header_len, 8))
            data_start = 8 + header_len
            for key, entry in header.items():
                if key == "__metadata__":
                    continue
                kind = entry["dtype"]
                if kind not in _FLOAT_TYPES:
                    raise ModelLoadError(f"{path}: tensor {key!r} is {_dtype_label(kind)}: quantized weights are not supported")
                self._entries[key] = (name, kind, [int(d) for d in entry["shape"]], data_start + int(entry["data_offsets"][0]))
        except ModelLoadError:
            raise
        except Exception as exc:  # a truncated or corrupt header
            raise ModelLoadError(f"{path}: cannot read safetensors file ({type(exc).__name__}: {exc})") from exc

    def __enter__(self) -> "CheckpointReader":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def close(self) -> None:
        for fd in self._files.values():
            os.close(fd)
        self._files.clear()

    @property
    def names(self) -> list[str]:
        return list(self._entries)

    def shape(self, name: str) -> list[int]:
        return list(self._entries[name][2])

    def read(self, name: str, dtype: torch.dtype, dim: int | None = None, start: int = 0, stop: int | None = None) -> torch.Tensor:
        """Tensor ``name`` in ``dtype``; with ``dim`` (0 or 1), only indices [start, stop) along it."""
        entry = self._entries.get(name)
        if entry is None:
            raise ModelLoadError(f"checkpoint has no tensor {name!r}")
        file, kind, shape, offset = entry
        stored = getattr(torch, _FLOAT_TYPES[kind])
        item = torch.empty((), dtype=stored).element_size()
        fd = self._files[file]
        rows = shape[0] if shape else 1
        row_elems = 1
        for size in shape[1:]:
            row_elems *= size
        if dim is None or dim == 0:
            first, last = (0, rows) if dim is None else (start, rows if stop is None else stop)
            out_shape = shape if dim is None else [last - first, *shape[1:]]
            tensor = self._pread(fd, offset + first * row_elems * item, (last - first) * row_elems, stored).view(out_shape)
        elif dim == 1 and len(shape) == 2:
            last = shape[1] if stop is None else stop
            tensor = torch.empty((rows, last - start), dtype=stored)
            band = max(1, self._BAND_BYTES // max(1, row_elems * item))
            for row in range(0, rows, band):
                count = min(band, rows - row)
                block = self._pread(fd, offset + row * row_elems * item, count * row_elems, stored).view(count, row_elems)
                tensor[row : row + count] = block[:, start:last]
        else:
            raise ModelLoadError(f"{name}: cannot slice a {len(shape)}-d tensor along dimension {dim}")
        return tensor.to(dtype)

    @staticmethod
    def _pread(fd: int, offset: int, count: int, dtype: torch.dtype) -> torch.Tensor:
        item = torch.empty((), dtype=dtype).element_size()
        buffer = bytearray(count * item)
        view = memoryview(buffer)
        done = 0
        while done < len(buffer):
            got = os.preadv(fd, [view[done:]], offset + done)
            if got <= 0:
                raise ModelLoadError(f"weight file ends before its tensors do (at byte {offset + done})")
            done += got
        return torch.frombuffer(buffer, dtype=dtype) if count else torch.empty(0, dtype=dtype)


def _dtype_label(kind: str) -> str:
    labels = {"I8": "int8", "U8": "uint8", "I16": "int16", "I32": "int32", "I64": "int64", "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2", "BOOL": "bool"}
    return labels.get(kind, kind)


def _engine_state_dict(reader: CheckpointReader, config: ModelConfig, dtype: torch.dtype, shard: TPShard) -> dict[str, torch.Tensor]:
    taken: set[str] = set()

    def take(name: str, dim: int | None = None, start: int = 0, stop: int | None = None) -> torch.Tensor:
        tensor = reader.read(name, dtype, dim, start, stop)
        taken.add(name)
        return tensor

    state = ARCHITECTURES[config.architecture].state_dict(take, config, shard)
    # A tied checkpoint may still carry its lm_head copy; nothing else may go unused.
    spare = {"lm_head.weight"} if config.tie_word_embeddings else set()
    unused = [k for k in reader.names if k not in taken and k not in spare and not k.endswith(_SKIPPED_SUFFIXES)]
    if unused:
        # A tensor the model code has no place for means it computes something else than the
        # checkpoint's model (a bias its config did not announce, another architecture's layer).
        raise ModelLoadError(
            f"checkpoint tensors the {config.architecture} model code has no place for: {', '.join(sorted(unused)[:8])}"
            + (f" and {len(unused) - 8} more" if len(unused) > 8 else "")
        )
    return state


def _generation_eos_ids(model_dir: Path) -> list[int]:
    path = model_dir / "generation_config.json"
    if not path.is_file():
        return []
    try:
        value = json.loads(path.read_text()).get("eos_token_id")
    except json.JSONDecodeError:
        logger.warning("%s is not valid JSON; using config.json's eos_token_id", path)
        return []
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, list) else [int(value)]
