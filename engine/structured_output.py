"""What a request's output must match (a JSON schema, any JSON object, a regex, one of some
choices, a grammar), as plain data that travels with its SamplingParams, and its translation
into an llguidance grammar.

No torch here: the router checks a request's grammar with ``check_grammar`` at the API edge
(so a schema the engine cannot compile is a 400 naming the field, before any actor sees it),
and both pools build their matchers from the same ``to_llguidance`` text (engine.grammar).

Why llguidance rather than xgrammar (tools/bench_grammar_engines.py, on the SmolLM2-135M
tokenizer, one thread): its per-step mask took 41 us per sequence at batch 1 and 15 us at
batch 32, xgrammar's 152 us at both; it compiles a schema lazily (1.2 ms against 14 ms), and it
needs neither torch (the router imports it) nor triton.
"""

from __future__ import annotations

import functools
import json
import re
import string
import urllib.parse
from dataclasses import asdict, dataclass

from engine import bounded_json
from engine.errors import InvalidRequestError

KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")
# JSON as json.dumps writes it (and as models have mostly seen it): ", " between items, ": "
# after keys, no other whitespace. Free whitespace lets a sampled answer run to max_tokens in
# spaces and newlines.
# oneOf is read as anyOf (xgrammar, vLLM's default, does the same): the discriminated unions pydantic
# and Zod write are oneOf, and llguidance refuses oneOf otherwise.
_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": ", "coerce_one_of": True}


@dataclass(slots=True, frozen=True)
class StructuredOutput:
    """A constraint on a request's output. ``value``: the schema's JSON text (json_schema), the
    regex, the grammar (Lark, or GBNF as llama.cpp and vLLM write it), or the choices as a JSON list; unused
    for json_object. ``field``: the request field that asked for it, named in errors. A reasoning
    model's output is constrained after its thinking (``SamplingParams.thinking``)."""

    kind: str
    value: str = ""
    field: str = "structured_outputs"

    @classmethod
    def build(cls, kind: str, value: object, field: str) -> "StructuredOutput":
        """From an API field's value: a schema (an object or its JSON text), true for
        json_object, a list of choices, or a regex or grammar; InvalidRequestError naming ``field``."""
        if kind == "json_object":
            if value is not True:
                raise InvalidRequestError(field, "must be true")
            return cls("json_object", field=field)
        if kind == "json_schema":
            if isinstance(value, str):
                try:
                    value = bounded_json.loads(value)
                except json.JSONDecodeError as exc:
                    raise InvalidRequestError(field, f"is not valid JSON: {exc}") from None
            if not isinstance(value, dict):
                raise InvalidRequestError(field, f"must be a JSON schema object, got {type(value).__name__}")
            return cls("json_schema", json.dumps(value), field)
        if kind == "choice":
            if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
                raise InvalidRequestError(field, "must be a non-empty list of non-empty strings")
            return cls("choice", json.dumps(value), field)
        if kind not in KINDS:
            raise InvalidRequestError(field, f"unknown kind {kind!r}; one of {list(KINDS)}")
        if not isinstance(value, str) or not value:
            raise InvalidRequestError(field, "must be a non-empty string")
        return cls(kind, value, field)

    @classmethod
    def tool_calls(
        cls, calls: list["CallTag"], answer: "StructuredOutput | None", field: str, separator: str = r"\s*", opening: str | None = None,
        one_call: bool = False,
    ) -> "StructuredOutput":
        """An answer that may call tools, each call written as its ``CallTag`` says with its
        arguments held to its schema: free text around the calls (``answer`` None), or the
        answer ``answer`` (a JSON schema or object) unless it calls. Made by the router from a
        request's tools in the model's own format (not a kind a client names).

        ``separator``: the regex between calls; ``opening``: set where the calls are the whole
        answer (Llama 3's JSON calls), the regex of how a call starts, which a text answer may
        not (else calls sit in free text, each begun by its trigger: hermes). ``one_call``: at most
        one call (``parallel_tool_calls: false``); among free text, no trigger after it."""
        spec = {"calls": [asdict(call) for call in calls], "answer": None, "separator": separator, "opening": opening, "one_call": one_call}
        if answer is not None:
            spec["answer"] = {"type": "object"} if answer.kind == "json_object" else bounded_json.loads(answer.value)
        return cls(TOOL_CALLS, json.dumps(spec), field)

    def to_llguidance(self) -> str:
        """The grammar text llguidance's matcher takes; InvalidRequestError if it cannot be made."""
        import llguidance  # the Rust core only: no torch

        try:
            if self.kind == TOOL_CALLS:
                return _tool_calls_grammar(bounded_json.loads(self.value))
            if self.kind == "json_schema":
                schema = closed_objects(_known_formats(bounded_json.loads(self.value)))
                return llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=_JSON_OPTIONS)
            if self.kind == "json_object":
                return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=_JSON_OPTIONS)
            if self.kind == "regex":
                return llguidance.LLMatcher.grammar_from_regex(self.value)
            if self.kind == "choice":
                alternatives = "|".join(_escape_literal(choice) for choice in json.loads(self.value))
                return llguidance.LLMatcher.grammar_from_regex(f"({alternatives})")
            if self.kind == "grammar":
                from llguidance.gbnf_to_lark import GbnfToLarkError, any_to_lark

                try:
                    lark = any_to_lark(self.value)
                except GbnfToLarkError as exc:
                    raise ValueError(exc) from exc
                return llguidance.LLMatcher.grammar_from_lark(lark)
        except (ValueError, TypeError) as exc:
            raise InvalidRequestError(self.field, f"cannot be compiled: {exc}") from exc
        raise InvalidRequestError(self.field, f"unknown kind {self.kind!r}; one of {list(KINDS)}")


