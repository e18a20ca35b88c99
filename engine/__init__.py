"""Model execution: checkpoint loading, paged KV cache, scheduling, sampling, one step()."""

from engine.config import EngineConfig, ModelConfig
from engine.default_model_path import DEFAULT_MODEL_PATH
from engine.errors import EngineError, InvalidRequestError, ModelLoadError
from engine.llm_engine import Completion, LLMEngine, RequestOutput
from engine.sampling_params import SamplingParams
from engine.sequence import FinishReason, TokenLogprob

__all__ = [
    "DEFAULT_MODEL_PATH",
    "Completion",
    "EngineConfig",
    "EngineError",
    "FinishReason",
    "InvalidRequestError",
    "LLMEngine",
    "ModelConfig",
    "ModelLoadError",
    "RequestOutput",
    "SamplingParams",
    "TokenLogprob",
]
