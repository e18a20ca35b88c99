"""JSON text read with a bound on its nesting (engine/bounded_json.py)."""

from __future__ import annotations

import json

import pytest

from engine import bounded_json
from engine.bounded_json import MAX_DEPTH, TooDeepError
from router.openai_api.tool_arguments import STRICT_JSON


def _nested(depth: int) -> str:
    return "[" * depth + "]" * depth


def test_text_up_to_the_bound_reads_as_json_does_and_deeper_is_a_decode_error():
    value = {"a": [1, {"b": "c"}], "d": None}
    assert bounded_json.loads(json.dumps(value)) == value
    assert bounded_json.loads(json.dumps(value).encode("utf-16")) == value  # bytes: as json.loads detects them
    assert bounded_json.loads(_nested(MAX_DEPTH)) == json.loads(_nested(MAX_DEPTH))
    for depth in (MAX_DEPTH + 1, 100_000):  # the second raises RecursionError inside Python's parser
        with pytest.raises(json.JSONDecodeError) as raised:
            bounded_json.loads(_nested(depth))
        assert isinstance(raised.value, TooDeepError) and str(raised.value) == f"nests deeper than {MAX_DEPTH} levels"


def test_brackets_inside_strings_are_text_not_structure():
    deep_looking = json.dumps({"s": "[{" * 500 + '\\"[' * 50, "t": ["]]]", "\\\\"]})
    assert bounded_json.nesting_depth(deep_looking) == 2
    assert bounded_json.loads(deep_looking) == json.loads(deep_looking)
    assert bounded_json.nesting_depth('"[[["') == 0 and bounded_json.nesting_depth("[[1], [[2]]]") == 3


def test_the_given_decoder_still_decides_what_is_json():
    with pytest.raises(ValueError):
        bounded_json.loads("[NaN]", STRICT_JSON)
    assert bounded_json.loads("[1.5]", STRICT_JSON) == [1.5]
