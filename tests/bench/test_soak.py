"""The soak's paths: random operations with faults leave no leak, no corrupt page and no error,
and each of their checks can fail (a test of each builds the broken case with a sabotage).

- The cache face (hicache.bench.soak) over every stack: slots, pins, bytes restored.
- The vLLM connector under vLLM's real scheduler (hicache.integrations.vllm.soak): blocks,
  host pins, pending transfers; every block vLLM counts as computed holds its bytes.
- The SGLang backend (hicache.integrations.sglang.soak): every page read holds its bytes; no
  store call left running."""

from __future__ import annotations

from typing import Any

import pytest

from hicache.bench.soak import STACKS, SoakSettings, soak
from hicache.bootstrap.faults import Faults, FaultyTransfer, PathReport, StoreFaultRates
from hicache.domain import ConfigError


@pytest.mark.asyncio
@pytest.mark.parametrize(("seed", "concurrency"), [(1, 4), (2, 4), (1, 1)])
async def test_a_short_soak_over_every_stack_leaks_nothing_and_restores_every_byte(
    seed: int, concurrency: int
) -> None:
    # Concurrency 4 (the default) lets requests race in the face: no error may come of it.
    assert SoakSettings().concurrency == 4
    report = await soak(SoakSettings(ops=500, seed=seed, concurrency=concurrency))
    assert (report.leaked_slots, report.leaked_pins, report.corrupt_pages) == (0, 0, 0)
    assert report.errors == 0, report.error_samples
    assert report.faults > 0
    assert report.checked_pages > 0
    kinds = report.fault_kinds
    assert any(k.startswith("copy_") for k in kinds)
    assert any(k.startswith("store_") for k in kinds)
    assert set(report.operations) >= {"insert", "load", "prefetch", "cancel_load"}
    assert set(report.as_json()) >= {
        "ops",
        "faults",
        "leaked_slots",
        "leaked_pins",
        "corrupt_pages",
        "seconds",
    }
    assert set(SoakSettings().stacks) == set(STACKS)


@pytest.mark.asyncio
async def test_a_load_that_reads_the_wrong_host_page_is_reported_as_corrupt() -> None:
    settings = SoakSettings(
        ops=300, seed=3, stacks=("dense",), copy_fail_rate=0.0, sabotage=frozenset({"misroute"})
    )
    report = await soak(settings)
    assert report.fault_kinds.get("copy_misroute", 0) > 0
    assert report.corrupt_pages > 0


@pytest.mark.asyncio
async def test_slots_and_pins_held_back_are_reported_as_leaks() -> None:
    leak = SoakSettings(
        ops=100, seed=4, stacks=("dense", "state"), sabotage=frozenset({"leak_slots", "leak_pins"})
    )
    report = await soak(leak)
    assert report.leaked_slots == 2  # one device page per stack, held by nobody the index knows
    assert report.leaked_pins == 2  # one pin per stack that nobody releases


def test_fail_first_fails_the_first_call_of_each_store_operation_and_no_other(
    tmp_path: Any,
) -> None:
    from hicache.adapters.storage import DirectorySettings, DirectoryStore
    from hicache.bootstrap.faults import FaultyStore
    from hicache.domain.storage import StoreKey, StoreStatus

    inner = DirectoryStore(DirectorySettings(root=str(tmp_path)))
    faults = Faults(0)
    store = FaultyStore(inner, faults, StoreFaultRates(fail_first=True))
    key = StoreKey("ns", "kv", "ab" * 32)
    page = [memoryview(bytearray(b"x" * 64))]
    assert store.put([key], [page]) == [StoreStatus.TRANSIENT]
    assert store.put([key], [page]) == [StoreStatus.OK]
    assert store.exists([key]) == [False]  # the first exists fails: answered as absent
    assert store.exists([key]) == [True]
    out = [memoryview(bytearray(64))]
    assert store.get([key], [out]) == [StoreStatus.TRANSIENT]
    assert store.get([key], [out]) == [StoreStatus.OK]
    assert bytes(out[0]) == b"x" * 64
    assert dict(faults.counts) == {
        "store_put_first": 1,
        "store_exists_first": 1,
        "store_get_first": 1,
    }
    assert dict(faults.calls) == {"store_put": 2, "store_exists": 2, "store_get": 2}
    plain = FaultyStore(inner, Faults(0), StoreFaultRates())
    assert plain.get([key], [out]) == [StoreStatus.OK]  # off by default


