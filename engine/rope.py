"""Rotary position embeddings with the default, linear, llama3, yarn, dynamic-NTK and LongRoPE
frequency schedules, computed as transformers computes them.

Two schedules depend on the sequence's length in transformers, which switches frequencies (and
so every cached key's rotation) when a sequence grows past the pretraining context; a KV cache
cannot follow that. Here the schedule is fixed per engine from its ``max_positions``:
- dynamic NTK: the unscaled frequencies when every sequence fits ``max_position_embeddings``
  (transformers' own choice for such sequences), else the frequencies for ``max_positions``;
- LongRoPE: the short factors when every sequence fits the pretraining context, else the long
  ones (transformers' choice for a sequence beyond it).
So the result equals transformers' for every sequence when the engine's context (max_model_len)
fits the pretraining context, and for a sequence past it when the engine's context is long. A
long engine context gives a short sequence the long schedule too, unlike transformers (LongRoPE
checkpoints declare a long max_position_embeddings, so that is their default): said at start,
where max_model_len at the pretraining context is the exact choice.
"""

from __future__ import annotations

import hashlib
import logging
import math
import struct

import torch

from engine.config import RopeConfig

logger = logging.getLogger(__name__)


def _base_frequencies(theta: float, head_dim: int) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))


def inverse_frequencies(rope: RopeConfig, head_dim: int, max_positions: int | None = None) -> tuple[torch.Tensor, float]:
    """Per-pair rotation frequencies as the checkpoint's schedule says, and the factor that
    scales cos and sin (1 except for yarn and LongRoPE)."""
    kind = rope.scaling_type
    max_positions = max_positions or rope.max_position
    inv_freq = _base_frequencies(rope.theta, head_dim)
    if kind == "linear":
        return inv_freq / rope.factor, 1.0
    if kind == "llama3":
        return _llama3(rope, inv_freq), 1.0
    if kind == "yarn":
        return _yarn(rope, head_dim)
    if kind == "dynamic":
        if max_positions <= rope.max_position:
            return inv_freq, 1.0
        # NTK: a larger base, grown with the context beyond max_position_embeddings.
        stretch = rope.factor * max_positions / rope.max_position - (rope.factor - 1)
        return _base_frequencies(rope.theta * stretch ** (head_dim / (head_dim - 2)), head_dim), 1.0
    if kind == "longrope":
        return _longrope(rope, head_dim, max_positions)
    return inv_freq, 1.0


