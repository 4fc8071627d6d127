"""vLLM's newer scheduler-side hooks and cases around them: the hit split by tier
(get_external_cache_hit_sources), reset_cache, preemption with a load in flight, and the
refusal of pipeline parallelism."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from tests.integrations.vllm.vllm_support import require_vllm

require_vllm()

from vllm.v1.metrics.cache_hit_source import CacheHitSource  # noqa: E402

from hicache.domain import ConfigError  # noqa: E402
from hicache.domain.keys import chain_keys  # noqa: E402
from hicache.domain.storage import StoreKey  # noqa: E402
from hicache.engine.bounded import BoundedStorage  # noqa: E402
from hicache.integrations.vllm.layout import Layout, Shape  # noqa: E402
from hicache.integrations.vllm.plan import Event, Op  # noqa: E402
from hicache.integrations.vllm.scheduler import SchedulerSide  # noqa: E402
from hicache.integrations.vllm.scheduler_role import SchedulerConnector  # noqa: E402
from hicache.integrations.vllm.settings import ConnectorSettings  # noqa: E402
from hicache.integrations.vllm.stats import ConnectorStats  # noqa: E402
from tests.integrations.vllm.side_helpers import (  # noqa: E402
    BS,
    PROMPT,
    Exists,
    prefill,
    side,
    store_keys,
)

pytestmark = pytest.mark.vllm


def in_store(store: Exists, keys: list[bytes]) -> None:
    for key in keys:
        store.held.add(str(StoreKey(namespace="t", pool="kv-r0", page_hash=key.hex())))


def mixed_hit(s: SchedulerSide, store: Exists) -> None:
    """PROMPT's blocks 0-1 on host, blocks 2-3 only in the store."""
    saved = prefill(s, "w", PROMPT[:8], [0, 1])
    s.on_events(saved + [Event(Op.STORE, e.key, True) for e in saved])  # host and store
    s.finished("w")
    in_store(store, chain_keys(PROMPT, BS)[2:4])


def test_the_hit_splits_into_host_and_storage_tokens_that_sum_to_vllms_count() -> None:
    store = Exists()
    s = side(store=store)
    mixed_hit(s, store)
    assert s.match("a", PROMPT, 0) == (16, True)
    s.after_alloc("a", [5, 6, 7, 8, 9], 16)
    assert s.hit_sources("a", 16) == (8, 8)
    assert s.hit_sources("a", 16) == (0, 16)  # asked once: a later count has no plan
    # vLLM's own hit covers block 0: the rest of the host run and the store run
    s = side(store=store)
    mixed_hit(s, store)
    assert s.match("b", PROMPT, 4) == (12, True)
    s.after_alloc("b", [5, 6, 7, 8, 9], 12)
    assert s.hit_sources("b", 12) == (4, 8)


def test_a_hit_vllm_never_asked_about_is_forgotten_when_the_request_finishes() -> None:
    store = Exists()
    s = side(store=store)
    mixed_hit(s, store)
    s.match("a", PROMPT, 0)
    s.after_alloc("a", [5, 6, 7, 8, 9], 16)
    s.finished("a")
    assert s.hit_sources("a", 16) == (0, 16)


def connector(backend: str | None, *, store: Exists | None = None) -> SchedulerConnector:
    shape = Shape(
        layout=Layout(0, (("l0", 64),)),
        block_size=BS,
        host_slots=16,
        state_slots=0,
        state_host_bytes=0,
        ranks=1,
        namespace="t",
    )
    extra: dict[str, object] = {"host_gib": 0.01}
    if backend == "directory":
        extra.update(storage_backend="directory", storage_path="/nonexistent-hicache-test")
    settings = ConnectorSettings.from_extra_config(extra, env={})
    return SchedulerConnector(
        shape,
        settings,
        store=BoundedStorage(store) if store is not None else None,  # type: ignore[arg-type]
        store_keys=store_keys(1),
        stats=ConnectorStats(),
    )


def test_vllm_sees_host_and_directory_store_tokens_apart() -> None:
    store = Exists()
    c = connector("directory", store=store)
    mixed_hit(c.side, store)
    request = SimpleNamespace(request_id="a")
    assert c.side.match("a", PROMPT, 0) == (16, True)
    c.side.after_alloc("a", [5, 6, 7, 8, 9], 16)
    got = c.get_external_cache_hit_sources(request, 16)  # type: ignore[arg-type]
    assert got == {CacheHitSource.HOST: 8, CacheHitSource.DISK: 8}


