"""Hostile kv_connector_extra_config values through the connector's settings parser (and the
class hook vLLM calls with it): settings or one HiCacheError with a short message, never another
exception (TypeError, OverflowError, RecursionError, ValueError from a repr ...).

- the whole extra config replaced by each hostile value (tests/fuzz_values.py HOSTILE): a list
  of pairs, text, a number, a generator ... is a ConfigError, never read as a mapping;
- every key with every hostile value, and inside storage_extra_config for each backend;
- hypothesis: mappings of real and unknown keys to hostile documents.
No vLLM needed: the parser is vLLM-free (hicache.integrations.vllm.settings).
"""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hicache.domain import ConfigError, HiCacheError
from hicache.integrations.vllm.settings import BACKENDS, KEYS, ConnectorSettings
from tests.fuzz_values import HOSTILE, HOSTILE_DOCUMENTS, assert_typed

pytestmark = pytest.mark.timeout(120)

ENV: dict[str, str] = {}  # neither $HICACHE_CONFIG nor HICACHE_* variables
LIMIT = 1000


def _parse(config: Any) -> object:
    result = assert_typed(lambda: ConnectorSettings.from_extra_config(config, env=ENV), LIMIT)
    assert isinstance(result, (ConnectorSettings, HiCacheError)), type(result)
    return result


@pytest.mark.parametrize("value", sorted(set(HOSTILE) - {"None", "mapping"}))
def test_an_extra_config_that_is_not_a_mapping_is_a_config_error(value: str) -> None:
    result = _parse(HOSTILE[value]())
    assert isinstance(result, ConfigError), result


def test_no_extra_config_or_an_empty_one_is_the_defaults() -> None:
    assert _parse(None) == _parse({}) == ConnectorSettings()


@pytest.mark.parametrize("key", KEYS)
@pytest.mark.parametrize("value", sorted(HOSTILE))
def test_any_hostile_value_of_any_key_is_settings_or_a_short_typed_error(
    key: str, value: str, tmp_path: Any
) -> None:
    config: dict[str, Any] = {key: HOSTILE[value]()}
    if key == "storage_extra_config":
        config["storage_backend"] = "dynamic"
    if key == "storage_path":
        config["storage_backend"] = "directory"
    _parse(config)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("value", sorted(HOSTILE))
def test_a_hostile_store_extra_config_is_settings_or_a_short_typed_error(
    backend: str, value: str, tmp_path: Any
) -> None:
    config: dict[str, Any] = {"storage_backend": backend, "storage_extra_config": HOSTILE[value]()}
    if backend == "directory":
        config["storage_path"] = str(tmp_path)
    _parse(config)
    inner = {"module_path": "x.y", "class_name": "Z"} if backend == "dynamic" else {}
    inner["some_key"] = HOSTILE[value]()
    _parse({**config, "storage_extra_config": inner})


FUZZ = settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


@FUZZ
@given(
    doc=st.dictionaries(
        st.one_of(st.sampled_from(KEYS), st.text(max_size=8), st.integers()),
        HOSTILE_DOCUMENTS,
        max_size=4,
    )
)
def test_any_mapping_is_settings_or_a_short_typed_error(doc: dict[Any, Any]) -> None:
    _parse(doc)


@pytest.mark.vllm
@pytest.mark.parametrize("value", sorted(HOSTILE))
def test_the_class_hook_vllm_calls_first_answers_or_raises_a_typed_error(value: str) -> None:
    from tests.integrations.vllm.vllm_support import require_vllm

    require_vllm()
    from hicache.integrations.vllm.connector import HiCacheConnector

    assert_typed(lambda: HiCacheConnector.requires_piecewise_for_cudagraph(HOSTILE[value]()))
    assert_typed(
        lambda: HiCacheConnector.requires_piecewise_for_cudagraph({"host_gib": HOSTILE[value]()})
    )


def test_an_unknown_key_of_any_length_is_named_short() -> None:
    result = _parse({"k" * 100_000: 1})
    assert isinstance(result, ConfigError)
    assert "is unknown to HiCacheConnector" in str(result)
