"""Token ids in the scheduler: ``array('i')`` (int32, as on the wire), not lists of ints.

Why: the radix tree compares a request's prompt with its cached runs at every
match. Two lists of ints compare element by element through the int objects (~20 ns a
token: ~45 us for a 2,048-token system prompt, a third of a request's whole cache
bookkeeping on the generated-shared-prefix trace); two arrays of one typecode compare
their buffers in C (~2 us). The wire already carries token ids as packed int32
(``services/common/transport.pack_i32``), so a request's ids become an array by a memcpy
of the payload where ``.tolist()`` built 2,048 int objects (~50 us). Appending, slicing,
``len`` and ``+`` behave as for lists; ``pack_i32`` reads an array through the buffer
protocol without a per-token loop.

One rule makes this safe: every token container the tree compares must be an array of
typecode ``"i"`` (an array never equals a list, so a list would silently match nothing).
``as_tokens`` converts at the cache's door; ``Req`` converts in its constructor.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Sequence

TYPECODE = "i"  # C int: int32 on every platform torch and this project run on
assert array(TYPECODE).itemsize == 4, "token arrays must hold int32 like the wire"

Tokens = array  # annotate as Tokens; elements are ints


def as_tokens(seq: Sequence[int]) -> array[int]:
    """``seq`` as an int32 token array: itself when it already is one, else a copy
    (numpy arrays and tensors via ``tolist``). Raises ValueError for an id outside int32."""
    if type(seq) is array and seq.typecode == TYPECODE:
        return seq
    tolist = getattr(seq, "tolist", None)
    try:
        return array(TYPECODE, tolist() if tolist is not None else seq)
    except OverflowError as e:
        raise ValueError(f"token ids must fit in int32: {e}") from None


def tokens_from_wire(payload: bytes) -> array[int]:
    """The int32 little-endian ids of a packed proto field (``pack_i32``), copied once."""
    out = array(TYPECODE)
    out.frombytes(payload)  # ValueError when len(payload) is not a multiple of 4
    if sys.byteorder == "big":
        out.byteswap()
    return out


def new_tokens() -> array[int]:
    """An empty token array (a dataclass default_factory)."""
    return array(TYPECODE)