TOOL_CALLS = "tool_calls"  # StructuredOutput.tool_calls' kind


@dataclass(slots=True, frozen=True)
class CallTag:
    """How a model writes one tool's call, its arguments in between: ``trigger`` (a start of
    ``begin``) is where free text gives way to the call. Hermes: trigger ``<tool_call>``,
    begin ``<tool_call>\n{"name": "get_weather", "arguments": ``, end ``}\n</tool_call>``.
    ``schema``: what the arguments must be (a strict tool's parameters, else any object).
    ``as_json``: where a call is one JSON object (Llama 3's), its schema, name and arguments in
    their order: beside a JSON answer format, one JSON grammar tells the two apart (llguidance
    follows a literal or a JSON grammar from an opening byte they share, not both)."""

    trigger: str
    begin: str
    schema: dict
    end: str
    as_json: dict | None = None


def _tool_calls_grammar(spec: dict) -> str:
    """The grammar of ``StructuredOutput.tool_calls``: llguidance's structural tags (a call's
    trigger in the text starts it; its arguments are JSON under their schema) around free text;
    where calls are the whole answer, calls alone or text that opens none; with an answer
    format, that answer or calls alone (calls that are JSON objects: the answer or one call)."""
    import llguidance

    def schema(raw: dict) -> dict:
        return {**closed_objects(_known_formats(raw)), "x-guidance": _JSON_OPTIONS}

    calls = [CallTag(**call) for call in spec["calls"]]
    separator, opening = spec.get("separator", r"\s*"), spec.get("opening")
    if spec["answer"] is None and opening is None:
        if spec.get("one_call"):
            return llguidance.LLMatcher.grammar_from_lark(_one_call_among_text(calls, schema))
        tags = [llguidance.StructTag(trigger=c.trigger, begin=c.begin, grammar=schema(c.schema), end=c.end) for c in calls]
        # (Triggers as text, not as special tokens: a template's <tool_call> is plain text to
        # some tokenizers and one added token to others; as text it matches either way.)
        return llguidance.LLMatcher.grammar_from_lark(llguidance.StructTag.to_grammar(tags, assume_special=False))
    if spec["answer"] is not None and all(c.as_json is not None for c in calls):
        # The answer or one call, as one JSON value (a call after an answer would spoil it).
        branches, definitions = _hoisted_definitions([spec["answer"], *(c.as_json for c in calls)])
        either = schema({"anyOf": branches, **({"$defs": definitions} if definitions else {})})
        return llguidance.LLMatcher.grammar_from_lark(f"%llguidance {{}}\nstart: %json {json.dumps(either)}")
    names = " | ".join(f"call_{index}" for index in range(len(calls)))
    lines = ["%llguidance {}"]
    if spec["answer"] is not None:
        lines += ["start: answer | calls", f"answer: %json {json.dumps(schema(spec['answer']))}"]
    else:  # the calls are the whole answer, or it is text that opens none
        lines += ["start: calls | text", "text: TEXT", f"TEXT: /(.|\\n)*/ & ~/({opening})(.|\\n)*/"]
    more = "" if spec.get("one_call") else f" (/{separator}/ ({names}))*"
    lines += [f"calls: ({names}){more} /\\s*/"]
    lines += [f"call_{index}: {json.dumps(c.begin)} %json {json.dumps(schema(c.schema))} {json.dumps(c.end)}" for index, c in enumerate(calls)]
    return llguidance.LLMatcher.grammar_from_lark("\n".join(lines))


