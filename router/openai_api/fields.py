"""Readers of one JSON field of an OpenAI request body: its type and range checked, any problem an
``InvalidArgumentError`` naming the field as the client wrote it."""

from __future__ import annotations

import math
from typing import Any

from router.errors import InvalidArgumentError


def int_list(body: dict, name: str) -> list[int]:
    value = body.get(name)
    if value is None:
        return []
    if not isinstance(value, list) or not all(is_int(x) for x in value):
        raise InvalidArgumentError(name, "must be a list of integers")
    return list(value)


def refuse_unknown(body: dict, known: set[str], prefix: str = "") -> None:
    unknown = sorted(set(body) - known)
    if unknown:
        raise InvalidArgumentError(f"{prefix}{unknown[0]}", "is not a field of this API (unrecognized request argument)")


def text_parts(value: Any, name: str, part_types: tuple[str, ...], part_fields: set[str] | None = None) -> str:
    """A string, or a list of text parts (``{"type": one of part_types, "text": ...}``, no other
    field than ``part_fields`` where given) joined with newlines, as vLLM does for text models."""
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise InvalidArgumentError(name, f"must be a string or a list of text parts, got {type_name(value)}")
    texts = []
    for index, part in enumerate(value):
        where = f"{name}[{index}]"
        part = json_object(part, where)
        if part.get("type") not in part_types:
            raise InvalidArgumentError(f"{where}.type", f"only text parts are supported ({', '.join(part_types)}), got {part.get('type')!r}")
        if part_fields is not None:
            refuse_unknown(part, part_fields, prefix=f"{where}.")
        text = part.get("text")
        if not isinstance(text, str):
            raise InvalidArgumentError(f"{where}.text", f"must be a string, got {type_name(text)}")
        texts.append(text)
    return "\n".join(texts)


def json_object(value: Any, name: str) -> dict:
    if not isinstance(value, dict):
        raise InvalidArgumentError(name, f"must be a JSON object, got {type_name(value)}")
    return value


def boolean(body: dict, name: str, default: bool, prefix: str = "") -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise InvalidArgumentError(f"{prefix}{name}", f"must be true or false, got {type_name(value)}")
    return value


def integer(body: dict, name: str, default: int | None, low: int | None, high: int | None) -> int | None:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, float) and value.is_integer():
        value = int(value)  # 100.0 is 100, as vLLM's models take it (a client's max_tokens=1e3)
    if not is_int(value):
        raise InvalidArgumentError(name, f"must be an integer, got {type_name(value)}")
    if low is not None and value < low or high is not None and value > high:
        bounds = f"[{'-inf' if low is None else low}, {'inf' if high is None else high}]"
        raise InvalidArgumentError(name, f"must be in {bounds}, got {value}")
    return value


def number(body: dict, name: str, default: float | None) -> float | None:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise InvalidArgumentError(name, f"must be a finite number, got {type_name(value)}")
    return float(value)


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def type_name(value: Any) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean", type(None): "null"}.get(type(value), repr(value))


def string_list(body: dict, name: str) -> list[str]:
    value = body.get(name)
    if value is None:
        return []
    if isinstance(value, str):
        return [value]
    if not isinstance(value, list) or not all(isinstance(x, str) and x for x in value):
        raise InvalidArgumentError(name, "must be a list of non-empty strings")
    return list(value)


def cache_salt(body: dict) -> str | None:
    """vLLM's ``cache_salt`` (chat, completions, responses): the request's blocks are shared in
    the prefix cache only with requests of the same salt (its length is checked with the
    sampling settings, router/validation.py)."""
    salt = body.get("cache_salt")
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise InvalidArgumentError("cache_salt", f"must be a non-empty string, got {type_name(salt) if not isinstance(salt, str) else 'an empty one'}")
    return salt


MAX_PRIORITY = 100  # vLLM's priority and the router's both lie in [-100, 100]
# OpenAI's service tiers, as the tier served and how far it moves a request's priority: at
# vLLM's default priority (0), flex goes behind every default request and priority ahead of them
# (the router's and the engines' queues age priorities: flex waits at most priority_max_wait_s
# behind newer requests). OpenAI's scale tier is capacity a customer reserved, which a deployment
# of its own does not sell: served as default, and the answer says so.
_SERVICE_TIERS = {"auto": ("default", 0), "default": ("default", 0), "scale": ("default", 0), "flex": ("flex", -MAX_PRIORITY),
                  "priority": ("priority", MAX_PRIORITY)}


def served_priority(body: dict) -> tuple[int, str | None]:
    """The request's priority as the router orders requests (higher first), from vLLM's
    ``priority`` (lower first) moved by OpenAI's ``service_tier``, within [-100, 100]; and the tier
    it is served in (None where the request named none)."""
    priority = -integer(body, "priority", 0, -MAX_PRIORITY, MAX_PRIORITY)
    tier = body.get("service_tier")
    if tier is None:
        return priority, None
    if not isinstance(tier, str) or tier not in _SERVICE_TIERS:
        raise InvalidArgumentError("service_tier", f"must be one of {list(_SERVICE_TIERS)}, got {tier!r}"[:200])
    served, shift = _SERVICE_TIERS[tier]
    return max(-MAX_PRIORITY, min(MAX_PRIORITY, priority + shift)), served
