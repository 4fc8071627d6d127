"""Spreader: a batch's jobs on the caller plus helper threads, results in order, errors raised on
the caller only once no helper is still inside a job; DirectoryStore batches spread that way."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from hicache.adapters.storage import DirectorySettings, DirectoryStore, object_name
from hicache.adapters.storage.format import HEADER_SPAN
from hicache.adapters.storage.spread import Spreader
from hicache.domain.storage import StoreStatus
from tests.storage.conftest import empty, joined, key, page


@pytest.mark.parametrize("threads", [1, 2, 4])
@pytest.mark.parametrize("n", [0, 1, 2, 7, 100])
def test_results_come_back_in_index_order(threads: int, n: int) -> None:
    spreader = Spreader(threads, name="t")
    try:
        assert spreader.run(n, lambda i: i * i) == [i * i for i in range(n)]
    finally:
        spreader.close()


def test_two_threads_run_two_jobs_at_once() -> None:
    # Each of the first two jobs waits for the other: one thread alone would time out.
    barrier = threading.Barrier(2, timeout=10)
    spreader = Spreader(2, name="t")
    try:
        threads = spreader.run(2, lambda i: (barrier.wait(), threading.get_ident())[1])
    finally:
        spreader.close()
    assert len(set(threads)) == 2


def test_one_thread_runs_every_job_on_the_caller() -> None:
    spreader = Spreader(1, name="t")
    assert set(spreader.run(5, lambda i: threading.get_ident())) == {threading.get_ident()}


def test_a_failed_job_is_raised_after_the_jobs_in_flight_have_finished() -> None:
    started = threading.Event()
    finished = threading.Event()

    def job(i: int) -> int:
        if i == 0:  # the caller's job: wait until a helper is inside job 1, then fail
            assert started.wait(10)
            raise ValueError("job 0 failed")
        started.set()
        time.sleep(0.2)
        finished.set()
        return i

    spreader = Spreader(2, name="t")
    try:
        with pytest.raises(ValueError, match="job 0 failed"):
            spreader.run(2, job)
        assert finished.is_set()  # run did not return while the helper was still filling
    finally:
        spreader.close()


def test_a_helpers_error_is_raised_on_the_caller_and_stops_the_batch() -> None:
    ran: list[int] = []
    gate = threading.Event()

    def job(i: int) -> int:
        if i == 0:
            assert gate.wait(10)  # the caller holds job 0 until the helper has failed
            return 0
        ran.append(i)
        gate.set()
        raise KeyError(f"job {i}")

    spreader = Spreader(2, name="t")
    try:
        with pytest.raises(KeyError, match="job 1"):
            spreader.run(50, job)
    finally:
        spreader.close()
    assert ran == [1]  # nothing was handed out after the failure


def test_an_interrupted_caller_hands_out_no_more_jobs_and_waits_for_the_helpers() -> None:
    in_helper = threading.Event()
    raising = threading.Event()
    caller = threading.get_ident()
    ran: list[int] = []
    finished = threading.Event()

    def job(i: int) -> int:
        ran.append(i)
        if threading.get_ident() == caller:
            assert in_helper.wait(10)
            raising.set()
            raise KeyboardInterrupt  # what Ctrl-C raises on the main thread
        in_helper.set()
        assert raising.wait(10)
        time.sleep(0.5)  # the caller's interruption reaches the batch meanwhile
        finished.set()
        return i

    spreader = Spreader(2, name="t")
    try:
        with pytest.raises(KeyboardInterrupt):
            spreader.run(40, job)
        assert finished.is_set()
    finally:
        spreader.close()
    assert sorted(ran) == [0, 1]  # one job each, then nothing more was taken


def test_after_close_the_caller_still_runs_every_job() -> None:
    spreader = Spreader(3, name="t")
    spreader.close()
    assert spreader.run(6, lambda i: i) == list(range(6))


# -- DirectoryStore over it ------------------------------------------------------------------------

OBJ = HEADER_SPAN + 4096


@pytest.mark.parametrize("threads", [1, 2, 4])
def test_a_batch_reads_back_what_it_wrote_with_any_number_of_threads(
    tmp_path: Path, threads: int
) -> None:
    settings = DirectorySettings(root=tmp_path, read_threads=threads, write_threads=threads)
    store = DirectoryStore(settings)
    keys = [key(i) for i in range(1, 21)]
    assert (
        store.put(keys, [page(4096 * (i % 3 + 1), i) for i in range(1, 21)])
        == [StoreStatus.OK] * 20
    )
    dst = [empty(4096 * (i % 3 + 1)) for i in range(1, 21)]
    assert store.get(keys, dst) == [StoreStatus.OK] * 20
    for i, d in enumerate(dst, start=1):
        assert joined(d) == joined(page(4096 * (i % 3 + 1), i))
    store.close()


def test_a_spread_batch_leaves_its_pages_most_recently_used_in_batch_order(
    tmp_path: Path,
) -> None:
    settings = DirectorySettings(
        root=tmp_path, read_threads=4, write_threads=4, capacity_bytes=4 * OBJ
    )
    store = DirectoryStore(settings)
    store.put([key(i) for i in range(1, 5)], [page(4096, i) for i in range(1, 5)])
    assert store.get([key(3), key(1)], [empty(4096), empty(4096)]) == [StoreStatus.OK] * 2
    # Least recently used first: 2, 4 (put in that order), then 3, 1 (got in that order).
    store.put([key(5), key(6), key(7)], [page(4096, i) for i in (5, 6, 7)])
    assert store.exists([key(i) for i in range(1, 8)]) == [
        True,
        False,
        False,
        False,
        True,
        True,
        True,
    ]
    store.close()


def test_closing_a_store_answers_fatal_for_a_batch_begun_later(tmp_path: Path) -> None:
    store = DirectoryStore(DirectorySettings(root=tmp_path, read_threads=2, write_threads=2))
    store.put([key(1)], [page(4096)])
    store.close()
    assert store.get([key(1), key(1)], [empty(4096), empty(4096)]) == [StoreStatus.FATAL] * 2


def test_a_damaged_page_in_a_spread_get_is_a_miss_and_the_others_read_whole(
    tmp_path: Path,
) -> None:
    size = 300_000  # several 256 KiB read chunks per page
    store = DirectoryStore(DirectorySettings(root=tmp_path, read_threads=3))
    keys = [key(i) for i in range(8)]
    assert store.put(keys, [page(size, i) for i in range(8)]) == [StoreStatus.OK] * 8
    damaged = tmp_path / object_name(keys[5])[:2] / f"{object_name(keys[5])}.obj"
    with open(damaged, "r+b") as f:  # one byte deep in the payload's second chunk
        f.seek(HEADER_SPAN + 270_001)
        byte = f.read(1)[0]
        f.seek(HEADER_SPAN + 270_001)
        f.write(bytes([byte ^ 0x40]))
    dst = [empty(size) for _ in range(8)]
    want = [StoreStatus.OK] * 8
    want[5] = StoreStatus.CORRUPT
    assert store.get(keys, dst) == want
    assert not damaged.exists()
    for i in (0, 1, 2, 3, 4, 6, 7):
        assert joined(dst[i]) == joined(page(size, i))
    store.close()
