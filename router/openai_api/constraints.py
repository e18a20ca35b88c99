"""What an OpenAI request body asks of the output beyond sampling: ``logit_bias``, and the one
output constraint it may give (``response_format`` json_object or json_schema, vLLM's
``structured_outputs`` or its older ``guided_json`` / ``guided_regex`` / ``guided_choice`` /
``guided_grammar``) as the request's ``StructuredOutput``."""

from __future__ import annotations

import json
import math
from typing import Any

from engine.errors import InvalidRequestError
from engine.structured_output import StructuredOutput
from router.errors import InvalidArgumentError
from router.openai_api.fields import json_object, refuse_unknown, type_name


def logit_bias(body: dict) -> dict[int, float]:
    """OpenAI's logit_bias: token ids (JSON keys, so strings) to a bias in [-100, 100]."""
    value = body.get("logit_bias")
    if value is None:
        return {}
    bias = {}
    for key, amount in json_object(value, "logit_bias").items():
        try:
            token_id = int(key)
        except ValueError:
            raise InvalidArgumentError(f"logit_bias.{key}", "keys must be token ids (integers)") from None
        if isinstance(amount, bool) or not isinstance(amount, (int, float)) or not math.isfinite(amount):
            raise InvalidArgumentError(f"logit_bias.{key}", f"must be a number, got {type_name(amount)}")
        bias[token_id] = float(amount)
    return bias


# vLLM's structured_outputs keys, and the older top-level guided_* fields, to our kinds.
_STRUCTURED_KEYS = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "grammar", "json_object": "json_object"}
# vLLM's options beside them change nothing here: one backend, no fallback to another; JSON
# never has free whitespace; objects never take properties their schema does not name
# (engine.structured_output.closed_objects, as vLLM's default engine).
_STRUCTURED_OPTIONS = {"disable_fallback", "disable_any_whitespace", "disable_additional_properties"}
_STRUCTURED_UNSUPPORTED = {
    "whitespace_pattern": "is not supported: JSON is written without free whitespace here",
    "structural_tag": "is not supported; use tools with tool_choice, or a json schema",
}


def structured_output(body: dict) -> StructuredOutput | None:
    """The request's one output constraint, if it has one."""
    found: list[StructuredOutput] = []
    response_format = body.get("response_format")
    if response_format is not None:
        response_format = json_object(response_format, "response_format")
        kind = response_format.get("type")
        if kind == "json_object":
            found.append(StructuredOutput("json_object", field="response_format"))
        elif kind == "json_schema":
            spec = json_object(response_format.get("json_schema"), "response_format.json_schema")
            refuse_unknown(spec, {"name", "description", "schema", "strict"}, prefix="response_format.json_schema.")
            if spec.get("schema") is None:
                raise InvalidArgumentError("response_format.json_schema.schema", "is required")
            schema = json_object(spec["schema"], "response_format.json_schema.schema")
            found.append(StructuredOutput("json_schema", json.dumps(schema), field="response_format"))
        elif kind != "text":
            raise InvalidArgumentError("response_format.type", f"must be \"text\", \"json_object\" or \"json_schema\", got {kind!r}")
    options = body.get("structured_outputs")
    if options is not None:
        options = json_object(options, "structured_outputs")
        refuse_unknown(options, set(_STRUCTURED_KEYS) | _STRUCTURED_OPTIONS | set(_STRUCTURED_UNSUPPORTED), prefix="structured_outputs.")
        for key, value in options.items():
            if value is None or value is False or key in _STRUCTURED_OPTIONS:
                continue
            if key in _STRUCTURED_UNSUPPORTED:
                raise InvalidArgumentError(f"structured_outputs.{key}", _STRUCTURED_UNSUPPORTED[key])
            found.append(_structured(_STRUCTURED_KEYS[key], value, f"structured_outputs.{key}"))
    for key in ("json", "regex", "choice", "grammar"):
        value = body.get(f"guided_{key}")
        if value is not None:
            found.append(_structured(_STRUCTURED_KEYS[key], value, f"guided_{key}"))
    if len(found) > 1:
        raise InvalidArgumentError(found[1].field, f"a request takes one output constraint; {found[0].field} already gives one")
    return found[0] if found else None


def _structured(kind: str, value: Any, name: str) -> StructuredOutput:
    try:
        return StructuredOutput.build(kind, value, name)
    except InvalidRequestError as exc:
        raise InvalidArgumentError(exc.field, exc.problem) from None
