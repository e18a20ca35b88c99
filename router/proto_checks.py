"""Schema-level checks protobuf parsing does not make: unknown field numbers and enum values.

proto3 parsing keeps both silently: a field number this server does not know (from a newer
client) is carried as unknown bytes, and an enum field accepts any integer. Ignoring either
would serve a request differently from what the client asked for, so both are refused with
the field's path named.
"""

from __future__ import annotations

from google.protobuf.descriptor import EnumDescriptor
from google.protobuf.message import Message
from google.protobuf.unknown_fields import UnknownFieldSet

from router.errors import InvalidArgumentError


def check_known_fields(message: Message, path: str = "") -> None:
    """Raise InvalidArgumentError for an unknown field or enum value anywhere in ``message``."""
    unknown = UnknownFieldSet(message)
    if len(unknown):
        numbers = sorted({field.field_number for field in unknown})
        where = path or message.DESCRIPTOR.name
        raise InvalidArgumentError(
            where, f"unknown field number(s) {numbers} (is the client built from a newer API version?)"
        )
    for field, value in message.ListFields():
        field_path = f"{path}.{field.name}" if path else field.name
        if field.message_type is not None and field.message_type.GetOptions().map_entry:
            _check_map(field, value, field_path)
            continue
        values = list(value) if field.is_repeated else [value]
        if field.enum_type is not None:
            for item in values:
                check_enum_value(field_path, field.enum_type, item)
        elif field.message_type is not None:
            for index, item in enumerate(values):
                check_known_fields(item, f"{field_path}[{index}]" if field.is_repeated else field_path)


def _check_map(field, entries, field_path: str) -> None:
    """A map field: its values checked like any field's (its keys are scalars)."""
    value_field = field.message_type.fields_by_name["value"]
    for key, item in entries.items():
        if value_field.enum_type is not None:
            check_enum_value(f"{field_path}[{key}]", value_field.enum_type, item)
        elif value_field.message_type is not None:
            check_known_fields(item, f"{field_path}[{key}]")


def check_enum_value(field_path: str, enum_type: EnumDescriptor, value: int) -> None:
    """Raise InvalidArgumentError if ``value`` is not a number ``enum_type`` defines."""
    if value not in enum_type.values_by_number:
        names = ", ".join(v.name for v in enum_type.values)
        raise InvalidArgumentError(field_path, f"unknown {enum_type.name} value {value}; expected one of {names}")
