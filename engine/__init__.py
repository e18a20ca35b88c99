"""Model execution: checkpoint loading, paged KV cache, scheduling, sampling, one step().

The names below load on first use: the router imports this package's plain-data modules
(sampling parameters, statistics, errors) and must not pay for torch and the model code.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "DEFAULT_MODEL_PATH": "engine.default_model_path",
    "Completion": "engine.llm_engine",
    "EngineConfig": "engine.config",
    "EngineError": "engine.errors",
    "FinishReason": "engine.sequence",
    "InvalidRequestError": "engine.errors",
    "LLMEngine": "engine.llm_engine",
    "ModelConfig": "engine.config",
    "ModelLoadError": "engine.errors",
    "RequestOutput": "engine.llm_engine",
    "SamplingParams": "engine.sampling_params",
    "TokenLogprob": "engine.sampling_params",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
