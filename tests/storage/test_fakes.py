"""FakeStore's injected faults behave as the tests that reuse it expect."""

from __future__ import annotations

import time

import pytest

from hicache.domain.storage import StoreStatus
from tests.storage.conftest import empty, key, page
from tests.storage.fakes import FakeStore

OK = StoreStatus.OK


@pytest.mark.parametrize(
    "status", [StoreStatus.TRANSIENT, StoreStatus.FULL, StoreStatus.FATAL, StoreStatus.INVALID]
)
def test_a_put_fault_answers_its_status_once_for_the_keys_named(status: StoreStatus) -> None:
    store = FakeStore()
    store.fail("put", status, keys=[key(2)])
    assert store.put([key(1), key(2), key(3)], [page(8)] * 3) == [OK, status, OK]
    assert store.put([key(2)], [page(8)]) == [OK]
    assert store.calls["put"] == 2


def test_a_get_fault_can_repeat() -> None:
    store = FakeStore()
    store.put([key(1)], [page(8)])
    store.fail("get", StoreStatus.TRANSIENT, times=2)
    got = [store.get([key(1)], [empty(8)])[0] for _ in range(3)]
    assert got == [StoreStatus.TRANSIENT, StoreStatus.TRANSIENT, OK]


def test_a_phantom_exists_but_get_misses() -> None:
    store = FakeStore()
    store.phantom(key(1))
    assert store.exists([key(1)]) == [True]
    assert store.get([key(1)], [empty(8)]) == [StoreStatus.MISS]


def test_a_slow_store_answers_transient_once_the_deadline_passes() -> None:
    store = FakeStore()
    store.put([key(i) for i in range(4)], [page(8)] * 4)
    store.slow(0.05)
    got = store.get([key(i) for i in range(4)], [empty(8)] * 4, deadline=time.monotonic() + 0.075)
    assert got[0] == OK
    assert got[-1] == StoreStatus.TRANSIENT


def test_raise_on_makes_one_call_raise() -> None:
    store = FakeStore()
    store.raise_on("get", RuntimeError("plug-in bug"))
    with pytest.raises(RuntimeError, match="plug-in bug"):
        store.get([key(1)], [empty(8)])
    assert store.get([key(1)], [empty(8)]) == [StoreStatus.MISS]


def test_a_capacity_makes_puts_full() -> None:
    store = FakeStore(capacity_bytes=16)
    assert store.put([key(1), key(2), key(3)], [page(8)] * 3) == [OK, OK, StoreStatus.FULL]


def test_fail_after_answers_its_status_for_the_keys_after_the_first_n_of_every_get() -> None:
    store = FakeStore()
    store.put([key(i) for i in range(4)], [page(8)] * 4)
    store.fail_after(2)
    for _ in range(2):
        got = store.get([key(i) for i in range(4)], [empty(8) for _ in range(4)])
        assert got == [OK, OK, StoreStatus.TRANSIENT, StoreStatus.TRANSIENT]
    store.fail_after(None)
    assert store.get([key(3)], [empty(8)]) == [OK]


def test_damage_changes_only_the_pages_read_ok() -> None:
    store = FakeStore()
    store.put([key(1)], [page(8)])
    damaged: list[object] = []

    def zero(k: object, buffer: list[memoryview]) -> None:
        damaged.append(k)
        for seg in buffer:
            seg[:] = bytes(len(seg))

    store.damage(zero)  # type: ignore[arg-type]
    out = [empty(8), empty(8)]
    assert store.get([key(1), key(2)], out) == [OK, StoreStatus.MISS]
    assert damaged == [key(1)]
    assert bytes(out[0][0]) == bytes(8) != bytes(page(8)[0])


def test_a_hung_call_waits_past_its_deadline_until_released() -> None:
    import threading

    store = FakeStore()
    store.put([key(1)], [page(8)])
    store.hang.set()
    out: list[object] = []
    t = threading.Thread(
        target=lambda: out.append(store.get([key(1)], [empty(8)], deadline=time.monotonic()))
    )
    t.start()
    assert store.entered.wait(5)
    time.sleep(0.05)
    assert not out  # still waiting, deadline or not
    store.release.set()
    t.join(5)
    assert out == [[OK]]  # a late store still writes its bytes
