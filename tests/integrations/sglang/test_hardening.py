"""Bad calls to HiCacheBackend are typed errors (ConfigError) naming the value, never a silent
misread: keys that are not a list of str, missing or foreign buffers and host indices, bad pool
registrations and bad seconds settings."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.integrations.sglang.support import require_sglang

require_sglang()

from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: E402

from hicache.domain.errors import ConfigError, HiCacheError  # noqa: E402
from hicache.integrations.sglang import HiCacheBackend  # noqa: E402
from tests.integrations.sglang.conftest import extra, storage_config  # noqa: E402
from tests.integrations.sglang.pools import fill_page, keys, mha_pool, tokens  # noqa: E402

pytestmark = pytest.mark.sglang


def test_config_error_is_a_hicache_error() -> None:
    assert issubclass(ConfigError, HiCacheError)


@pytest.mark.parametrize(
    "bad",
    [None, "abc", (k for k in ["a"]), ["a", None], ["a", 3], b"ab"],
    ids=["none", "str", "generator", "none-key", "int-key", "bytes"],
)
def test_keys_that_are_not_a_list_of_str_are_refused_by_every_call(
    make_backend: Any, bad: Any
) -> None:
    pool = mha_pool("page_first")
    backend = make_backend(pool)
    with pytest.raises(ConfigError, match="keys"):
        backend.batch_get_v1(bad, tokens(pool, 0, 1))
    with pytest.raises(ConfigError, match="keys"):
        backend.batch_set_v1(bad, tokens(pool, 0, 1))
    with pytest.raises(ConfigError, match="keys"):
        backend.batch_exists(bad)
    with pytest.raises(ConfigError, match="keys"):
        backend.batch_get(bad, [pool.get_dummy_flat_data_page()])


def test_a_str_is_not_read_as_one_key_per_character(make_backend: Any) -> None:
    pool = mha_pool("page_first")
    backend = make_backend(pool)
    fill_page(pool, 0, 1)
    assert backend.batch_set_v1(["abc"], tokens(pool, 0, 1)) == [True]
    with pytest.raises(ConfigError, match="'abc'"):
        backend.batch_exists("abc")
    with pytest.raises(ConfigError, match="key None"):
        backend.exists(None)


def test_host_indices_that_are_not_an_integer_cpu_tensor_are_refused(make_backend: Any) -> None:
    pool = mha_pool("page_first")
    backend = make_backend(pool)
    good = tokens(pool, 0, 1)
    with pytest.raises(ConfigError, match="list"):
        backend.batch_get_v1(keys(1), good.tolist())
    with pytest.raises(ConfigError, match="NoneType"):
        backend.batch_set_v1(keys(1), None)
    with pytest.raises(ConfigError, match="dtype"):
        backend.batch_get_v1(keys(1), good.to(torch.float32) + 0.5)
    with pytest.raises(ConfigError, match="meta"):
        backend.batch_get_v1(keys(1), good.to("meta"))
    with FakeTensorMode():
        on_gpu = torch.empty(good.numel(), dtype=torch.int64, device="cuda")
    with pytest.raises(ConfigError, match="cuda"):
        backend.batch_set_v1(keys(1), on_gpu)


def test_flat_pages_that_are_none_or_not_tensors_are_refused(make_backend: Any) -> None:
    pool = mha_pool("page_first")
    backend = make_backend(pool)
    with pytest.raises(ConfigError, match="list of 1 flat page tensors, got NoneType"):
        backend.batch_get(keys(1), None)
    with pytest.raises(ConfigError, match="NoneType"):
        backend.batch_set(keys(1), [None])
    page = pool.get_dummy_flat_data_page()
    read_only = bytes(page.numel() * page.element_size())
    with pytest.raises(ConfigError, match="bytes: expected a writable"):
        backend.batch_get(keys(1), [read_only])
    with pytest.raises(ConfigError, match="memoryview"):
        backend.batch_get(keys(1), [memoryview(read_only)])


def test_bad_pool_registrations_are_refused(tmp_path: Path) -> None:
    backend = HiCacheBackend(storage_config(extra(tmp_path / "s")))
    try:
        with pytest.raises(ConfigError, match="not an SGLang host pool"):
            backend.register_mem_pool_host(object())
        with pytest.raises(ConfigError, match="host_pool_name"):
            backend.register_mem_host_pool_v2(mha_pool("page_first"), None)
        with pytest.raises(ConfigError, match="host_pool_name"):
            backend.register_mem_host_pool_v2(mha_pool("page_first"), "")
    finally:
        backend.close()


@pytest.mark.parametrize("key", ["grace_s", "deadline_s", "breaker_cooldown_s"])
@pytest.mark.parametrize("value", [math.nan, math.inf, 1e6 + 1, 10**400, 0, -1, "1"])
def test_seconds_settings_outside_0_to_1e6_are_refused(
    tmp_path: Path, key: str, value: Any
) -> None:
    with pytest.raises(ConfigError, match=key):
        HiCacheBackend(storage_config(extra(tmp_path / "s", **{key: value})))


def test_a_non_string_extra_config_key_is_refused(tmp_path: Path) -> None:
    config: dict[Any, Any] = extra(tmp_path / "s")
    config[7] = "x"
    with pytest.raises(ConfigError, match="key 7"):
        HiCacheBackend(storage_config(config))


def test_a_misspelt_mooncake_key_is_refused() -> None:
    config = extra(None, store="mooncake", master_server_adress="127.0.0.1:1")
    with pytest.raises(ConfigError, match="master_server_adress"):
        HiCacheBackend(storage_config(config))