def test_bad_soak_settings_are_config_errors() -> None:
    with pytest.raises(ConfigError, match="stacks"):
        SoakSettings(stacks=("nope",))
    with pytest.raises(ConfigError, match="write policy 'sometimes'"):
        SoakSettings(host_writes=("sometimes",))
    with pytest.raises(ConfigError, match="sabotage"):
        SoakSettings(sabotage=frozenset({"explode"}))
    with pytest.raises(ConfigError, match="fail_rate"):
        FaultyTransfer(object(), Faults(0), fail_rate=2.0)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="transient"):
        StoreFaultRates(transient=-0.1)


# ---- the engine paths (hicache.integrations.vllm.soak, hicache.integrations.sglang.soak) ----


def _vllm() -> Any:
    from tests.integrations.vllm.vllm_support import PROBLEM

    if PROBLEM is not None:
        pytest.skip(PROBLEM)
    from hicache.integrations.vllm import soak as vllm_soak

    return vllm_soak


def _sglang() -> Any:
    from tests.integrations.sglang.support import PROBLEM

    if PROBLEM is not None:
        pytest.skip(PROBLEM)
    from hicache.integrations.sglang import soak as sglang_soak

    return sglang_soak


def _clean(report: PathReport) -> None:
    assert (report.errors, report.leaks, report.corrupt_pages) == (0, 0, 0), (
        report.error_samples,
        report.details,
    )
    assert report.checked_pages > 0
    assert report.faults > 0


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.parametrize("seed", [0, 1])
def test_a_short_vllm_soak_leaks_nothing_and_every_loaded_block_holds_its_bytes(
    seed: int,
) -> None:
    report = _vllm().soak_vllm(400, seed)
    _clean(report)
    assert report.details["loaded_pages"] > 0  # the connector really loaded blocks
    assert set(report.operations) >= {"add", "step", "abort", "reset_cache", "preempt_all"}
    assert report.details["store_calls"].get("store_get", 0) > 0  # it read from the store
    assert any(k.startswith("store_get") for k in report.fault_kinds)


@pytest.mark.slow
@pytest.mark.vllm
def test_vllm_soak_blocks_damaged_after_the_read_are_reported_as_corrupt() -> None:
    report = _vllm().soak_vllm(300, 1, frozenset({"damage"}))
    assert report.fault_kinds.get("store_damage_read", 0) > 0
    assert report.corrupt_pages > 0


@pytest.mark.slow
@pytest.mark.vllm
def test_vllm_soak_a_host_pin_never_released_is_reported_as_a_leak() -> None:
    report = _vllm().soak_vllm(200, 2, frozenset({"leak_pins"}))
    assert report.leaks == 1
    assert report.details["leaks"]["host_pins"] == 1


@pytest.mark.sglang
@pytest.mark.parametrize("seed", [0, 1])
def test_a_short_sglang_soak_leaks_nothing_and_every_page_read_holds_its_bytes(
    seed: int,
) -> None:
    report = _sglang().soak_sglang(500, seed)
    _clean(report)
    assert set(report.operations) >= {"set", "get", "exists", "legacy_set", "legacy_get"}
    assert report.fault_kinds.get("store_corrupt", 0) > 0


@pytest.mark.sglang
def test_sglang_soak_pages_damaged_after_the_read_are_reported_as_corrupt() -> None:
    report = _sglang().soak_sglang(200, 3, frozenset({"damage"}))
    assert report.corrupt_pages > 0


@pytest.mark.sglang
def test_sglang_soak_a_store_call_left_running_is_reported_as_a_leak() -> None:
    report = _sglang().soak_sglang(100, 4, frozenset({"hang"}))
    assert report.details["leaks"]["stuck_calls"] == 1
    assert report.leaks == 1


@pytest.mark.vllm
@pytest.mark.sglang
def test_bad_engine_soak_sabotage_is_a_config_error() -> None:
    for module, call in ((_vllm, "soak_vllm"), (_sglang, "soak_sglang")):
        with pytest.raises(ConfigError, match="sabotage"):
            getattr(module(), call)(10, 0, frozenset({"explode"}))