def _llama3(rope: RopeConfig, inv_freq: torch.Tensor) -> torch.Tensor:
    # Long wavelengths are slowed by `factor`, short ones kept, the band between blended.
    low_freq_wavelen = rope.original_max_position / rope.low_freq_factor
    high_freq_wavelen = rope.original_max_position / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (rope.original_max_position / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    blended = (1 - smooth) * scaled / rope.factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, blended, scaled)


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _yarn(rope: RopeConfig, head_dim: int) -> tuple[torch.Tensor, float]:
    """YaRN: pairs that turn fast within the pretraining context keep their frequency
    (extrapolation), slow ones are divided by `factor` (interpolation), with a linear ramp
    between the dimensions where beta_fast and beta_slow rotations fit the context."""
    factor = rope.factor
    if rope.attention_factor is not None:
        attention = rope.attention_factor
    elif rope.mscale and rope.mscale_all_dim:
        attention = _yarn_mscale(factor, rope.mscale) / _yarn_mscale(factor, rope.mscale_all_dim)
    else:
        attention = _yarn_mscale(factor)

    def dimension_for(rotations: float) -> float:
        # The pair index whose wavelength fits `rotations` times in the pretraining context.
        return head_dim * math.log(rope.original_max_position / (rotations * 2 * math.pi)) / (2 * math.log(rope.theta))

    low, high = dimension_for(rope.beta_fast), dimension_for(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # a ramp of zero width would divide by zero
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1: extrapolate (keep the frequency), 0: interpolate
    wavelengths = rope.theta ** (torch.arange(0, head_dim, 2).float() / head_dim)
    inv_freq = (1.0 / (factor * wavelengths)) * (1 - keep) + (1.0 / wavelengths) * keep
    return inv_freq, float(attention)


def _longrope(rope: RopeConfig, head_dim: int, max_positions: int) -> tuple[torch.Tensor, float]:
    if rope.short_factor is None or rope.long_factor is None:
        raise ValueError("longrope needs short_factor and long_factor")
    if rope.attention_factor is not None:
        attention = rope.attention_factor
    elif rope.factor <= 1.0:
        attention = 1.0
    else:
        attention = math.sqrt(1 + math.log(rope.factor) / math.log(rope.original_max_position))
    factors = rope.long_factor if max_positions > rope.original_max_position else rope.short_factor
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    return 1.0 / (torch.tensor(factors, dtype=torch.float32) * rope.theta**exponents), float(attention)


class RopeTables:
    """One step's rotation, used by every layer: its positions, and their cos/sin rows in the
    model's dtype, looked up once, when a layer first wants them (a step on CUDA whose layers
    rotate from the float32 table by position never does: two gathers a step saved)."""

    __slots__ = ("positions", "_rotary", "_cos", "_sin")

    def __init__(self, rotary: "RotaryEmbedding", positions: torch.Tensor):
        self.positions = positions  # [tokens] int64
        self._rotary = rotary
        self._cos: torch.Tensor | None = None
        self._sin: torch.Tensor | None = None

    @property
    def cos_sin_cache(self) -> torch.Tensor | None:
        """[max_positions, dim] float32, cos | sin: what the CUDA kernels read (None off CUDA)."""
        return self._rotary.cos_sin_cache

    @property
    def cos(self) -> torch.Tensor:
        """[tokens, 1, dim / 2] in the model's dtype."""
        if self._cos is None:
            self._cos = self._rotary.cos[self.positions].unsqueeze(1)
        return self._cos

    @property
    def sin(self) -> torch.Tensor:
        if self._sin is None:
            self._sin = self._rotary.sin[self.positions].unsqueeze(1)
        return self._sin


class RotaryEmbedding:
    """Precomputed cos/sin tables for every position up to ``max_positions``."""

    def __init__(self, rope: RopeConfig, head_dim: int, max_positions: int, dtype: torch.dtype, device: str, fused_cache: bool | None = None):
        inv_freq, scale = inverse_frequencies(rope, head_dim, max_positions)
        pretraining = {"dynamic": rope.max_position, "longrope": rope.original_max_position}.get(rope.scaling_type)
        if pretraining is not None and max_positions > pretraining:
            logger.warning(
                "%s rope: a context of %d positions takes the long schedule for every sequence, also those within the "
                "pretraining context (%d), where transformers keeps the short one; max_model_len %d gives its output there",
                rope.scaling_type, max_positions, pretraining, pretraining,
            )
        # What a key's rotation depends on beyond the config: the schedule chosen for
        # max_positions (dynamic NTK, LongRoPE). Workers copying KV blocks must agree on it.
        self.schedule_digest = hashlib.sha256(inv_freq.double().numpy().tobytes() + struct.pack("<d", scale)).hexdigest()[:16]
        positions = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(positions, inv_freq)
        # Computed in float32 and cast once, as transformers does, so low-precision runs agree.
        self.cos = (freqs.cos() * scale).to(dtype=dtype, device=device)
        self.sin = (freqs.sin() * scale).to(dtype=dtype, device=device)
        # FlashInfer's fused rotation (engine.fused_ops.rotate_qk_) takes the tables in float32,
        # whole (``fused_cache``: made; by default on CUDA only).
        self.cos_sin_cache = None
        if fused_cache or (fused_cache is None and torch.device(device).type == "cuda"):
            self.cos_sin_cache = torch.cat([freqs.cos() * scale, freqs.sin() * scale], dim=-1).to(device)

    def tables(self, positions: torch.Tensor) -> RopeTables:
        """The step's tables for ``positions``."""
        return RopeTables(self, positions)

    def apply(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate q [tokens, heads, dim] and k [tokens, kv_heads, dim] by their positions."""
        tables = self.tables(positions)
        return _rotate(q, tables.cos, tables.sin), _rotate(k, tables.cos, tables.sin)

    @staticmethod
    def rotate(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``apply`` with the tables already looked up."""
        return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