def test_a_host_only_hit_reports_only_the_host_source() -> None:
    c = connector(None)
    c.side.on_events(prefill(c.side, "w", PROMPT[:12], [0, 1, 2]))
    assert c.side.match("a", PROMPT, 0) == (12, False)
    c.side.after_alloc("a", [5, 6, 7, 8, 9], 12)
    got = c.get_external_cache_hit_sources(SimpleNamespace(request_id="a"), 12)  # type: ignore[arg-type]
    assert got == {CacheHitSource.HOST: 12}


def test_reset_cache_forgets_unpinned_host_pages_and_keeps_those_a_load_uses() -> None:
    c = connector(None)
    s = c.side
    s.on_events(prefill(s, "w", PROMPT[:12], [0, 1, 2]))
    assert s.match("a", PROMPT, 4) == (8, False)  # blocks 1-2 from host, 0 is vLLM's
    s.after_alloc("a", [5, 6, 7, 8, 9], 8)
    (op,) = s.build([], lambda _r: []).loads
    assert c.reset_cache() is True
    assert s.match("b", PROMPT, 0) == (0, False)  # block 0's page is gone
    assert all(s.index.known(k) for k in op.keys)  # the loading pages stay
    s.on_events([Event(Op.LOAD, k, True) for k in op.keys])
    assert c.reset_cache() is True
    assert len(s.index) == 0
    assert s.index.free_slots == s.index.slots


def test_a_preempted_request_rematched_while_its_load_is_in_flight_leaks_no_pin() -> None:
    """vLLM preempts without telling the connector (scheduler.py _preempt_request) and, with
    async scheduling, may do so before the previous step's load reports arrive; the request is
    matched and allocated again. Every pin both plans took comes back with their reports."""
    store = Exists()
    s = side(store=store)
    mixed_hit(s, store)
    s.match("a", PROMPT, 0)
    s.after_alloc("a", [5, 6, 7, 8, 9], 16)
    (first,) = s.build([], lambda _r: []).async_loads
    keys = chain_keys(PROMPT, BS)
    assert [s.index.pin_count(k) for k in keys[:4]] == [1, 1, 1, 1]
    # preempted and back: the store pages are still being read, so only the host run hits
    assert s.match("a", PROMPT, 0) == (8, False)
    s.after_alloc("a", [10, 11, 12, 13, 14], 8)
    assert s.hit_sources("a", 8) == (8, 0)
    (second,) = s.build([], lambda _r: []).loads
    assert [s.index.pin_count(k) for k in keys[:4]] == [2, 2, 1, 1]
    s.on_events([Event(Op.READ, k, True) for k in first.keys if k in keys[2:4]])
    s.on_events([Event(Op.LOAD, k, True) for k in first.keys])
    s.on_events([Event(Op.LOAD, k, True) for k in second.keys])
    assert [s.index.pin_count(k) for k in keys[:4]] == [0, 0, 0, 0]
    assert s.match("b", PROMPT, 0) == (16, False)  # the store pages arrived on host
    s.finished("a")
    s.finished("b")
    assert s.index.clear_unpinned() == 4
    assert s.index.free_slots == s.index.slots


def test_a_request_aborted_while_its_load_is_in_flight_gets_its_pins_back_from_the_reports() -> (
    None
):
    store = Exists()
    s = side(store=store)
    mixed_hit(s, store)
    s.match("a", PROMPT, 0)
    s.after_alloc("a", [5, 6, 7, 8, 9], 16)
    (op,) = s.build([], lambda _r: []).async_loads
    s.finished("a")  # vLLM's request_finished: aborted while waiting for the load
    s.on_events(
        [Event(Op.READ, k, False) for k, st in zip(op.keys, op.from_storage, strict=True) if st]
    )
    s.on_events([Event(Op.LOAD, k, False) for k in op.keys])
    assert all(s.index.pin_count(k) == 0 for k in op.keys)
    assert s.index.clear_unpinned() == 2  # the host pages; the failed reads are gone
    assert s.index.free_slots == s.index.slots


def vllm_config(pp: int) -> SimpleNamespace:
    return SimpleNamespace(
        parallel_config=SimpleNamespace(pipeline_parallel_size=pp, tensor_parallel_size=1),
        cache_config=SimpleNamespace(block_size=16, mamba_cache_mode="none"),
        model_config=SimpleNamespace(model="m", dtype="bfloat16"),
    )


def test_pipeline_parallelism_is_refused_naming_the_setting() -> None:
    settings = ConnectorSettings.from_extra_config({"host_gib": 0.01}, env={})
    with pytest.raises(ConfigError, match="pipeline_parallel_size = 2"):
        Shape.of(vllm_config(2), None, settings)  # type: ignore[arg-type]
