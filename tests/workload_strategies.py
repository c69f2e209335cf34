"""Hypothesis strategies the scheduler property tests share: three shared prefixes that
requests extend with their own tails, and the engine geometries they run under."""

from __future__ import annotations

from hypothesis import strategies as st

PREFIXES = st.lists(st.lists(st.integers(1, 899), min_size=0, max_size=40), min_size=3, max_size=3)
PREFIX_INDEX = st.integers(0, 2)  # which of PREFIXES a request starts with
TAIL = st.lists(st.integers(1, 899), min_size=1, max_size=12)  # a request's own tokens
PAGE_SIZES = st.sampled_from([1, 4, 16])
CHUNKS = st.sampled_from([-1, 8, 32])  # chunked_prefill_size (-1: off)
