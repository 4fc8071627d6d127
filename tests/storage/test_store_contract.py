"""The Store port's contract, checked on every implementation here (DirectoryStore, FakeStore)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from hicache.adapters.storage import DirectorySettings, DirectoryStore
from hicache.domain import ConfigError
from hicache.domain.storage import Store, StoreStatus
from tests.storage.conftest import empty, joined, key, page
from tests.storage.fakes import FakeStore

OK, MISS, INVALID = StoreStatus.OK, StoreStatus.MISS, StoreStatus.INVALID


@pytest.fixture(params=["directory", "fake"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Store]:
    s: Store
    if request.param == "directory":
        s = DirectoryStore(DirectorySettings(root=tmp_path / "store"))
    else:
        s = FakeStore()
    yield s
    s.close()


def test_implementations_satisfy_the_port(store: Store) -> None:
    assert isinstance(store, Store)


def test_a_put_page_comes_back_byte_exact(store: Store) -> None:
    src = [page(1000, 1), page(4096 * 3 + 7, 2)]
    assert store.put([key(1), key(2)], src) == [OK, OK]
    dst = [empty(1000), empty(4096 * 3 + 7)]
    assert store.get([key(1), key(2)], dst) == [OK, OK]
    assert [joined(b) for b in dst] == [joined(b) for b in src]


def test_an_unknown_key_is_a_miss_and_exists_says_false(store: Store) -> None:
    assert store.get([key(9)], [empty(8)]) == [MISS]
    assert store.exists([key(9)]) == [False]


def test_exists_reports_each_key(store: Store) -> None:
    store.put([key(1)], [page(64)])
    assert store.exists([key(1), key(2)]) == [True, False]


def test_a_buffer_of_another_size_is_invalid_and_left_untouched(store: Store) -> None:
    store.put([key(1)], [page(64)])
    dst = empty(32)
    assert store.get([key(1)], [dst]) == [INVALID]
    assert joined(dst) == bytes(32)


def test_remove_forgets_and_is_ok_for_absent_keys(store: Store) -> None:
    store.put([key(1)], [page(64)])
    assert store.remove([key(1), key(2)]) == [OK, OK]
    assert store.get([key(1)], [empty(64)]) == [MISS]


def test_a_passed_deadline_answers_transient_without_raising(store: Store) -> None:
    past = time.monotonic() - 1
    assert (
        store.put([key(1), key(2)], [page(8), page(8)], deadline=past)
        == [StoreStatus.TRANSIENT] * 2
    )
    store.put([key(1)], [page(8)])
    assert store.get([key(1)], [empty(8)], deadline=past) == [StoreStatus.TRANSIENT]
    assert store.exists([key(1)], deadline=past) == [False]


def test_after_close_calls_answer_fatal_and_health_says_closed(store: Store) -> None:
    store.put([key(1)], [page(8)])
    assert store.health().healthy
    store.close()
    store.close()  # idempotent
    assert not store.health().healthy
    assert "closed" in store.health().detail
    assert store.get([key(1)], [empty(8)]) == [StoreStatus.FATAL]
    assert store.put([key(2)], [page(8)]) == [StoreStatus.FATAL]
    assert store.remove([key(1)]) == [StoreStatus.FATAL]
    assert store.exists([key(1)]) == [False]


def test_unpaired_keys_and_buffers_are_a_config_error(store: Store) -> None:
    with pytest.raises(ConfigError, match="2 keys paired with 1 buffers"):
        store.get([key(1), key(2)], [empty(8)])