def _one_call_among_text(calls: list[CallTag], schema) -> str:
    """Free text with at most one call in it (hermes under ``parallel_tool_calls: false``): the
    structural tags' grammar (a call's trigger, matched lazily in the text, starts it) without
    their repetition, and after the call, text in which no trigger may appear (the model spent
    its tokens on later calls, which the reader then dropped). Triggers are text, as above."""
    names = " | ".join(f"call_{index}" for index in range(len(calls)))
    triggers = "|".join(sorted({re.escape(c.trigger).replace("/", "\\/") for c in calls}))
    lines = [
        "%llguidance {}",
        f"start: TEXT | ({names}) AFTER",
        "TEXT: /(.|\\n)*/",
        f"AFTER: /(.|\\n)*/ & ~/(.|\\n)*({triggers})(.|\\n)*/",
    ]
    for index, c in enumerate(calls):
        rest = c.begin[len(c.trigger):]
        lines += [
            f"call_{index}_trigger[lazy]: TEXT {json.dumps(c.trigger)}",
            f"call_{index}: call_{index}_trigger {json.dumps(rest) if rest else ''} %json {json.dumps(schema(c.schema))} {json.dumps(c.end) if c.end else ''}",
        ]
    return "\n".join(lines)


DEFINITION_KEYWORDS = ("$defs", "definitions")  # where a schema keeps what its "$ref"s name


def _hoisted_definitions(branches: list[dict]) -> tuple[list[dict], dict]:
    """Schemas to be nested under one root (an ``anyOf``), with the definitions each keeps at its
    own root moved to the new root, named per branch (``b1_Person``), and its references to them
    rewritten: left in place, "#/$defs/Person" pointed at the new root, which has none (a pydantic
    model with a nested one, as the openai SDK writes it, was a 400)."""
    definitions: dict = {}
    hoisted = []
    for index, branch in enumerate(branches):
        branch = dict(branch)
        names = {}
        for keyword in DEFINITION_KEYWORDS:
            found = branch.pop(keyword, None)
            if isinstance(found, dict):
                for name, definition in found.items():
                    names[f"#/{keyword}/{name}"] = f"#/$defs/b{index}_{name}"
                    definitions[f"b{index}_{name}"] = definition
        if names:
            branch = _with_refs(branch, names)
            for name in [n for n in definitions if n.startswith(f"b{index}_")]:
                definitions[name] = _with_refs(definitions[name], names)
        hoisted.append(branch)
    return hoisted, definitions


def _with_refs(value, names: dict[str, str]):
    """``value`` with each ``$ref`` into a moved definition (or into a part of one) renamed."""
    if isinstance(value, list):
        return [_with_refs(item, names) for item in value]
    if not isinstance(value, dict):
        return value
    out = {key: _with_refs(item, names) for key, item in value.items()}
    ref = value.get("$ref")
    if isinstance(ref, str):
        for old, new in names.items():
            if ref == old or ref.startswith(old + "/"):
                out["$ref"] = new + ref[len(old):]
                break
    return out


# Constraints up to this size have their verdict kept (clients send the same schema again and
# again, and n choices each carry it): compiling a large schema costs hundreds of milliseconds.
_REMEMBERED_GRAMMAR_CHARS = 65_536


def check_grammar(structured: StructuredOutput) -> None:
    """InvalidRequestError naming ``structured.field`` unless llguidance compiles its grammar."""
    problem = _remembered_problem(structured) if len(structured.value) <= _REMEMBERED_GRAMMAR_CHARS else _grammar_problem(structured)
    if problem is not None:
        raise InvalidRequestError(structured.field, problem)


def _grammar_problem(structured: StructuredOutput) -> str | None:
    """Why llguidance cannot compile ``structured``'s grammar (None: it can)."""
    import llguidance

    try:
        error = llguidance.LLMatcher.validate_grammar(structured.to_llguidance())
    except InvalidRequestError as exc:
        return exc.problem
    return f"cannot be compiled: {error.strip()}" if error else None


_remembered_problem = functools.lru_cache(maxsize=256)(_grammar_problem)


