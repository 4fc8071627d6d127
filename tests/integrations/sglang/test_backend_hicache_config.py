"""The backend's keys that are hicache configuration keys too go through HiCacheConfig.

``deadline_s``, ``breaker_threshold``, ``breaker_cooldown_s`` and ``max_concurrency`` are
``storage.tier.*`` keys: a value in the extra config wins; a key left out takes its
``HICACHE_STORAGE_TIER_*`` variable; a bad value from either fails the start naming the
backend's key, hicache's key and where the value came from.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.integrations.sglang.support import require_sglang

require_sglang()

from hicache.domain.errors import ConfigError  # noqa: E402
from hicache.integrations.sglang.settings import TIER_KEYS, BackendSettings  # noqa: E402
from tests.integrations.sglang.pools import mha_pool  # noqa: E402

pytestmark = pytest.mark.sglang


def test_a_tier_key_left_out_of_the_extra_config_takes_its_hicache_variable() -> None:
    env = {
        "HICACHE_STORAGE_TIER_CALL_DEADLINE_S": "7.5",
        "HICACHE_STORAGE_TIER_MAX_CONCURRENCY": "9",
    }
    s = BackendSettings.parse({"max_concurrency": 2}, env=env)
    assert (s.deadline_s, s.max_concurrency) == (7.5, 2)  # the extra config wins
    assert (s.breaker_threshold, s.breaker_cooldown_s) == (5, 10.0)  # the backend's defaults


def test_the_tier_of_a_registered_pool_uses_the_variable(
    make_backend: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HICACHE_STORAGE_TIER_BREAKER_THRESHOLD", "3")
    backend = make_backend(mha_pool("page_first"))
    assert backend.settings.breaker_threshold == 3
    assert backend.pool("kv").tier.settings.breaker_threshold == 3


def test_a_bad_variable_fails_naming_the_backend_key_and_the_variable() -> None:
    with pytest.raises(ConfigError) as err:
        BackendSettings.parse({}, env={"HICACHE_STORAGE_TIER_BREAKER_THRESHOLD": "many"})
    message = str(err.value)
    assert "'breaker_threshold'" in message
    assert "env HICACHE_STORAGE_TIER_BREAKER_THRESHOLD" in message


def test_a_value_hicache_config_refuses_names_the_extra_config_as_its_source(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import hicache.bootstrap.hicache_config as hc

    # The broken case: HiCacheConfig's own check refuses a value the backend's parse accepts.
    real = hc.HiCacheConfig.with_values

    def refuse(self: Any, data: Any, source: str = "mapping") -> Any:
        if data.get("storage.tier.max_concurrency") == 64:
            raise ConfigError(f"storage.tier.max_concurrency = 64 (from {source}): too many")
        return real(self, data, source)

    monkeypatch.setattr(hc.HiCacheConfig, "with_values", refuse)
    with pytest.raises(ConfigError, match=r"'max_concurrency'.*hicache_storage_backend_extra"):
        BackendSettings.parse({"max_concurrency": 64}, env={})


def test_every_tier_key_is_a_hicache_configuration_key() -> None:
    from hicache.bootstrap.config_keys import BY_NAME

    assert set(TIER_KEYS.values()) <= set(BY_NAME)
