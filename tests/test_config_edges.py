"""Bad values refused where they enter the configuration (issue 27): each case builds the bad
input and shows the typed error, checked when HiCacheConfig is built, with a message that names
the value and what was expected.

Classes: numbers past their bounds (seconds <= 1e6, finite; integers past float's range),
nesting deeper than MAX_DEPTH (environment JSON, mappings, values in messages), non-string keys,
a key given twice (JSON, YAML, nested + dotted), runtime.* values, extra configs that are not
mappings.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from hicache.bootstrap import HiCacheConfig, load_extra_config, storage_settings
from hicache.bootstrap.config import read_mapping_file
from hicache.bootstrap.storage import open_named_store
from hicache.domain import ConfigError, StorageSettings
from hicache.domain.breaker import Breaker
from hicache.domain.errors import shown
from hicache.domain.limits import MAX_DEPTH, MAX_SECONDS, bounded_seconds, is_finite_number
from hicache.engine.storage_settings import StorageTierSettings


def _deep(levels: int) -> list[object]:
    value: list[object] = []
    for _ in range(levels):
        value = [value]
    return value


SECONDS_KEYS = [
    "storage.tier.timeout_base_s",
    "storage.tier.timeout_per_ki_token_s",
    "storage.tier.timeout_max_s",
    "storage.tier.call_deadline_s",
    "storage.tier.breaker_cooldown_s",
]
TOO_BIG = [1e308, 10**400, MAX_SECONDS * 2, math.inf, -math.inf, math.nan]


@pytest.mark.parametrize("key", SECONDS_KEYS)
@pytest.mark.parametrize("value", TOO_BIG, ids=["1e308", "10**400", "2e6", "inf", "-inf", "nan"])
def test_seconds_past_the_bound_are_refused_when_the_config_is_built(
    key: str, value: object
) -> None:
    with pytest.raises(ConfigError) as e:
        HiCacheConfig.from_mapping({key: value})
    message = str(e.value)
    assert key in message
    assert "finite number" in message
    assert len(message) < 400  # a 401-digit integer is described, not printed


@pytest.mark.parametrize("key", SECONDS_KEYS)
def test_seconds_at_the_bound_are_accepted(key: str) -> None:
    config = HiCacheConfig.from_mapping(
        {key: MAX_SECONDS, "storage.tier.timeout_max_s": MAX_SECONDS}
    )
    assert config.value(key) == MAX_SECONDS


@pytest.mark.parametrize("text", ["1e308", "1e400", "inf", "nan", "1" + "0" * 400])
def test_seconds_from_the_environment_are_bounded_too(text: str) -> None:
    var = "HICACHE_STORAGE_TIER_CALL_DEADLINE_S"
    with pytest.raises(ConfigError, match=var):
        HiCacheConfig.load(env={var: text})


def test_the_settings_classes_refuse_the_same_values_without_the_config() -> None:
    for value in (1e308, 10**400, math.inf):
        with pytest.raises(ConfigError, match="call_deadline_s"):
            StorageTierSettings(call_deadline_s=value)  # type: ignore[arg-type]
        with pytest.raises(ConfigError, match="cooldown_s"):
            Breaker(cooldown_s=value)  # type: ignore[arg-type]


def test_bounded_seconds_and_is_finite_number_never_overflow() -> None:
    assert not is_finite_number(10**400)
    assert not is_finite_number(True)
    assert is_finite_number(10**300)
    with pytest.raises(ConfigError, match="an integer of about 401 digits"):
        bounded_seconds(10**400, "grace_s")
    with pytest.raises(ConfigError, match="> 0"):
        bounded_seconds(0, "grace_s", positive=True)
    assert bounded_seconds(5, "grace_s") == 5.0


def test_a_huge_host_ratio_or_pool_capacity_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match=r"plan.host_ratio"):
        HiCacheConfig.from_mapping({"plan.host_ratio": 10**400})
    with pytest.raises(ConfigError, match=r"plan.capacity_overrides"):
        HiCacheConfig.from_mapping({"plan.capacity_overrides": {"kv": 10**400}})


@pytest.mark.parametrize(
    "var",
    ["HICACHE_STORAGE_EXTRA_CONFIG", "HICACHE_PLAN_POOL_LAYOUTS", "HICACHE_COPY_BACKEND"],
)
def test_deeply_nested_json_in_a_variable_is_a_config_error_naming_it(var: str) -> None:
    text = '{"kv": ' + "[" * 100_000 + "]" * 100_000 + "}"
    with pytest.raises(ConfigError, match=var) as e:
        HiCacheConfig.load(env={var: text})
    assert "nested too deeply" in str(e.value)
    assert len(str(e.value)) < 600


@pytest.mark.parametrize("key", ["storage.extra_config", "plan.pool_layouts", "copy.backend"])
def test_a_deeply_nested_mapping_value_is_a_config_error(key: str) -> None:
    with pytest.raises(ConfigError, match=f"nested too deeply \\(at most {MAX_DEPTH} levels\\)"):
        HiCacheConfig.from_mapping({key: {"kv": _deep(5000)}})


@pytest.mark.parametrize("key", ["plan.page_size", "runtime.device", "storage.backend"])
def test_a_deep_value_of_a_scalar_key_is_shown_short(key: str) -> None:
    with pytest.raises(ConfigError, match=key) as e:
        HiCacheConfig.from_mapping({key: _deep(5000)})
    assert len(str(e.value)) < 300


def test_shown_bounds_depth_length_and_digits() -> None:
    assert shown(_deep(100_000)).count("[") <= 8
    assert shown(10**5000) == "an integer of about 5001 digits"
    assert len(shown("x" * 10_000)) <= 80
    assert shown([10**5000]) == "<list>"  # repr of such an int raises; shown never does

    class Broken:
        def __repr__(self) -> str:
            raise RuntimeError("no")

    assert shown(Broken()).startswith("<Broken")  # never raises


def test_non_string_keys_in_an_extra_config_are_a_config_error_naming_the_key() -> None:
    with pytest.raises(ConfigError, match=r"extra config key 1 \(int\)"):
        HiCacheConfig.from_mapping(
            {"storage.backend": "directory", "storage.extra_config": {1: 2, "root": "/tmp/x"}}
        )
    with pytest.raises(ConfigError, match=r"extra config key \(1, 2\)"):
        StorageSettings(backend="dynamic", extra_config={(1, 2): "x", "allocator": "shm"})
    with pytest.raises(ConfigError, match=r"extra config key 1"):
        open_named_store("directory", {1: 2, "a": 3})  # type: ignore[dict-item]


def test_non_string_keys_in_the_configuration_or_environment_are_config_errors() -> None:
    with pytest.raises(ConfigError, match=r"key 1 \(int, from mapping\)"):
        HiCacheConfig.from_mapping({1: 2, "plan": {}})  # type: ignore[dict-item]
    with pytest.raises(ConfigError, match="environment variable name 1"):
        HiCacheConfig.load(env={1: "x", "HICACHE_PLAN_PAGE_SIZE": "16"})  # type: ignore[dict-item]


@pytest.mark.parametrize("pairs", [[("root", "/tmp/x")], (("root", "/tmp/x"),)])
def test_an_extra_config_given_as_pairs_is_refused_everywhere(pairs: object) -> None:
    with pytest.raises(ConfigError, match=r"storage\.extra_config"):
        HiCacheConfig.from_mapping({"storage.extra_config": pairs})
    with pytest.raises(ConfigError, match="a mapping"):
        load_extra_config(pairs)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="a mapping"):
        storage_settings("directory", pairs)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="must be a mapping of text keys"):
        open_named_store("directory", pairs)  # type: ignore[arg-type]


DUPLICATES = {
    "json": ('{"storage": {"backend": "shm", "backend": "directory"}}', "'backend'"),
    "yaml": ("storage:\n  backend: shm\n  backend: directory\n", "'backend'"),
    "json-dotted": ('{"storage": {"backend": "shm"}, "storage.backend": "shm"}', "storage.backend"),
    "yaml-dotted": ("storage:\n  backend: shm\nstorage.backend: shm\n", "storage.backend"),
    "toml-dotted": ('"storage.backend" = "shm"\n[storage]\nbackend = "shm"\n', "storage.backend"),
}


@pytest.mark.parametrize("case", sorted(DUPLICATES))
def test_a_key_given_twice_in_a_config_file_is_refused_naming_key_and_file(
    tmp_path: Path, case: str
) -> None:
    text, key = DUPLICATES[case]
    path = tmp_path / f"hicache.{case.split('-')[0]}"
    path.write_text(text)
    with pytest.raises(ConfigError, match="given twice") as e:
        HiCacheConfig.load(path, env={})
    assert key in str(e.value)
    assert str(path) in str(e.value)


def test_a_key_given_twice_in_a_toml_file_is_refused_by_toml_itself(tmp_path: Path) -> None:
    path = tmp_path / "hicache.toml"
    path.write_text('[storage]\nbackend = "shm"\nbackend = "directory"\n')
    with pytest.raises(ConfigError, match=str(path)):
        HiCacheConfig.load(path, env={})


@pytest.mark.parametrize("suffix", [".json", ".yaml"])
def test_a_key_given_twice_in_an_extra_config_file_is_refused(tmp_path: Path, suffix: str) -> None:
    path = tmp_path / f"extra{suffix}"
    text = '{"root": "/a", "root": "/b"}' if suffix == ".json" else "root: /a\nroot: /b\n"
    path.write_text(text)
    with pytest.raises(ConfigError, match="'root' is given twice"):
        load_extra_config(path)
    with pytest.raises(ConfigError, match="'root' is given twice"):
        HiCacheConfig.load(env={"HICACHE_STORAGE_EXTRA_CONFIG": f"@{path}"})


def test_a_key_given_twice_in_environment_json_is_refused() -> None:
    var = "HICACHE_STORAGE_EXTRA_CONFIG"
    with pytest.raises(ConfigError, match=f"'root' is given twice.*{var}|{var}.*'root'"):
        HiCacheConfig.load(env={var: '{"root": "/a", "root": "/b"}'})


def test_a_yaml_merge_key_may_still_be_overridden(tmp_path: Path) -> None:
    path = tmp_path / "merge.yaml"
    path.write_text("base: &b {x: 1, y: 2}\nm:\n  <<: *b\n  x: 3\n")
    assert read_mapping_file(path)["m"] == {"x": 3, "y": 2}


@pytest.mark.parametrize("value", [-1, 0, 1025, 10**30])
def test_runtime_event_sets_out_of_range_is_refused_when_the_config_is_built(value: int) -> None:
    with pytest.raises(ConfigError, match=r"runtime.event_sets = .*expected an integer in \[1, "):
        HiCacheConfig.from_mapping({"runtime.event_sets": value})
    with pytest.raises(ConfigError, match="HICACHE_RUNTIME_EVENT_SETS"):
        HiCacheConfig.load(env={"HICACHE_RUNTIME_EVENT_SETS": str(value)})


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("runtime.device", "cuda:x"),
        ("runtime.device", 3),
        ("runtime.huge_pages", "maybe"),
        ("runtime.device_ownership", "nobody"),
        ("copy.backend", "nope"),
        ("copy.backend", {"kv": "nope"}),
    ],
)
def test_every_runtime_value_is_checked_when_the_config_is_built(key: str, value: object) -> None:
    with pytest.raises(ConfigError, match=key):
        HiCacheConfig.from_mapping({key: value})


@pytest.mark.parametrize("value", [math.inf, 1e308, 10**400, -1.0])
def test_an_injected_slow_store_call_sleeps_a_bounded_time_or_is_refused(value: object) -> None:
    from hicache.bootstrap.faults import StoreFaultRates

    with pytest.raises(ConfigError, match=r"slow_s must be a (finite )?number of seconds"):
        StoreFaultRates(slow_s=value)  # type: ignore[arg-type]


@pytest.mark.parametrize("value", ["deep", "10**5000", "int"])
def test_every_name_parser_refuses_a_non_text_value_without_recursing(value: str) -> None:
    from hicache.adapters.storage.checksum import Checksum
    from hicache.domain import Layout, PoolName, WritePolicy
    from hicache.engine.storage_settings import PrefetchPolicy

    bad = {"deep": _deep(5000), "10**5000": 10**5000, "int": 3}[value]
    for parse in (
        Layout.parse,
        PoolName.parse,
        WritePolicy.parse,
        PrefetchPolicy.parse,
        Checksum.parse,
    ):
        with pytest.raises(ConfigError) as e:
            parse(bad)
        assert len(str(e.value)) < 300