# Keywords that apply more schemas to the same instance: an object beside them, or under them,
# may hold properties they name, so it stays open.
_SAME_INSTANCE = {"allOf", "anyOf", "oneOf", "$ref", "if", "then", "else", "not", "dependentSchemas", "dependentRequired", "dependencies"}
_OTHER_PROPERTIES = {"additionalProperties", "unevaluatedProperties", "patternProperties"}  # it says what else it takes
# Keywords whose value is a schema of another instance (a property's, an item's).
_CHILD_SCHEMA = {"items", "contains", "propertyNames", "additionalItems", "unevaluatedItems", "additionalProperties", "unevaluatedProperties"}
_CHILD_SCHEMA_MAPS = {"properties", "patternProperties"}
_DEFINITIONS = ("$defs", "definitions")
_ANNOTATIONS = {"title", "description", "default", "examples", "$comment", "deprecated", "readOnly", "writeOnly", "$schema", "$id", *_DEFINITIONS}
# What may sit beside a union, or beside a $ref, that constrains nothing more (pydantic writes
# Optional[Model] as anyOf [$ref, null] with a default and a title).
_UNION_NEUTRAL = _ANNOTATIONS | {"anyOf", "oneOf", "type", "discriminator", "nullable"}
_REF_NEUTRAL = _ANNOTATIONS | {"$ref", "nullable"}


# The string formats llguidance holds a value to; any other ``format`` is an annotation, as JSON
# Schema has it (pydantic writes "binary" for bytes, "path", "password" for SecretStr): it was
# refused as unknown, a 400 for a model the openai SDK's parse() sends as it is.
_GRAMMAR_FORMATS = frozenset(("date-time", "date", "time", "duration", "email", "hostname", "ipv4", "ipv6", "uuid", "uri"))
_DATA_KEYWORDS = frozenset(("enum", "const", "default", "examples"))  # values, not schemas


def _known_formats(value):
    """``value`` (a schema) without the ``format`` annotations llguidance does not know."""
    if isinstance(value, list):
        return [_known_formats(item) for item in value]
    if not isinstance(value, dict):
        return value
    return {
        key: item if key in _DATA_KEYWORDS else _known_formats(item)
        for key, item in value.items()
        if not (key == "format" and isinstance(item, str) and item not in _GRAMMAR_FORMATS)
    }


def closed_objects(schema):
    """``schema`` with no properties or items it does not name: ``additionalProperties: false`` on
    each plain object schema (it lists its properties, says nothing of others, requires none
    it does not list) reached only plainly (through properties, items, branches of a union
    with nothing beside it, $refs with nothing beside them), ``items: false`` after such a
    tuple's ``prefixItems``. What vLLM's default grammar engine (xgrammar's strict mode) and
    OpenAI's strict schemas give; open, a sampled object ran on in keys the schema never named
    (to max_tokens, its JSON unfinished). Objects composed with others (allOf parts, a base's
    union, what a $ref beside other keywords names, found by a fixed point over chains of
    them) stay open: closed, each would forbid the others' properties. A $ref outside the
    schema (another document) leaves the whole schema as it is."""
    if not isinstance(schema, dict):
        return schema
    targets = [_pointer(ref) for ref in _refs(schema)]
    if any(target is None for target in targets) or (targets and _nested_ids(schema)):
        return schema  # (below an $id a $ref's "#" is that resource's root, not this one's)
    # Places some $ref names beside other schemas, and every place a $ref inside one of those
    # names (it is reached beside them too): found in one walk of the $ref graph. The fixed point
    # below then only confirms it; alone, it took a pass over the whole schema per link of a
    # chain of $refs (2,000 links: 14 s of the router's tokenizing thread).
    first: set[tuple[str, ...]] = set()
    _close(schema, True, set(), first, ())
    composed = _named_within(schema, first)
    while True:
        found: set[tuple[str, ...]] = set()
        closed = _close(schema, True, composed, found, ())
        if found <= composed:
            return closed
        composed |= found


def _named_within(schema: dict, places: set[tuple[str, ...]]) -> set[tuple[str, ...]]:
    """``places`` and every place a $ref inside one of them names (where ``_close`` reads one
    there, walking it as a place composed with others), and so on."""
    seen, pending = set(places), list(places)
    while pending:
        place = pending.pop()
        found: set[tuple[str, ...]] = set()
        _close(_node_at(schema, place), False, seen, found, place)
        for target in found - seen:
            seen.add(target)
            pending.append(target)
    return seen


def _node_at(schema, path: tuple[str, ...]):
    """What ``path`` (a $ref's pointer) names in ``schema``; None where nothing is there."""
    node = schema
    for part in path:
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isascii() and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


def local_ref_target(root, ref: str):
    """What a local $ref ("#", "#/$defs/Address") names in ``root``; None for another document's,
    an anchor's, or one that names nothing."""
    path = _pointer(ref)
    return None if path is None else _node_at(root, path)


