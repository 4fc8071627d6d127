"""kv_connector_extra_config: every key checked at start, one error naming the bad key."""

from __future__ import annotations

import pytest

from hicache.domain import ConfigError
from hicache.integrations.vllm.settings import ConnectorSettings


def test_defaults_are_host_only_with_decode_saves() -> None:
    s = ConnectorSettings.from_extra_config({})
    assert s.storage_backend is None
    assert s.save_decode is True
    assert s.storage() is None
    assert not s.writes_storage


def test_directory_store_takes_its_path_as_root(tmp_path: object) -> None:
    s = ConnectorSettings.from_extra_config(
        {"host_gib": 0.5, "storage_backend": "directory", "storage_path": str(tmp_path)}
    )
    storage = s.storage()
    assert storage is not None
    assert storage.backend == "directory"
    assert storage.extra_config["root"] == str(tmp_path)
    assert s.host_bytes == 1 << 29
    assert s.writes_storage


@pytest.mark.parametrize(
    ("config", "named"),
    [
        ({"host_gb": 1}, "'host_gb'"),
        ({"host_gib": 0}, "'host_gib'"),
        ({"host_gib": "2"}, "'host_gib'"),
        ({"storage_backend": "s3"}, "'storage_backend'"),
        ({"copy_backend": "cuda"}, "'copy_backend'"),
        ({"storage_backend": "directory"}, "'storage_path'"),
        ({"storage_path": "/tmp/x"}, "'storage_path'"),
        ({"storage_extra_config": {"a": 1}}, "'storage_extra_config'"),
        (
            {"storage_backend": "directory", "storage_path": "/x", "storage_extra_config": 3},
            "'storage_extra_config'",
        ),
        ({"write_policy": "write_back"}, "'write_policy'"),
        ({"save_decode": "yes"}, "'save_decode'"),
        ({"deadline_s": 0}, "'deadline_s'"),
        ({"deadline_s": float("inf")}, "'deadline_s'"),
        ({"grace_s": float("nan")}, "'grace_s'"),
        ({"grace_s": -1}, "'grace_s'"),
        ({"grace_s": True}, "'grace_s'"),
        ({"deadline_s": "2"}, "'deadline_s'"),
        ({"deadline_s": 1e308}, "'deadline_s'"),
        ({"grace_s": 10**400}, "'grace_s'"),
    ],
)
def test_bad_key_or_value_is_refused_naming_the_key(config: dict[str, object], named: str) -> None:
    with pytest.raises(ConfigError, match=named):
        ConnectorSettings.from_extra_config(config)


def test_none_backend_means_no_storage_tier() -> None:
    assert ConnectorSettings.from_extra_config({"storage_backend": "none"}).storage() is None


def test_host_only_policy_never_writes_the_store(tmp_path: object) -> None:
    s = ConnectorSettings.from_extra_config(
        {"storage_backend": "directory", "storage_path": str(tmp_path), "write_policy": "host_only"}
    )
    assert not s.writes_storage


def test_every_store_call_is_bounded_by_deadline_plus_grace() -> None:
    s = ConnectorSettings.from_extra_config({})
    assert (s.deadline_s, s.grace_s) == (2.0, 1.0)
    s = ConnectorSettings.from_extra_config({"deadline_s": 5, "grace_s": 0.5})
    assert s.bounds() == {"deadline_s": 5.0, "grace_s": 0.5}


@pytest.mark.parametrize("backend", ["auto", "native", "cuda_batch", "torch"])
def test_every_copy_backend_of_the_worker_is_accepted(backend: str) -> None:
    assert ConnectorSettings.from_extra_config({"copy_backend": backend}).copy_backend == backend


@pytest.mark.parametrize("host_gib", [float("inf"), float("nan"), 1e308, 10**400, -1.0, True])
def test_host_gib_that_is_not_a_sane_finite_size_is_refused_naming_it(host_gib: object) -> None:
    with pytest.raises(ConfigError, match="'host_gib'"):
        ConnectorSettings.from_extra_config({"host_gib": host_gib})


def test_the_largest_host_gib_accepted_converts_to_bytes() -> None:
    from hicache.domain.limits import MAX_BYTES
    from hicache.integrations.vllm.settings import MAX_HOST_GIB

    assert ConnectorSettings.from_extra_config({"host_gib": MAX_HOST_GIB}).host_bytes == MAX_BYTES


def test_a_non_string_key_is_refused_naming_it() -> None:
    with pytest.raises(ConfigError, match="key 3: expected string keys"):
        ConnectorSettings.from_extra_config({3: 1})
    with pytest.raises(ConfigError, match="'storage_extra_config' key 7"):
        ConnectorSettings.from_extra_config(
            {"storage_backend": "directory", "storage_path": "/x", "storage_extra_config": {7: 1}}
        )


def test_a_root_in_the_directory_store_extra_config_is_refused_not_overwritten() -> None:
    with pytest.raises(ConfigError, match=r"'root'.*'storage_path'"):
        ConnectorSettings.from_extra_config(
            {
                "storage_backend": "directory",
                "storage_path": "/a",
                "storage_extra_config": {"root": "/b"},
            }
        )


@pytest.mark.parametrize(
    ("backend", "extra", "named"),
    [
        ("mooncake", {"protocl": "tcp"}, "'protocl'"),
        ("mooncake", {"master_server_address": "h:1", "global_segment_size": -5}, "segment"),
        ("directory", {"fsyncc": True}, "fsyncc"),
        ("directory", {"checksum": "md77"}, "md77"),
        ("directory", {"read_threads": 0}, "read_threads"),
        ("dynamic", {"module_path": "x.y"}, "class_name"),
    ],
)
def test_a_misspelt_or_bad_store_key_is_refused_by_the_stores_own_parser(
    backend: str, extra: dict[str, object], named: str
) -> None:
    config: dict[str, object] = {"storage_backend": backend, "storage_extra_config": extra}
    if backend == "directory":
        config["storage_path"] = "/tmp/hicache-never-opened"
    with pytest.raises(ConfigError, match=named):
        ConnectorSettings.from_extra_config(config, env={})


def test_good_store_configs_pass_without_opening_the_store(tmp_path: object) -> None:
    root = f"{tmp_path}/never"
    s = ConnectorSettings.from_extra_config(
        {
            "storage_backend": "directory",
            "storage_path": root,
            "storage_extra_config": {"fsync": True, "checksum": "crc32"},
        },
        env={},
    )
    assert s.storage_extra_config == {"fsync": True, "checksum": "crc32"}
    import os

    assert not os.path.exists(root)
    mc = ConnectorSettings.from_extra_config(
        {
            "storage_backend": "mooncake",
            "storage_extra_config": {"master_server_address": "10.0.0.5:50051", "protocol": "tcp"},
        },
        env={},
    )
    assert mc.storage_backend == "mooncake"
