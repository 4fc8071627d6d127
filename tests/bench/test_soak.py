"""The soak (hicache.bench.soak): random operations with faults over every stack leave no
leaked slot, no leaked pin and no corrupt page; and each of its checks can fail."""

from __future__ import annotations

import pytest

from hicache.bench.soak import STACKS, SoakSettings, soak
from hicache.bootstrap.faults import Faults, FaultyTransfer, StoreFaultRates
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
        "ops", "faults", "leaked_slots", "leaked_pins", "corrupt_pages", "seconds"
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
