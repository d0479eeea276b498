"""Hypothesis strategies for any protobuf message, built from its descriptor.

    messages(router_pb2.GenerateRequest)   # every field optional; any value its wire type admits

Numbers cover the type's whole range with extra weight on small and boundary values; enums
include values the schema does not name (proto3 keeps them); strings are any unicode; nested
messages stop at a depth limit; repeated fields and maps stay short except integer lists
(token ids), which may be long.
"""

from __future__ import annotations

from google.protobuf.descriptor import FieldDescriptor as F
from google.protobuf.message_factory import GetMessageClass
from hypothesis import strategies as st

_INT_RANGES = {
    F.TYPE_INT32: (-(2**31), 2**31 - 1), F.TYPE_SINT32: (-(2**31), 2**31 - 1), F.TYPE_SFIXED32: (-(2**31), 2**31 - 1),
    F.TYPE_INT64: (-(2**63), 2**63 - 1), F.TYPE_SINT64: (-(2**63), 2**63 - 1), F.TYPE_SFIXED64: (-(2**63), 2**63 - 1),
    F.TYPE_UINT32: (0, 2**32 - 1), F.TYPE_FIXED32: (0, 2**32 - 1),
    F.TYPE_UINT64: (0, 2**64 - 1), F.TYPE_FIXED64: (0, 2**64 - 1),
}  # fmt: skip
MAX_DEPTH = 3


def _integers(lo: int, hi: int) -> st.SearchStrategy[int]:
    edges = [v for v in (lo, hi, 0, 1, -1, 2**31 - 1, 2**32) if lo <= v <= hi]
    return st.one_of(st.integers(max(lo, -3), min(hi, 300)), st.sampled_from(edges), st.integers(lo, hi))


def _scalar(field: F, depth: int) -> st.SearchStrategy:
    t = field.type
    if t in _INT_RANGES:
        return _integers(*_INT_RANGES[t])
    if t == F.TYPE_BOOL:
        return st.booleans()
    if t == F.TYPE_FLOAT:
        return st.floats(width=32)
    if t == F.TYPE_DOUBLE:
        return st.floats()
    if t == F.TYPE_STRING:
        return st.text(max_size=40)
    if t == F.TYPE_BYTES:
        return st.binary(max_size=64)
    if t == F.TYPE_ENUM:
        named = [v.number for v in field.enum_type.values]
        return st.one_of(st.sampled_from(named), st.integers(-3, 64))
    if t == F.TYPE_MESSAGE:
        return _message(GetMessageClass(field.message_type), depth + 1)
    raise TypeError(f"no strategy for field type {t} of {field.full_name}")


def _field(field: F, depth: int) -> st.SearchStrategy:
    if field.message_type is not None and field.message_type.GetOptions().map_entry:
        key, value = field.message_type.fields_by_name["key"], field.message_type.fields_by_name["value"]
        return st.dictionaries(_scalar(key, depth), _scalar(value, depth), max_size=4)
    if field.is_repeated:
        is_int = field.type in _INT_RANGES
        return st.lists(_scalar(field, depth), max_size=400 if is_int else 4)
    return _scalar(field, depth)


def _build(cls, values: dict):
    message = cls()
    for name, value in values.items():
        field = cls.DESCRIPTOR.fields_by_name[name]
        target = getattr(message, name)
        if field.message_type is not None and field.message_type.GetOptions().map_entry:
            for k, v in value.items():
                if field.message_type.fields_by_name["value"].message_type is not None:
                    target[k].CopyFrom(v)
                else:
                    target[k] = v
        elif field.is_repeated:
            if field.message_type is not None:
                for item in value:
                    target.add().CopyFrom(item)
            else:
                target.extend(value)
        elif field.message_type is not None:
            target.CopyFrom(value)
        else:
            setattr(message, name, value)
    return message


def _message(cls, depth: int) -> st.SearchStrategy:
    if depth > MAX_DEPTH:
        return st.just(cls())
    optional = {f.name: st.deferred(lambda f=f: _field(f, depth)) for f in cls.DESCRIPTOR.fields}
    return st.fixed_dictionaries({}, optional=optional).map(lambda values: _build(cls, values))


def messages(cls) -> st.SearchStrategy:
    """Messages of type `cls` (a generated protobuf class)."""
    return _message(cls, 0)


def near(valid: st.SearchStrategy, cls) -> st.SearchStrategy:
    """Valid messages, valid messages with one or two fields replaced by arbitrary values, and arbitrary
    ones: arbitrary messages alone are nearly always refused at the first check, never reaching deeper code."""

    @st.composite
    def mutated(draw):
        message = cls()
        message.CopyFrom(draw(valid))
        noise = draw(messages(cls))
        names = [field.name for field, _ in noise.ListFields()]
        chosen = set(draw(st.lists(st.sampled_from(names), unique=True, max_size=2))) if names else set()
        for name in names:
            if name in chosen:
                message.ClearField(name)
            else:
                noise.ClearField(name)
        message.MergeFrom(noise)
        return message

    return st.one_of(valid, mutated(), messages(cls))
