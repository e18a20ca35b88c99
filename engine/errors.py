"""Errors the engine raises; the router maps them to gRPC status codes in one place."""

from __future__ import annotations

import json
from pathlib import Path


class EngineError(Exception):
    """Base class of every error the engine raises on purpose."""


class InvalidRequestError(EngineError, ValueError):
    """A request's field is invalid; ``field`` names it for the API edge."""

    def __init__(self, field: str, problem: str) -> None:
        super().__init__(f"{field}: {problem}")
        self.field = field
        self.problem = problem

    def __reduce__(self):
        # Rebuilt from (field, problem), not from the formatted message: Ray pickles errors
        # raised in an actor, and one it cannot rebuild reaches the caller as a bare RayTaskError.
        return type(self), (self.field, self.problem)


class ModelLoadError(EngineError):
    """A checkpoint cannot be loaded (missing file, unsupported architecture, bad config)."""


def read_json_file(path: Path) -> dict:
    """A checkpoint's JSON file (config.json, generation_config.json, adapter_config.json);
    ModelLoadError naming it when it is not valid JSON."""
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ModelLoadError(f"{path}: not valid JSON ({exc})") from exc


class UnknownRequestError(EngineError, KeyError):
    """A request id the engine does not hold."""


class RequestFailedError(EngineError):
    """Computing one request raised: that request alone ends (its blocks freed), the engine goes on.

    Not retried on another worker: what broke this computation would break it there too.
    """
