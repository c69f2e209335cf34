"""Keys of token blocks, by which the storage tier names pages and routers index engines' trees.

Block i holds tokens[i*p:(i+1)*p]; its key hashes the previous key (first: a root key of seed
and namespace) and its tokens, so equal keys mean equal tokens from the very start."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

KEY_BYTES = 16


def root_key(seed: bytes, namespace: str) -> bytes:
    return hashlib.blake2b(seed + b"|" + namespace.encode(), digest_size=KEY_BYTES).digest()


def chain(
    prev: bytes, tokens: Sequence[int] | np.ndarray, first: int, end: int, p: int
) -> list[bytes]:
    """Keys of blocks first..end-1, ``prev`` being block first-1's key (or the root key)."""
    data = np.asarray(tokens[first * p : end * p], dtype="<i4").tobytes()
    step, out, key = 4 * p, [], prev
    for i in range(end - first):
        key = hashlib.blake2b(key + data[i * step : (i + 1) * step], digest_size=KEY_BYTES).digest()
        out.append(key)
    return out


def block_keys(
    seed: bytes, namespace: str, tokens: Sequence[int] | np.ndarray, first: int, end: int, p: int
) -> list[bytes]:
    """Keys of blocks first..end-1 of tokens, hashed from the sequence's start."""
    return chain(root_key(seed, namespace), tokens, 0, end, p)[first:]


def split_keys(raw: bytes) -> list[bytes]:
    if len(raw) % KEY_BYTES:
        raise ValueError(f"{len(raw)} bytes of keys is not a whole number of {KEY_BYTES}-byte keys")
    return [raw[i : i + KEY_BYTES] for i in range(0, len(raw), KEY_BYTES)]
