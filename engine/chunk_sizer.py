"""Adaptive chunk size (dynamic split-fuse): size prompt chunks so that steps which also decode
stay within a step-time target.

An engine that mixes prefill chunks and decode tokens in one step makes every running stream
wait for the chunk: with a fixed chunk, either TPOT suffers (large chunks) or prefill
throughput does (small chunks, where per-step costs dominate). This sizer learns the engine's
step time online, as a linear model of the step's work (the terms of ``engine.step_profile``:
prefill tokens, their attention work, decode rows and the KV tokens they read), by recursive
least squares that slowly forgets, so it follows the machine as it is now. Each step it
allows the largest prefill chunk that the model says fits in the target next to this step's
decode work; a step without decode work is not limited (prefill as fast as it can).
"""

from __future__ import annotations

import math

import numpy as np

from engine.step_profile import StepShape

# Features, scaled to be of order one for the machine's usual steps.
_SCALES = np.array([1.0, 512.0, 512.0 * 2048.0, 64.0, 64.0 * 2048.0])
_MIN_SAMPLES = 8  # steps observed before the model is trusted (until then: min_chunk)
_MIN_TOKEN_COST_S = 1e-7


class AdaptiveChunkSizer:
    def __init__(self, target_step_s: float, min_chunk: int, max_tokens: int, forgetting: float = 0.995):
        if not target_step_s > 0:
            raise ValueError(f"target_step_ms: must be > 0, got {target_step_s * 1000:g}")
        self.target_step_s = target_step_s
        self.min_chunk = max(1, min_chunk)
        self.max_tokens = max(self.min_chunk, max_tokens)
        self.forgetting = forgetting
        self.num_samples = 0
        self._theta = np.zeros(len(_SCALES))
        self._covariance = np.eye(len(_SCALES)) * 1e3
        self.last_allowed: int | None = None  # the most recent limit given (for stats and tests)

    def observe(self, shape: StepShape, duration_s: float) -> None:
        """One step's work and how long it took."""
        x = np.array([1.0, shape.num_prefill_tokens, shape.prefill_attention, shape.num_decode_rows, shape.num_decode_kv_tokens]) / _SCALES
        px = self._covariance @ x
        gain = px / (self.forgetting + x @ px)
        self._theta += gain * (duration_s - x @ self._theta)
        self._covariance = (self._covariance - np.outer(gain, px)) / self.forgetting
        if np.trace(self._covariance) > 1e6:  # directions no step excites: keep them from winding up
            self._covariance *= 1e6 / np.trace(self._covariance)
        self.num_samples += 1

    def predicted_step_s(self, shape: StepShape) -> float:
        x = np.array([1.0, shape.num_prefill_tokens, shape.prefill_attention, shape.num_decode_rows, shape.num_decode_kv_tokens]) / _SCALES
        return float(x @ self._theta)

    def prefill_tokens(self, num_decode_rows: int, num_decode_kv_tokens: int, first_context: int) -> int | None:
        """Prefill tokens a step with this decode work may carry (None: no limit, it decodes nothing).

        ``first_context``: tokens already computed of the prompt the chunk continues, for its
        attention cost.
        """
        if num_decode_rows == 0:
            return None
        if self.num_samples < _MIN_SAMPLES:
            allowed = self.min_chunk
        else:
            coef = self._theta / _SCALES
            room = self.target_step_s - (coef[0] + coef[3] * num_decode_rows + coef[4] * num_decode_kv_tokens)
            per_token = max(coef[1] + coef[2] * first_context, _MIN_TOKEN_COST_S)
            quadratic = max(coef[2], 0.0) / 2  # each chunk token also attends over the chunk before it
            if room <= 0:
                allowed = self.min_chunk
            elif quadratic > 0:
                allowed = (-per_token + math.sqrt(per_token * per_token + 4 * quadratic * room)) / (2 * quadratic)
            else:
                allowed = room / per_token
            allowed = int(min(max(allowed, self.min_chunk), self.max_tokens))
        self.last_allowed = allowed
        return allowed
