"""Token ids in the scheduler: ``array('i')`` (int32, as on the wire), not lists of ints.

Why: two arrays compare their buffers in C, many times faster than lists of ints, and the
wire's packed int32 becomes an array by one copy. The rule: every container the tree
compares must be such an array (an array never equals a list, so a list would silently
match nothing); ``as_tokens`` converts at the cache's door, ``Req`` in its constructor.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Sequence

TYPECODE = "i"  # C int: int32 on every platform torch and this project run on
assert array(TYPECODE).itemsize == 4, "token arrays must hold int32 like the wire"

Tokens = array  # annotate as Tokens; elements are ints


def as_tokens(seq: Sequence[int]) -> array[int]:
    """``seq`` itself if already a token array, else a copy; ValueError outside int32."""
    if type(seq) is array and seq.typecode == TYPECODE:
        return seq
    tolist = getattr(seq, "tolist", None)
    try:
        return array(TYPECODE, tolist() if tolist is not None else seq)
    except OverflowError as e:
        raise ValueError(f"token ids must fit in int32: {e}") from None


def tokens_from_wire(payload: bytes) -> array[int]:
    """The little-endian int32 ids of a packed proto field (``pack_i32``)."""
    out = array(TYPECODE)
    out.frombytes(payload)  # ValueError when len(payload) is not a multiple of 4
    if sys.byteorder == "big":
        out.byteswap()
    return out


def new_tokens() -> array[int]:
    return array(TYPECODE)
