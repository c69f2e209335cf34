"""Hypothesis strategies for protobuf messages, built from their descriptors.

    messages(GenerateRequest)   -> GenerateRequest instances with extreme field values
    wire_bytes(GenerateRequest) -> request bodies: valid, truncated, padded with garbage,
                                   carrying unknown fields, or random bytes

Every field is walked from ``DESCRIPTOR``, so a field added to a .proto is fuzzed without
touching this module. Values lean on the edges: integer bounds, 0 and -1, NaN, infinities
and -0.0, empty, long, NUL-laden and non-ASCII strings, enum numbers no .proto names.
"""

from __future__ import annotations

import math
from typing import Any, cast

from google.protobuf import message_factory
from google.protobuf.descriptor import Descriptor, EnumDescriptor, FieldDescriptor, OneofDescriptor
from google.protobuf.message import Message
from hypothesis import strategies as st

MAX_REPEATED = 4
LONG = 4096  # the longest string or bytes field drawn (characters / bytes)

_FD = FieldDescriptor
_INT_BOUNDS = {
    _FD.TYPE_INT32: (-(2**31), 2**31 - 1),
    _FD.TYPE_SINT32: (-(2**31), 2**31 - 1),
    _FD.TYPE_SFIXED32: (-(2**31), 2**31 - 1),
    _FD.TYPE_INT64: (-(2**63), 2**63 - 1),
    _FD.TYPE_SINT64: (-(2**63), 2**63 - 1),
    _FD.TYPE_SFIXED64: (-(2**63), 2**63 - 1),
    _FD.TYPE_UINT32: (0, 2**32 - 1),
    _FD.TYPE_FIXED32: (0, 2**32 - 1),
    _FD.TYPE_UINT64: (0, 2**64 - 1),
    _FD.TYPE_FIXED64: (0, 2**64 - 1),
}
_FLOAT_EDGES = [0.0, -0.0, 1.0, -1.0, math.nan, math.inf, -math.inf, 1e308, -1e308, 5e-324]
_TEXT_EDGES = ["", "\x00", "a\x00b", "\u202e\ufeff", "😀" * 8, "<|im_end|>", "{", "\\"]


def _ints(lo: int, hi: int) -> st.SearchStrategy[int]:
    edges = sorted({lo, hi, 0, 1, hi - 1} | ({-1, lo + 1} if lo < 0 else set()))
    return (
        st.sampled_from(edges)
        | st.integers(-1000, 1000).filter(lambda v: lo <= v <= hi)
        | st.integers(lo, hi)
    )


def _texts() -> st.SearchStrategy[str]:
    chars = st.characters(exclude_categories=["Cs"])  # protobuf strings are valid UTF-8
    return st.one_of(
        st.sampled_from(_TEXT_EDGES),
        st.text(chars, max_size=24),
        st.builds(
            lambda c, n: c * n, st.sampled_from(["a", "\x00", "é", "字 "]), st.integers(0, LONG)
        ),
    )


def _scalar(fd: FieldDescriptor) -> st.SearchStrategy[Any]:
    t = fd.type
    if t in _INT_BOUNDS:
        return _ints(*_INT_BOUNDS[t])
    if t in (_FD.TYPE_FLOAT, _FD.TYPE_DOUBLE):
        return st.sampled_from(_FLOAT_EDGES) | st.floats(width=32 if t == _FD.TYPE_FLOAT else 64)
    if t == _FD.TYPE_BOOL:
        return st.booleans()
    if t == _FD.TYPE_STRING:
        return _texts()
    if t == _FD.TYPE_BYTES:
        return st.binary(max_size=64) | st.integers(0, LONG).map(lambda n: b"\xff" * n)
    if t == _FD.TYPE_ENUM:
        known = st.sampled_from([v.number for v in cast(EnumDescriptor, fd.enum_type).values])
        if getattr(fd.enum_type, "is_closed", False):
            return known  # proto2 enums refuse numbers they do not name
        return known | _ints(-(2**31), 2**31 - 1)
    raise TypeError(f"no strategy for field {fd.full_name} of type {t}")


def _synthetic(oneof: OneofDescriptor) -> bool:
    """The hidden oneof of a proto3 ``optional`` field."""
    return len(oneof.fields) == 1 and oneof.name == "_" + oneof.fields[0].name


def _is_map(fd: FieldDescriptor) -> bool:
    return fd.type == _FD.TYPE_MESSAGE and cast(Descriptor, fd.message_type).GetOptions().map_entry


def _value(fd: FieldDescriptor, depth: int) -> st.SearchStrategy[Any]:
    if fd.type == _FD.TYPE_MESSAGE:
        return _message(cast(Descriptor, fd.message_type), depth - 1)
    return _scalar(fd)


@st.composite
def _message(draw: st.DrawFn, desc: Descriptor, depth: int) -> Message:
    msg = message_factory.GetMessageClass(desc)()
    if depth <= 0:
        return msg
    oneofs = [o for o in desc.oneofs if not _synthetic(o)]
    for oneof in oneofs:  # at most one member set
        choice = draw(st.none() | st.sampled_from(list(oneof.fields)))
        if choice is not None:
            _set(draw, msg, choice, depth)
    in_oneof = {fd.name for o in oneofs for fd in o.fields}
    for fd in desc.fields:
        if fd.name not in in_oneof and draw(st.booleans()):
            _set(draw, msg, fd, depth)
    return msg


