"""The supported architectures, one module each (a new one is a module here plus its test).

Each module defines ``ARCHITECTURE``: how its ``config.json`` fields become the shared decoder's
traits, and how its checkpoint tensors map onto the engine's model.
"""

from engine.architectures import llama, mistral, qwen2, qwen3
from engine.architectures.base import Architecture, Traits

ARCHITECTURES: dict[str, Architecture] = {m.ARCHITECTURE.name: m.ARCHITECTURE for m in (llama, mistral, qwen2, qwen3)}

__all__ = ["ARCHITECTURES", "Architecture", "Traits"]
