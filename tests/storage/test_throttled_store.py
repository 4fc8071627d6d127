"""ThrottledStore: a directory store whose reads are slowed to a set bandwidth."""

from __future__ import annotations

from pathlib import Path

import pytest

from hicache.adapters.storage import throttled
from hicache.adapters.storage.throttled import ThrottledStore
from hicache.bootstrap.storage import open_store
from hicache.domain import ConfigError, StorageSettings
from hicache.domain.storage import StoreKey


def key(i: int) -> StoreKey:
    return StoreKey(namespace="t", pool="kv", page_hash=f"{i:064x}")


def page(fill: int, n: int = 4096) -> list[memoryview]:
    return [memoryview(bytearray([fill]) * n)]


def test_reads_sleep_for_their_bytes_at_the_set_bandwidth(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    slept: list[float] = []
    monkeypatch.setattr(throttled.time, "perf_counter", lambda: 0.0)  # the read takes no time
    monkeypatch.setattr(throttled.time, "sleep", slept.append)
    store = open_store(
        StorageSettings(
            backend="dynamic",
            extra_config={
                "module_path": "hicache.adapters.storage.throttled",
                "class_name": "ThrottledStore",
                "root": str(tmp_path),
                "read_mib_s": 1,
            },
        )
    )
    try:
        assert store.name == "throttled-directory"
        assert all(s.ok for s in store.put([key(1), key(2)], [page(1), page(2)]))
        assert slept == []  # writes are not throttled
        out = [page(0), page(0), page(0)]
        got = store.get([key(1), key(2), key(3)], out)
        assert [s.ok for s in got] == [True, True, False]
        assert bytes(out[1][0]) == bytes([2]) * 4096
        assert slept == [pytest.approx(2 * 4096 / (1 << 20))]  # only the pages read count
    finally:
        store.close()


@pytest.mark.parametrize("rate", [None, 0, -1, float("nan"), True, "4"])
def test_read_bandwidth_must_be_a_positive_number(tmp_path: Path, rate: object) -> None:
    config = {"root": str(tmp_path)} | ({} if rate is None else {"read_mib_s": rate})
    with pytest.raises(ConfigError, match="'read_mib_s'"):
        ThrottledStore(config)
