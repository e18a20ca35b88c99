"""Paged attention behind one seam: a backend builds each step's metadata once, every layer
calls its ``forward`` (write the new KV, attend).

Backends, one module each: ``cpu`` (the native kernels, reading the cache in place on a CPU),
``sdpa`` (portable: gather + SDPA, any device, dtype or cache), ``flashinfer_paged`` (CUDA).
``registry.select_backend`` picks one from the device and ``EngineConfig.attention_backend``.
"""

from engine.attention.base import AttentionBackend, AttentionMetadata, SeqSlice, paged_attention
from engine.attention.registry import CacheGeometry, select_backend

__all__ = ["AttentionBackend", "AttentionMetadata", "CacheGeometry", "SeqSlice", "paged_attention", "select_backend"]
