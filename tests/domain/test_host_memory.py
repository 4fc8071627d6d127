"""Host memory kinds and their one resolution point from the storage settings."""

from __future__ import annotations

import pytest

from hicache.domain import (
    ConfigError,
    HostMemory,
    MemoryKind,
    Pinning,
    StorageSettings,
    parse_extra_config,
    resolve_host_memory,
)


def kind_of(backend: str | None, extra: object = None) -> str:
    return resolve_host_memory(StorageSettings(backend, extra)).kind.name  # type: ignore[arg-type]


def test_no_backend_is_anonymous_memory() -> None:
    assert kind_of(None) == "anonymous"


def test_shm_backend_is_shared_memory() -> None:
    assert kind_of("shm") == "shm"


@pytest.mark.parametrize(
    ("allocator", "kind"),
    [
        ("shm", "shm"),
        (" SHM ", "shm"),
        ("anonymous", "anonymous"),
        ("mooncake", "store:mooncake"),
        ("store:mooncake", "store:mooncake"),
    ],
)
def test_dynamic_backend_takes_the_extra_configs_allocator(allocator: str, kind: str) -> None:
    assert kind_of("dynamic", {"allocator": allocator}) == kind


def test_mooncake_owns_its_host_memory() -> None:
    mem = resolve_host_memory(StorageSettings("mooncake"))
    assert mem.kind.name == "store:mooncake"
    assert mem.kind.store == "mooncake"


@pytest.mark.parametrize("backend", ["file", "hf3fs", "nixl", "aibrix", "eic", "lmcache"])
def test_other_known_backends_use_anonymous_memory(backend: str) -> None:
    assert kind_of(backend) == "anonymous"


def test_the_extra_config_of_a_plain_backend_does_not_change_its_memory() -> None:
    assert kind_of("file", {"allocator": "shm"}) == "anonymous"


def test_json_string_and_mapping_resolve_the_same() -> None:
    from_json = StorageSettings("dynamic", '{"allocator": "shm", "size": 3}')
    from_dict = StorageSettings("dynamic", {"allocator": "shm", "size": 3})
    assert from_json == from_dict
    assert resolve_host_memory(from_json) == resolve_host_memory(from_dict)


def test_unknown_backend_is_a_config_error_naming_it() -> None:
    with pytest.raises(ConfigError, match=r"unknown storage backend 'redis'.*dynamic.*mooncake"):
        StorageSettings("redis")


def test_unknown_allocator_is_a_config_error_naming_it() -> None:
    with pytest.raises(ConfigError, match=r"unknown allocator 'hugepages'.*shm"):
        resolve_host_memory(StorageSettings("dynamic", {"allocator": "hugepages"}))


def test_allocator_must_be_a_string() -> None:
    with pytest.raises(ConfigError, match="'allocator' must be a string, got 3"):
        resolve_host_memory(StorageSettings("dynamic", {"allocator": 3}))


def test_dynamic_without_an_allocator_says_what_is_missing() -> None:
    with pytest.raises(ConfigError, match=r"needs an 'allocator'.*got keys \['size'\]"):
        resolve_host_memory(StorageSettings("dynamic", {"size": 1}))


@pytest.mark.parametrize(
    "extra",
    [{"module_path": "pkg.mod", "class_name": "Store"}, {"backend_name": "mystore"}],
)
def test_dynamic_naming_only_a_store_plugin_takes_anonymous_memory(extra: dict[str, str]) -> None:
    assert resolve_host_memory(StorageSettings("dynamic", extra)).kind.name == "anonymous"
    with_allocator = StorageSettings("dynamic", {**extra, "allocator": "shm"})
    assert resolve_host_memory(with_allocator).kind.name == "shm"


def test_dynamic_with_half_a_plugin_still_needs_an_allocator() -> None:
    with pytest.raises(ConfigError, match="needs an 'allocator'"):
        resolve_host_memory(StorageSettings("dynamic", {"module_path": "pkg.mod"}))


@pytest.mark.parametrize("text", ['{"allocator": shm}', "{", "allocator=shm"])
def test_malformed_json_is_a_config_error_naming_the_value(text: str) -> None:
    with pytest.raises(ConfigError, match="not valid JSON") as info:
        StorageSettings("dynamic", text)
    assert text in str(info.value)


def test_extra_config_must_be_a_json_object() -> None:
    with pytest.raises(ConfigError, match="must be a JSON object, got list"):
        parse_extra_config('["shm"]')


def test_an_at_file_is_read_by_bootstrap_not_the_domain() -> None:
    with pytest.raises(ConfigError, match="load_extra_config"):
        parse_extra_config("@extra.toml")


@pytest.mark.parametrize("empty", [None, "", "  ", {}])
def test_empty_extra_config_is_an_empty_mapping(empty: object) -> None:
    assert parse_extra_config(empty) == {}  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("value", "pinning"),
    [
        (None, Pinning.AUTO),
        (True, Pinning.ON),
        (False, Pinning.OFF),
        ("on", Pinning.ON),
        ("FALSE", Pinning.OFF),
        ("auto", Pinning.AUTO),
        (Pinning.ON, Pinning.ON),
    ],
)
def test_pinning_parse(value: object, pinning: Pinning) -> None:
    assert Pinning.parse(value) is pinning  # type: ignore[arg-type]


def test_unknown_pinning_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="unknown pinning 'sometimes'"):
        Pinning.parse("sometimes")


def test_resolution_carries_the_pinning() -> None:
    mem = resolve_host_memory(StorageSettings("shm"), pinned=True)
    assert mem == HostMemory(MemoryKind("shm"), Pinning.ON)
    assert mem.as_json() == {"kind": "shm", "pinned": True}
    assert resolve_host_memory(StorageSettings()).as_json() == {
        "kind": "anonymous",
        "pinned": "auto",
    }


@pytest.mark.parametrize("name", ["dynamic", "store:redis", "store:", "SHM"])
def test_memory_kind_accepts_only_real_kinds(name: str) -> None:
    with pytest.raises(ConfigError, match=f"unknown host memory kind {name!r}"):
        MemoryKind(name)
