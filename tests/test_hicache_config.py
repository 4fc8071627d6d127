"""HiCacheConfig: one configuration from defaults, a file, a mapping and HICACHE_* variables;
every error names the key and where its value came from (hicache.bootstrap.hicache_config)."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest

from hicache.bootstrap import HiCacheConfig, load_model_spec
from hicache.bootstrap.config_keys import BY_ENV, COPY_BACKENDS, KEYS, OTHER_ENV_VARS, SECTIONS
from hicache.cache.values import CacheSettings
from hicache.domain import ConfigError, PlanSettings, StorageSettings, plan_stack
from hicache.engine.storage_settings import StorageTierSettings

pytestmark = pytest.mark.timeout(60)
ROOT = Path(__file__).resolve().parents[1]

FILES = {
    ".toml": '[plan]\npage_size = 32\ndevice_tokens = 4096\n[storage]\nbackend = "directory"\n',
    ".yaml": "plan:\n  page_size: 32\n  device_tokens: 4096\nstorage:\n  backend: directory\n",
    ".json": json.dumps(
        {"plan": {"page_size": 32, "device_tokens": 4096}, "storage.backend": "directory"}
    ),
}


def _write(tmp_path: Path, suffix: str, text: str) -> Path:
    path = tmp_path / f"hicache{suffix}"
    path.write_text(text)
    return path


def test_the_defaults_are_the_settings_classes_defaults() -> None:
    config = HiCacheConfig.load(env={})
    assert config.plan_settings() == PlanSettings()
    assert config.cache_settings() == CacheSettings(storage=StorageTierSettings())
    assert config.storage_settings() == StorageSettings()
    assert config.runtime_options() == {
        "device": "cpu",
        "backend": "auto",
        "huge_pages": False,
        "event_sets": 3,
        "device_ownership": "engine",
    }
    assert config.open_store() is None
    assert {e.source.kind for e in config.entries()} == {"default"}


@pytest.mark.parametrize("suffix", sorted(FILES))
def test_a_file_sets_values_and_the_environment_overrides_it(tmp_path: Path, suffix: str) -> None:
    path = _write(tmp_path, suffix, FILES[suffix])
    config = HiCacheConfig.load(path, env={"HICACHE_PLAN_PAGE_SIZE": "16"})
    assert config.plan_settings().page_size == 16
    assert str(config.source("plan.page_size")) == "env HICACHE_PLAN_PAGE_SIZE"
    assert config.plan_settings().device_tokens == 4096
    assert str(config.source("plan.device_tokens")) == f"file {path}"
    assert config.storage_settings() == StorageSettings(backend="directory")
    assert config.plan_settings().storage == StorageSettings(backend="directory")
    assert str(config.source("plan.layout")) == "default"


def test_hicache_config_names_the_file_when_no_path_is_given(tmp_path: Path) -> None:
    path = _write(tmp_path, ".toml", FILES[".toml"])
    config = HiCacheConfig.load(env={"HICACHE_CONFIG": str(path)})
    assert config.file == path
    assert config.value("plan.page_size") == 32


def test_an_unknown_key_names_the_key_and_its_source(tmp_path: Path) -> None:
    path = _write(tmp_path, ".toml", "[plan]\npage_sise = 32\n")
    with pytest.raises(
        ConfigError,
        match=rf"'plan.page_sise' \(from file {re.escape(str(path))}\).*'plan.page_size'",
    ):
        HiCacheConfig.load(path, env={})
    with pytest.raises(
        ConfigError, match=r"HICACHE_PAGE_SIZE.*did you mean 'HICACHE_PLAN_PAGE_SIZE'"
    ):
        HiCacheConfig.load(env={"HICACHE_PAGE_SIZE": "32"})
    with pytest.raises(ConfigError, match=r"'cache.write' \(from kv_connector_extra_config\)"):
        HiCacheConfig.from_mapping({"cache": {"write": {}}}, source="kv_connector_extra_config")
    with pytest.raises(ConfigError, match=r"'host_gib' \(from kv_connector_extra_config\)"):
        HiCacheConfig.from_mapping({"host_gib": 4}, source="kv_connector_extra_config")


def test_variables_that_are_not_keys_are_left_alone() -> None:
    env = dict.fromkeys(OTHER_ENV_VARS - {"HICACHE_CONFIG"}, "x")
    env["SGLANG_HICACHE_MOONCAKE_CONFIG_PATH"] = "/nowhere"
    assert {e.source.kind for e in HiCacheConfig.load(env=env).entries()} == {"default"}


@pytest.mark.parametrize(
    ("data", "source", "message"),
    [
        (
            {"plan.page_size": "64"},
            "file",
            r"plan.page_size = '64' \(from file .*\): expected an integer",
        ),
        (
            {"runtime.huge_pages": "yes"},
            "file",
            r"runtime.huge_pages = 'yes' .*expected true or false",
        ),
        ({"copy.backend": "cuda"}, "file", r"copy.backend = 'cuda' .*expected one of auto, naive"),
        ({"runtime.device": "tpu"}, "file", r"runtime.device = 'tpu' .*cpu, cuda\[:N\] or rocm"),
        ({"storage.backend": "s3"}, "file", r"storage.backend = 's3' .*expected one of aibrix"),
        (
            {"plan.pool_layouts": {"mamba": "bad"}},
            "file",
            r"pool 'mamba': expected one of layer_first",
        ),
    ],
)
def test_a_value_of_the_wrong_kind_names_key_value_and_file(
    tmp_path: Path, data: dict[str, object], source: str, message: str
) -> None:
    path = _write(tmp_path, ".json", json.dumps(data))
    with pytest.raises(ConfigError, match=message):
        HiCacheConfig.load(path, env={})


def test_environment_text_is_converted_and_a_bad_one_names_the_variable() -> None:
    config = HiCacheConfig.load(
        env={
            "HICACHE_RUNTIME_HUGE_PAGES": "on",
            "HICACHE_STORAGE_TIER_TIMEOUT_BASE_S": "1.5",
            "HICACHE_PLAN_SWA_TOKENS": "none",
            "HICACHE_COPY_BACKEND": '{"kv": "torch"}',
            "HICACHE_PLAN_HOST_SIZE": "1GiB",
        }
    )
    assert config.runtime_options()["huge_pages"] is True
    assert config.runtime_options()["backend"] == {"kv": "torch"}
    assert config.storage_tier_settings().timeout_base_s == 1.5
    assert config.plan_settings().sizing.bytes_per_rank == 1 << 30  # type: ignore[union-attr]
    with pytest.raises(ConfigError, match=r"= 'lots' \(from env HICACHE_PLAN_DEVICE_TOKENS\)"):
        HiCacheConfig.load(env={"HICACHE_PLAN_DEVICE_TOKENS": "lots"})


def test_a_refused_combination_names_every_key_involved_and_its_source(tmp_path: Path) -> None:
    path = _write(tmp_path, ".toml", "[plan]\npp_size = 2\n")
    with pytest.raises(ConfigError) as info:
        HiCacheConfig.load(path, env={"HICACHE_PLAN_PP_RANK": "2"})
    text = str(info.value)
    assert "pp_rank must be in [0, 2), got 2" in text
    assert f"plan.pp_size = 2 from file {path}" in text
    assert "plan.pp_rank = 2 from env HICACHE_PLAN_PP_RANK" in text
    # The message names only device_tokens (at its default): the key the caller set is added.
    with pytest.raises(ConfigError, match=r"plan.page_size = 48 from kv_connector"):
        HiCacheConfig.from_mapping({"plan": {"page_size": 48}}, source="kv_connector_extra_config")
    with pytest.raises(ConfigError, match=r"timeout_max_s = 1.0 from m"):
        HiCacheConfig.from_mapping({"storage.tier.timeout_max_s": 1.0}, source="m")
    with pytest.raises(
        ConfigError, match=r"host_size = .* from m and plan.host_ratio = 3.0 from m"
    ):
        HiCacheConfig.from_mapping({"plan": {"host_size": "1GiB", "host_ratio": 3.0}}, source="m")


def test_nested_and_dotted_mappings_agree_and_as_mapping_round_trips() -> None:
    nested = {"plan": {"tp_size": 2}, "cache": {"writes": {"storage": "write_back"}}}
    dotted = {"plan.tp_size": 2, "cache.writes.storage": "write_back"}
    a = HiCacheConfig.from_mapping(nested, source="a")
    b = HiCacheConfig.from_mapping(dotted, source="b")
    assert a.as_mapping() == b.as_mapping()
    assert str(a.source("plan.tp_size")) == "a"
    again = HiCacheConfig.from_mapping(json.loads(json.dumps(a.as_mapping())), source="c")
    assert again.plan_settings() == a.plan_settings()
    assert again.cache_settings() == a.cache_settings()


def test_with_values_layers_a_framework_mapping_over_file_and_environment(tmp_path: Path) -> None:
    path = _write(tmp_path, ".toml", FILES[".toml"])
    base = HiCacheConfig.load(path, env={"HICACHE_PLAN_TP_SIZE": "4"})
    top = base.with_values({"plan.tp_size": 8}, source="kv_connector_extra_config")
    assert top.value("plan.tp_size") == 8
    assert str(top.source("plan.tp_size")) == "kv_connector_extra_config"
    assert top.value("plan.page_size") == 32  # the file's value stays
    # load(mapping=...) puts the mapping under the environment instead.
    under = HiCacheConfig.load(path, env={"HICACHE_PLAN_TP_SIZE": "4"}, mapping={"plan.tp_size": 8})
    assert under.value("plan.tp_size") == 4


def test_an_extra_config_file_is_found_next_to_the_config_file(tmp_path: Path) -> None:
    (tmp_path / "store.yaml").write_text("root: /tmp/somewhere\nfsync: true\n")
    path = _write(
        tmp_path, ".toml", '[storage]\nbackend = "directory"\nextra_config = "@store.yaml"\n'
    )
    config = HiCacheConfig.load(path, env={})
    assert dict(config.storage_settings().extra_config) == {"root": "/tmp/somewhere", "fsync": True}


def test_plan_stack_takes_the_config() -> None:
    spec = load_model_spec("llama-3.1-8b-instruct")
    config = HiCacheConfig.from_mapping({"plan": {"tp_size": 8, "device_tokens": 256}}, source="t")
    assert plan_stack(spec, config) == plan_stack(spec, config.plan_settings())


@pytest.mark.asyncio
async def test_open_cache_takes_store_settings_and_runtime_options_from_the_config(
    tmp_path: Path,
) -> None:
    from hicache.bootstrap import open_cache, open_runtime

    root = tmp_path / "store"
    config = HiCacheConfig.from_mapping(
        {
            "plan": {"tp_size": 8, "device_tokens": 256},
            "cache": {"writes": {"storage": "write_through"}},
            "storage": {"backend": "directory", "extra_config": {"root": str(root)}},
            "copy": {"backend": "torch"},
            "runtime": {"device_ownership": "framework"},
        },
        source="test",
    )
    plan = plan_stack(load_model_spec("llama-3.1-8b-instruct"), config)
    async with open_cache(plan, config=config) as rt:
        assert rt.cache.settings == config.cache_settings()
        assert rt.store is not None
        assert Path(rt.store.root) == root  # type: ignore[attr-defined]
        assert rt.engine.device_ownership == "framework"
        assert set(rt.runtime.transfer.backends.values()) == {"torch"}  # type: ignore[attr-defined]
    assert root.is_dir()
    with pytest.raises(
        ConfigError, match=r"backend='memcpy' given together with config=.*copy.backend"
    ):
        open_runtime(plan, config=config, backend="memcpy")
    with pytest.raises(ConfigError, match="settings= or store= given together with config="):
        open_cache(plan, config=config, settings=CacheSettings())


def test_copy_backend_names_match_the_copy_adapters() -> None:
    from hicache.adapters.copy import AUTO, BACKENDS, ENV_BACKEND

    assert set(COPY_BACKENDS) == {AUTO, *BACKENDS}
    assert BY_ENV[ENV_BACKEND].name == "copy.backend"


def test_every_key_has_its_own_variable_under_its_section() -> None:
    assert len({k.env for k in KEYS}) == len(KEYS)
    assert all(k.section in SECTIONS for k in KEYS)
    assert not set(BY_ENV) & OTHER_ENV_VARS


def test_every_hicache_variable_in_the_repository_is_a_key_or_known() -> None:
    """A new HICACHE_* variable read somewhere must be a key or listed in OTHER_ENV_VARS, or
    HiCacheConfig.load() would refuse an environment that sets it."""
    out = subprocess.run(
        # The configuration's own tests name unknown variables on purpose.
        [
            "grep",
            "-rhoE",
            "--exclude=test_*config*",
            r"\bHICACHE_[A-Z_]+",
            "src",
            "scripts",
            "tests",
            ".ci",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    ).stdout
    names = {n.rstrip("_") for n in out.split()}
    names = {n for n in names if not n.endswith("_PREFIX") and n != "HICACHE"}
    prefixes = {f"HICACHE_{s.upper()}" for s in SECTIONS}
    unknown = sorted(n for n in names - set(BY_ENV) - OTHER_ENV_VARS - prefixes)
    assert not unknown, unknown


def test_open_cache_refuses_a_plan_made_without_the_config() -> None:
    from hicache.bootstrap import open_cache

    spec = load_model_spec("llama-3.1-8b-instruct")
    other = plan_stack(spec, PlanSettings(tp_size=8, device_tokens=256))
    shm = HiCacheConfig.from_mapping({"plan.tp_size": 8, "storage.backend": "shm"}, source="t")
    with pytest.raises(ConfigError, match=r"host memory is anonymous but storage.backend = 'shm'"):
        open_cache(other, config=shm)
    pages = HiCacheConfig.from_mapping(
        {"plan": {"page_size": 32, "device_tokens": 256}}, source="t"
    )
    with pytest.raises(ConfigError, match=r"pages hold 64 tokens but plan.page_size = 32 from t"):
        open_cache(other, config=pages)


def test_a_missing_hicache_config_file_names_the_variable(tmp_path: Path) -> None:
    missing = tmp_path / "nowhere.toml"
    with pytest.raises(ConfigError, match=r"nowhere.toml.*\(the file env HICACHE_CONFIG names\)"):
        HiCacheConfig.load(env={"HICACHE_CONFIG": str(missing)})
