"""Load a Hugging Face checkpoint directory into the engine's model.

Reads ``config.json``, single-file or sharded (``model.safetensors.index.json``)
safetensors weights and ``generation_config.json``. Separate q/k/v and gate/up weights
are fused into the engine's projections while loading. Every problem names the file or
tensor at fault.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from engine import device_caps
from engine.architectures import ARCHITECTURES
from engine.config import ModelConfig
from engine.cpu_linear import can_prepack, prepack_linears
from engine.errors import ModelLoadError
from engine.model import CausalLM
from engine.rope import RotaryEmbedding

logger = logging.getLogger(__name__)

_SKIPPED_SUFFIXES = ("rotary_emb.inv_freq",)


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
) -> LoadedModel:
    """Build the model for ``model_dir`` and fill it with the checkpoint's weights."""
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise ModelLoadError(f"model directory {model_dir} does not exist")
    config = ModelConfig.from_model_dir(model_dir)
    torch_dtype = resolve_dtype(config, dtype, device)
    weights = _read_weights(model_dir)
    rotary = RotaryEmbedding(
        config.rope, config.head_dim, max_positions or config.max_position_embeddings, torch_dtype, device
    )
    # Built on the meta device and then handed the checkpoint's tensors: no double allocation.
    with torch.device("meta"):
        model = CausalLM(config, rotary)
    state = _engine_state_dict(weights, config, torch_dtype)
    model.load_state_dict(state, strict=True, assign=True)
    model = model.to(device).eval()
    num_packed = prepack_linear and can_prepack(device, torch_dtype) and prepack_linears(model)
    eos_ids = _generation_eos_ids(model_dir) or config.eos_token_ids
    logger.info(
        "loaded %s from %s: %d layers, hidden %d, dtype %s, %d linears prepacked (oneDNN or bfloat16 pairs)",
        config.architecture,
        model_dir,
        config.num_layers,
        config.hidden_size,
        torch_dtype,
        num_packed or 0,
    )
    return LoadedModel(model=model, config=config, dtype=torch_dtype, eos_token_ids=eos_ids, model_dir=model_dir)


def _read_weights(model_dir: Path) -> dict[str, torch.Tensor]:
    index_path = model_dir / "model.safetensors.index.json"
    if index_path.is_file():
        try:
            weight_map = json.loads(index_path.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as exc:
            raise ModelLoadError(f"{index_path}: not a valid safetensors index ({exc})") from exc
        files = sorted(set(weight_map.values()))
    else:
        files = sorted(p.name for p in model_dir.glob("*.safetensors"))
        if not files:
            raise ModelLoadError(f"{model_dir}: no *.safetensors weight file (PyTorch .bin checkpoints are not supported)")
    tensors: dict[str, torch.Tensor] = {}
    for name in files:
        path = model_dir / name
        if not path.is_file():
            raise ModelLoadError(f"{model_dir}: weight file {name} is listed in the index but missing")
        try:
            with safe_open(str(path), framework="pt") as handle:
                for key in handle.keys():
                    tensors[key] = handle.get_tensor(key)
                    if not tensors[key].is_floating_point() or tensors[key].element_size() == 1:
                        raise ModelLoadError(
                            f"{path}: tensor {key!r} is {tensors[key].dtype}: quantized weights are not supported"
                        )
        except ModelLoadError:
            raise
        except Exception as exc:  # safetensors raises its own error types for corrupt files
            raise ModelLoadError(f"{path}: cannot read safetensors file ({exc})") from exc
    return tensors


def _engine_state_dict(weights: dict[str, torch.Tensor], config: ModelConfig, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    taken: set[str] = set()

    def take(name: str) -> torch.Tensor:
        try:
            tensor = weights[name].to(dtype)
        except KeyError:
            raise ModelLoadError(f"checkpoint has no tensor {name!r}") from None
        taken.add(name)
        return tensor

    state = ARCHITECTURES[config.architecture].state_dict(take, config)
    # A tied checkpoint may still carry its lm_head copy; nothing else may go unused.
    spare = {"lm_head.weight"} if config.tie_word_embeddings else set()
    unused = [k for k in weights if k not in taken and k not in spare and not k.endswith(_SKIPPED_SUFFIXES)]
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