def _pointer(ref: str) -> tuple[str, ...] | None:
    """A local $ref ("#", "#/properties/a", "#/$defs/a~1b") as the path of what it names; None
    for another document's."""
    if not ref.startswith("#"):
        return None
    fragment = urllib.parse.unquote(ref[1:])
    if not fragment:
        return ()
    if not fragment.startswith("/"):
        return None  # an anchor ("#name"): not followed here
    return tuple(part.replace("~1", "/").replace("~0", "~") for part in fragment[1:].split("/"))


def _nested_ids(schema: dict) -> bool:
    """Whether a schema below the root has an $id (only schema positions are looked at: a
    property named "$id", or a default holding one, is no resource)."""
    return any("$id" in node for node in _subschemas(schema))


def _subschemas(node: dict):
    for key, value in node.items():
        if key in _CHILD_SCHEMA_MAPS or key in _DEFINITIONS or key == "dependentSchemas":
            children = value.values() if isinstance(value, dict) else ()
        elif key in ("anyOf", "oneOf", "allOf", "prefixItems"):
            children = value if isinstance(value, list) else ()
        elif key in _CHILD_SCHEMA or key in ("not", "if", "then", "else"):
            children = (value,)
        else:
            continue
        for child in children:
            if isinstance(child, dict):
                yield child
                yield from _subschemas(child)


def _refs(node):
    if isinstance(node, dict):
        if isinstance(node.get("$ref"), str):
            yield node["$ref"]
        for value in node.values():
            yield from _refs(value)
    elif isinstance(node, list):
        for item in node:
            yield from _refs(item)


def _close(node, plain_path: bool, composed: set, found: set, path: tuple[str, ...]):
    """``node`` (at ``path``) closed where it is plain and reached plainly; the places it names
    by $ref beside other schemas go in ``found``."""
    if not isinstance(node, dict):
        return node
    keys = set(node)
    plain_path = plain_path and path not in composed
    alone = plain_path and not keys & _SAME_INSTANCE  # its children are reached plainly
    branches_alone = plain_path and keys <= _UNION_NEUTRAL
    if isinstance(node.get("$ref"), str) and not (plain_path and keys <= _REF_NEUTRAL):
        found.add(_pointer(node["$ref"]))

    def child(value, plain: bool, *at: str):
        return _close(value, plain, composed, found, (*path, *at))

    out = {}
    for key, value in node.items():
        if key in _CHILD_SCHEMA:
            out[key] = child(value, alone, key)
        elif key in _CHILD_SCHEMA_MAPS and isinstance(value, dict):
            out[key] = {name: child(item, alone, key, name) for name, item in value.items()}
        elif key == "prefixItems" and isinstance(value, list):
            out[key] = [child(item, alone, key, str(index)) for index, item in enumerate(value)]
        elif key in ("anyOf", "oneOf") and isinstance(value, list):
            out[key] = [child(item, branches_alone, key, str(index)) for index, item in enumerate(value)]
        elif key in _DEFINITIONS and isinstance(value, dict):
            out[key] = {name: child(item, True, key, name) for name, item in value.items()}  # (as plain as their references)
        elif key in ("allOf", "if", "then", "else", "not", "dependentSchemas"):
            if isinstance(value, list):
                out[key] = [child(item, False, key, str(index)) for index, item in enumerate(value)]
            elif key == "dependentSchemas" and isinstance(value, dict):
                out[key] = {name: child(item, False, key, name) for name, item in value.items()}
            else:
                out[key] = child(value, False, key)
        else:
            out[key] = value  # (dependentRequired, enum, const, ...: no schemas in them)
    properties, required = out.get("properties"), out.get("required", [])
    plain = (isinstance(properties, dict) and not (_OTHER_PROPERTIES | _SAME_INSTANCE) & keys
             and isinstance(required, list) and all(name in properties for name in required))
    if alone and plain:
        out["additionalProperties"] = False
    if alone and isinstance(out.get("prefixItems"), list) and "items" not in out and "unevaluatedItems" not in out:
        out["items"] = False
    return out


# Escaped, "<" and ">" are word boundaries in Rust's regex syntax (which llguidance refuses): they
# stand for themselves as they are.
_ESCAPED = set(string.punctuation) - {"<", ">"}


def _escape_literal(text: str) -> str:
    """``text`` as a regex matching exactly it (Rust regex syntax: ASCII punctuation escaped,
    control characters by code)."""
    return "".join("\\" + ch if ch in _ESCAPED else f"\\x{{{ord(ch):x}}}" if ord(ch) < 32 or ord(ch) == 127 else ch for ch in text)
