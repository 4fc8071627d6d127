"""Hostile values at HiCacheBackend (the real sglang package's interfaces): its extra config and
every argument of every call SGLang's controller makes. Each outcome is a result or one
HiCacheError with a short message, never another exception (TypeError, OverflowError,
RecursionError, IndexError, a torch RuntimeError ...), and the backend still round-trips a page
byte-exact afterwards (a refused call leaves it usable).

Values: tests/fuzz_values.py HOSTILE, plus host indices and flat pages that are wrong tensors
(negative, past the pool, fractional, float, read-only, the wrong size).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.integrations.sglang.support import require_sglang

require_sglang()

from hicache.domain import HiCacheError  # noqa: E402
from hicache.integrations.sglang import HiCacheBackend  # noqa: E402
from hicache.integrations.sglang.settings import BACKEND_KEYS, BackendSettings  # noqa: E402
from tests.fuzz_values import HOSTILE, HOSTILE_DOCUMENTS, assert_typed  # noqa: E402
from tests.integrations.sglang.conftest import extra, storage_config  # noqa: E402
from tests.integrations.sglang.pools import fill_page, keys, mha_pool, tokens  # noqa: E402

pytestmark = [pytest.mark.sglang, pytest.mark.timeout(120)]

LIMIT = 1000
ENV: dict[str, str] = {}


def _tensor_values() -> dict[str, Callable[[], object]]:
    return {
        "negative indices": lambda: torch.arange(-4, 0, dtype=torch.int64),
        "past the pool": lambda: torch.arange(10**6, 10**6 + 4, dtype=torch.int64),
        "fractional": lambda: torch.arange(0, 4, dtype=torch.float32) + 0.5,
        "float64": lambda: torch.arange(0, 4, dtype=torch.float64),
        "bool tensor": lambda: torch.ones(4, dtype=torch.bool),
        "2-d": lambda: torch.zeros((2, 2), dtype=torch.int64),
        "read-only numpy": _read_only_numpy,
        "wrong size": lambda: torch.arange(0, 3, dtype=torch.int64),
        "huge int64": lambda: torch.full((4,), 2**62, dtype=torch.int64),
    }


def _read_only_numpy() -> np.ndarray:
    a = np.arange(4, dtype=np.int64)
    a.setflags(write=False)
    return a


VALUES: dict[str, Callable[[], object]] = {**HOSTILE, **_tensor_values()}


@pytest.fixture
def backend(tmp_path: Path) -> Any:
    pool = mha_pool("page_first")
    b = HiCacheBackend(storage_config(extra(tmp_path / "store")), {})
    b.register_mem_pool_host(pool)
    b.test_pool = pool  # type: ignore[attr-defined]
    yield b
    b.close()


def _still_works(b: Any) -> None:
    """A page set then got back byte-exact after whatever was refused."""
    pool = b.test_pool
    want = fill_page(pool, 0, 7)
    k = keys(1, "after")
    assert b.batch_set_v1(k, tokens(pool, 0, 1)) == [True]
    assert b.batch_get_v1(k, tokens(pool, 2, 1)) == [True]
    got = pool.get_data_page(2 * pool.page_size, flat=True).contiguous()
    assert bytes(got.view(torch.uint8).numpy()) == want


def _calls(b: Any, v: Callable[[], object]) -> dict[str, Callable[[], object]]:
    pool = getattr(b, "test_pool", None)
    good_keys = keys(1)
    flat = getattr(pool, "get_dummy_flat_data_page", None)
    return {
        "batch_get_v1 keys": lambda: b.batch_get_v1(v(), tokens(pool, 0, 1)),
        "batch_get_v1 indices": lambda: b.batch_get_v1(good_keys, v()),
        "batch_set_v1 keys": lambda: b.batch_set_v1(v(), tokens(pool, 0, 1)),
        "batch_set_v1 indices": lambda: b.batch_set_v1(good_keys, v()),
        "batch_exists": lambda: b.batch_exists(v()),
        "exists": lambda: b.exists(v()),
        "batch_get keys": lambda: b.batch_get(v(), [flat()]),
        "batch_get targets": lambda: b.batch_get(good_keys, v()),
        "batch_get one target": lambda: b.batch_get(good_keys, [v()]),
        "batch_set keys": lambda: b.batch_set(v(), [flat()]),
        "batch_set values": lambda: b.batch_set(good_keys, v()),
        "batch_set one value": lambda: b.batch_set(good_keys, [v()]),
        "get key": lambda: b.get(v()),
        "get target": lambda: b.get(good_keys[0], v()),
        "set key": lambda: b.set(v(), flat()),
        "set value": lambda: b.set(good_keys[0], v()),
        "batch_exists_v2 keys": lambda: b.batch_exists_v2(v(), []),
        "batch_exists_v2 transfers": lambda: b.batch_exists_v2(good_keys, v()),
        "batch_get_v2": lambda: b.batch_get_v2(v()),
        "batch_set_v2": lambda: b.batch_set_v2(v()),
        "register_mem_host_pool_v2": lambda: b.register_mem_host_pool_v2(v(), v()),
    }


CALLS = sorted(_calls(None, lambda: None))  # the names only


@pytest.mark.parametrize("value", sorted(VALUES))
@pytest.mark.parametrize("call", CALLS)
def test_a_hostile_argument_to_any_call_is_a_result_or_a_short_typed_error(
    backend: Any, call: str, value: str
) -> None:
    assert_typed(_calls(backend, VALUES[value])[call], LIMIT)
    _still_works(backend)


@pytest.mark.parametrize("value", sorted(set(HOSTILE) - {"None", "mapping"}))
def test_an_extra_config_that_is_not_a_mapping_is_a_typed_error(value: str) -> None:
    result = assert_typed(lambda: BackendSettings.parse(HOSTILE[value](), env=ENV), LIMIT)
    assert isinstance(result, HiCacheError)


@pytest.mark.parametrize("value", sorted(HOSTILE))
@pytest.mark.parametrize("key", BACKEND_KEYS)
def test_any_hostile_value_of_any_backend_key_is_settings_or_a_short_typed_error(
    key: str, value: str
) -> None:
    assert_typed(lambda: BackendSettings.parse({key: HOSTILE[value]()}, env=ENV), LIMIT)


@pytest.mark.parametrize("value", sorted(HOSTILE))
def test_a_hostile_store_key_or_constructor_argument_is_a_short_typed_error(
    value: str, tmp_path: Path
) -> None:
    assert_typed(
        lambda: BackendSettings.parse(
            {"store": "directory", "store_path": str(tmp_path), "some_key": HOSTILE[value]()},
            env=ENV,
        ),
        LIMIT,
    )

    def build() -> object:
        b = HiCacheBackend(storage_config(HOSTILE[value]()), {})
        b.close()
        return b

    assert_typed(build, LIMIT)
    assert_typed(lambda: HiCacheBackend(HOSTILE[value](), {}), LIMIT)
    assert_typed(lambda: HiCacheBackend(storage_config(None), {"store": HOSTILE[value]()}), LIMIT)


FUZZ = settings(
    max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


@FUZZ
@given(
    doc=st.dictionaries(
        st.one_of(st.sampled_from(BACKEND_KEYS), st.text(max_size=8), st.integers()),
        HOSTILE_DOCUMENTS,
        max_size=4,
    )
)
def test_any_extra_config_mapping_is_settings_or_a_short_typed_error(doc: dict[Any, Any]) -> None:
    assert_typed(lambda: BackendSettings.parse(doc, env=ENV), LIMIT)