def _set(draw: st.DrawFn, msg: Message, fd: FieldDescriptor, depth: int) -> None:
    target = getattr(msg, fd.name)
    if _is_map(fd):
        entry = cast(Descriptor, fd.message_type)
        key_fd, val_fd = entry.fields_by_name["key"], entry.fields_by_name["value"]
        for _ in range(draw(st.integers(0, MAX_REPEATED))):
            key, val = draw(_scalar(key_fd)), draw(_value(val_fd, depth))
            if val_fd.type == _FD.TYPE_MESSAGE:
                target[key].CopyFrom(val)
            else:
                target[key] = val
    elif fd.is_repeated:
        values = draw(st.lists(_value(fd, depth), max_size=MAX_REPEATED))
        if fd.type == _FD.TYPE_MESSAGE:
            for v in values:
                target.add().CopyFrom(v)
        else:
            target.extend(values)
    elif fd.type == _FD.TYPE_MESSAGE:
        target.CopyFrom(draw(_value(fd, depth)))
    else:
        setattr(msg, fd.name, draw(_scalar(fd)))


def messages(cls: type[Message], max_depth: int = 3) -> st.SearchStrategy[Message]:
    """Instances of ``cls``: each field set or not, nested messages ``max_depth`` deep."""
    return _message(cast(Descriptor, cls.DESCRIPTOR), max_depth)


@st.composite
def _mutate(draw: st.DrawFn, base: Message, max_changes: int, max_depth: int) -> Message:
    msg = type(base)()
    msg.CopyFrom(base)
    if not base.DESCRIPTOR.fields:
        return msg
    for _ in range(draw(st.integers(1, max_changes))):
        target, depth = msg, max_depth
        while True:
            fields = cast(Descriptor, target.DESCRIPTOR).fields
            fd: FieldDescriptor = draw(st.sampled_from(list(fields)))
            descend = fd.type == _FD.TYPE_MESSAGE and not fd.is_repeated and depth > 1
            if not (descend and draw(st.integers(0, 3))):  # into a sub-message 3 times in 4
                break
            target, depth = getattr(target, fd.name), depth - 1
        if draw(st.integers(0, 4)):
            _set(draw, target, fd, depth)
        else:
            target.ClearField(fd.name)
    return msg


def mutated(base: Message, max_changes: int = 3, max_depth: int = 3) -> st.SearchStrategy[Message]:
    """Copies of a valid ``base`` with up to ``max_changes`` fields, anywhere in its tree,
    set to drawn values (or cleared): what gets past the first check a request meets."""
    return _mutate(base, max_changes, max_depth)


# ---- raw wire bytes ------------------------------------------------------------------


def varint(n: int) -> bytes:
    n &= (1 << 64) - 1  # negative int64s travel as their two's complement
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def field(number: int, wire_type: int, payload: bytes) -> bytes:
    """One field in wire format; ``payload`` is the varint, fixed or length-prefixed body
    (the length prefix is added here for wire type 2, the END_GROUP tag for type 3)."""
    tag = varint(number << 3 | wire_type)
    if wire_type == 2:
        return tag + varint(len(payload)) + payload
    if wire_type == 3:
        return tag + payload + varint(number << 3 | 4)
    return tag + payload


def _unknown_field(known: set[int]) -> st.SearchStrategy[bytes]:
    numbers = st.integers(1, 2**29 - 1).filter(lambda n: n not in known and not 19000 <= n < 20000)
    payloads = {
        0: st.integers(0, 2**64 - 1).map(varint),
        1: st.binary(min_size=8, max_size=8),
        2: st.binary(max_size=32),
        3: st.just(b""),
        5: st.binary(min_size=4, max_size=4),
    }
    return st.sampled_from(sorted(payloads)).flatmap(
        lambda wt: st.builds(field, numbers, st.just(wt), payloads[wt])
    )


def _known_field_garbage(desc: Descriptor) -> st.SearchStrategy[bytes]:
    """A known field number with any wire type and payload (invalid UTF-8 in a string...)."""
    numbers = [fd.number for fd in desc.fields] or [1]
    return st.builds(
        field, st.sampled_from(numbers), st.sampled_from([0, 2]), st.binary(max_size=16)
    )


def wire_bytes(cls: type[Message], max_depth: int = 3) -> st.SearchStrategy[bytes]:
    """Request bodies for ``cls``: serialized valid messages, cut short, with random bytes
    appended, with unknown (validly encoded) fields spliced in, or random bytes."""
    desc = cast(Descriptor, cls.DESCRIPTOR)
    valid = messages(cls, max_depth).map(lambda m: m.SerializeToString())
    known = {fd.number for fd in desc.fields}
    extra = st.lists(_unknown_field(known) | _known_field_garbage(desc), min_size=1, max_size=3)
    return st.one_of(
        valid,
        valid.flatmap(lambda b: st.integers(0, len(b)).map(lambda i: b[:i])),
        st.builds(lambda b, tail: b + tail, valid, st.binary(min_size=1, max_size=16)),
        st.builds(lambda b, fs: b + b"".join(fs), valid, extra),
        st.binary(max_size=64),
    )
