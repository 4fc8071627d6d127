"""Mooncake settings and return codes: no Mooncake process or wheel needed."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from hicache.adapters.storage.mooncake import (
    buffer_address,
    status_of_get,
    status_of_put,
    status_of_remove,
)
from hicache.adapters.storage.mooncake_config import (
    DEFAULT_GLOBAL_SEGMENT,
    DEFAULT_LOCAL_BUFFER,
    load_mooncake_config,
    parse_size,
)
from hicache.domain import ConfigError
from hicache.domain.storage import StoreStatus


def test_extra_config_naming_a_master_takes_the_reference_engines_defaults() -> None:
    c = load_mooncake_config({"master_server_address": "10.0.0.5:50051"}, environ={})
    assert c.master_server_address == "10.0.0.5:50051"
    assert c.master_host_port == ("10.0.0.5", 50051)
    assert c.metadata_server == "P2PHANDSHAKE"
    assert c.protocol == "tcp"
    assert c.device_name == ""
    assert c.global_segment_size == DEFAULT_GLOBAL_SEGMENT == 4 << 30
    assert c.local_buffer_size == DEFAULT_LOCAL_BUFFER == 16 << 20
    assert c.source == "the extra config"


def test_extra_config_reads_rdma_device_and_sizes_and_ignores_other_stores_keys() -> None:
    c = load_mooncake_config(
        {
            "master_server_address": "[fd00::1]:50051",
            "protocol": "RDMA",
            "device_name": "mlx5_0,mlx5_1",
            "metadata_server": "http://10.0.0.5:8080/metadata",
            "global_segment_size": "8gb",
            "local_buffer_size": 0,
            "prefetch_threshold": 256,  # a hicache key, not Mooncake's
        },
        environ={"MOONCAKE_MASTER": "ignored:1"},
    )
    assert (c.protocol, c.device_name) == ("rdma", "mlx5_0,mlx5_1")
    assert c.master_host_port == ("fd00::1", 50051)
    assert c.global_segment_size == 8 << 30
    assert c.local_buffer_size == 0


def test_every_bad_value_is_named_in_one_error() -> None:
    with pytest.raises(ConfigError) as info:
        load_mooncake_config(
            {
                "master_server_address": "no-port",
                "protocol": "udp",
                "global_segment_size": "lots",
                "local_buffer_size": -1,
                "timeout_s": 0,
                "local_hostname": "",
            },
            environ={},
        )
    text = str(info.value)
    for name in (
        "master_server_address 'no-port'",
        "protocol 'udp'",
        "global_segment_size 'lots'",
        "local_buffer_size -1",
        "timeout_s 0",
        "local_hostname ''",
    ):
        assert name in text


def test_no_source_naming_a_master_says_each_way_to_name_one() -> None:
    with pytest.raises(ConfigError, match=r"MOONCAKE_CONFIG_PATH.*MOONCAKE_MASTER"):
        load_mooncake_config({"protocol": "tcp"}, environ={})


def test_environment_variables_are_read_when_neither_extra_config_nor_file_names_a_master() -> None:
    c = load_mooncake_config(
        None,
        environ={
            "MOONCAKE_MASTER": "mc-master:50051",
            "MOONCAKE_PROTOCOL": "rdma",
            "MOONCAKE_DEVICE": "erdma_0",
            "MOONCAKE_GLOBAL_SEGMENT_SIZE": "2 GiB",
            "LOCAL_HOSTNAME": "node-7",
            "MOONCAKE_TIMEOUT_S": "0.5",
        },
    )
    assert c.master_server_address == "mc-master:50051"
    assert (c.protocol, c.device_name, c.local_hostname) == ("rdma", "erdma_0", "node-7")
    assert c.global_segment_size == 2 << 30
    assert c.timeout_s == 0.5
    assert "MOONCAKE_" in c.source


def test_a_json_file_named_by_the_environment_comes_before_the_environment(
    tmp_path: Path,
) -> None:
    path = tmp_path / "mooncake.json"
    path.write_text(json.dumps({"master_server_address": "file-host:7000", "protocol": "tcp"}))
    for var in ("MOONCAKE_CONFIG_PATH", "SGLANG_HICACHE_MOONCAKE_CONFIG_PATH"):
        c = load_mooncake_config({}, environ={var: str(path), "MOONCAKE_MASTER": "env:1"})
        assert c.master_server_address == "file-host:7000"
        assert str(path) in c.source


def test_a_config_file_with_unknown_keys_or_bad_json_or_not_a_file_is_refused(
    tmp_path: Path,
) -> None:
    typo = tmp_path / "typo.json"
    typo.write_text(json.dumps({"master_server_address": "h:1", "protcol": "tcp"}))
    with pytest.raises(ConfigError, match="unknown keys protcol"):
        load_mooncake_config(None, environ={"MOONCAKE_CONFIG_PATH": str(typo)})
    broken = tmp_path / "broken.json"
    broken.write_text("{" * 100_000)
    with pytest.raises(ConfigError, match="not valid JSON"):
        load_mooncake_config(None, environ={"MOONCAKE_CONFIG_PATH": str(broken)})
    with pytest.raises(ConfigError, match="not a regular file"):
        load_mooncake_config(None, environ={"MOONCAKE_CONFIG_PATH": str(tmp_path)})
    with pytest.raises(ConfigError, match="cannot read"):
        load_mooncake_config(None, environ={"MOONCAKE_CONFIG_PATH": str(tmp_path / "none")})


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (0, 0),
        (4096, 4096),
        ("4gb", 4 << 30),
        ("16 MB", 16 << 20),
        ("512MiB", 512 << 20),
        ("1k", 1024),
    ],
)
def test_sizes_take_integers_and_binary_unit_strings(value: object, expected: int) -> None:
    assert parse_size("size", value) == expected


@pytest.mark.parametrize("value", [True, 1.5, "1.5gb", "4 parsecs", -1, "9" * 40, None])
def test_sizes_refuse_booleans_floats_unknown_units_and_absurd_values(value: object) -> None:
    with pytest.raises(ConfigError, match="size"):
        parse_size("size", value)


def test_return_codes_map_to_the_ports_statuses() -> None:
    assert status_of_get(4096, 4096) is StoreStatus.OK
    assert status_of_get(2048, 4096) is StoreStatus.INVALID  # the object is smaller
    assert status_of_get(-600, 4096) is StoreStatus.INVALID  # the object is larger
    assert status_of_get(-704, 4096) is StoreStatus.MISS
    for transient in (-800, -900, -703, -707, -1, -12345):
        assert status_of_get(transient, 4096) is StoreStatus.TRANSIENT
    assert status_of_put(0) is StoreStatus.OK
    assert status_of_put(-705) is StoreStatus.OK  # already held: same key, same bytes
    assert status_of_put(-200) is StoreStatus.FULL
    assert status_of_put(-101) is StoreStatus.FULL
    assert status_of_put(-400) is StoreStatus.INVALID
    assert status_of_put(-800) is StoreStatus.TRANSIENT
    assert status_of_remove(-704) is StoreStatus.OK
    assert status_of_remove(-706) is StoreStatus.TRANSIENT  # read under a lease


def test_buffer_address_is_the_first_byte_without_a_copy() -> None:
    data = bytearray(os.urandom(64))
    view = memoryview(data)
    assert buffer_address(view[8:]) == buffer_address(view) + 8
    assert buffer_address(view.toreadonly()) == buffer_address(view)
    with pytest.raises(ConfigError, match="C-contiguous"):
        buffer_address(view[::2])
