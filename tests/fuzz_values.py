"""Hostile values shared by the fuzz tests (a support module: no tests here).

- HOSTILE: name -> a factory of one hostile value (wrong types, invalid and huge numbers, text,
  bytes, generators, nesting past the recursion limit, non-string keys, pairs, read-only
  buffers, negative and fractional numbers); a factory, so one-shot values (a generator) are
  fresh per use.
- deep(levels): a list nested ``levels`` deep.
- typed_or(fn): fn's result, or the HiCacheError it raised (any other exception propagates:
  that is the bug a fuzz test looks for).
- assert_typed(fn, limit): typed_or, and a HiCacheError's message no longer than ``limit``.
- hypothesis strategies: JSON_LEAVES, DOCUMENTS (JSON-like documents), HOSTILE_NUMBERS (at and
  past every bound), HOSTILE_LEAVES, HOSTILE_DOCUMENTS (nested, non-string keys, pairs).
Used by tests/test_fuzz_api.py, tests/test_fuzz_cache_api.py and the integrations' fuzz tests.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator

from hypothesis import strategies as st

from hicache.domain import HiCacheError


def deep(levels: int) -> list[object]:
    value: list[object] = []
    for _ in range(levels):
        value = [value]
    return value


def _gen() -> Iterator[int]:
    yield from range(9)


def _read_only() -> memoryview:
    return memoryview(bytes(64))


HOSTILE: dict[str, Callable[[], object]] = {
    "None": lambda: None,
    "int": lambda: 7,
    "negative": lambda: -1,
    "float": lambda: 1.5,
    "fraction": lambda: 0.5,
    "bool": lambda: True,
    "nan": lambda: math.nan,
    "inf": lambda: math.inf,
    "-inf": lambda: -math.inf,
    "huge": lambda: 10**30,
    "1e308": lambda: 1e308,
    "10**400": lambda: 10**400,
    "10**5000": lambda: 10**5000,
    "text": lambda: "kv",
    "empty text": lambda: "",
    "long text": lambda: "x" * 100_000,
    "bytes": lambda: b"\x00\x01",
    "read-only buffer": _read_only,
    "list": list,
    "mapping": dict,
    "generator": _gen,
    "object": object,
    "nested": lambda: {"kv": None},
    "list of lists": lambda: [[1]],
    "deep": lambda: deep(5000),
    "non-string keys": lambda: {1: 2, "kv": [0]},
    "pairs": lambda: [("a", 1)],
}


def typed_or(fn: Callable[[], object]) -> object:
    try:
        return fn()
    except HiCacheError as e:
        return e


def assert_typed(fn: Callable[[], object], limit: int = 1000) -> object:
    """``fn()``'s result or its HiCacheError, whose message must be at most ``limit`` long."""
    result = typed_or(fn)
    if isinstance(result, HiCacheError):
        assert len(str(result)) <= limit, (type(result).__name__, str(result)[:300])
    return result


JSON_LEAVES = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(10**40), max_value=10**40),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
)
DOCUMENTS = st.recursive(
    JSON_LEAVES,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=20,
)
# Numbers at and past every bound: float's range, the seconds bound, 64 bits, int->str limits.
HOSTILE_NUMBERS = st.one_of(
    st.sampled_from([1e308, -1e308, 10**400, -(10**400), 2**63, 1e6, 1e6 + 1, 1e9 + 1, 0, -0.0]),
    st.just(5000).map(lambda n: 10**n),  # past int->str's 4300 digits: repr would raise
    st.floats(allow_nan=True, allow_infinity=True),
    st.integers(min_value=-(10**40), max_value=10**40),
)
HOSTILE_LEAVES = st.one_of(
    JSON_LEAVES,
    HOSTILE_NUMBERS,
    st.just(3000).map(
        deep
    ),  # past the recursion limit: walked, shown and refused without recursing
    st.builds(dict, st.lists(st.tuples(st.integers(), st.integers()), max_size=3)),  # int keys
    st.lists(st.tuples(st.text(max_size=6), JSON_LEAVES), max_size=3),  # pairs, not a mapping
)
HOSTILE_DOCUMENTS = st.recursive(
    HOSTILE_LEAVES,
    lambda inner: st.one_of(
        st.lists(inner, max_size=3),
        st.dictionaries(st.one_of(st.text(max_size=8), st.integers()), inner, max_size=3),
    ),
    max_leaves=12,
)
