"""Pages stored by N ranks and read by M ranks over a real Mooncake Store (a mooncake_master and
a storage node on 127.0.0.1): the worker's host pages and its TpReader's staging buffer are
registered with the store (Mooncake moves bytes only to and from registered memory), and each
reader rank gets exactly its heads, byte for byte, through both the byte-run and staging paths.

Skipped (with the reason) where the Mooncake wheel cannot be imported, unless
HICACHE_REQUIRE_MOONCAKE=1: then a missing wheel fails the run.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from hicache.integrations.vllm.plan import store_key
from hicache.integrations.vllm.settings import ConnectorSettings
from tests.storage.mooncake_support import require_mooncake

require_mooncake()

from hicache.adapters.storage.mooncake import MooncakeStore  # noqa: E402
from hicache.adapters.storage.mooncake_config import load_mooncake_config  # noqa: E402
from hicache.adapters.storage.mooncake_local import LocalMooncake, local_mooncake  # noqa: E402
from tests.integrations.vllm.tp_reads_support import DST, PAGES, full, key, read, write  # noqa: E402

pytestmark = [pytest.mark.mooncake, pytest.mark.timeout(120)]


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalMooncake]:
    with local_mooncake(segment_bytes=64 << 20) as c:
        yield c


@pytest.fixture
def store(cluster: LocalMooncake) -> Iterator[MooncakeStore]:
    s = MooncakeStore.open(load_mooncake_config(cluster.extra_config()), provide_host_memory=False)
    try:
        yield s
    finally:
        s.close()


# heads 8 (the brief's cases), and the two-head model read both ways, and a page from a whole
# object and part of another (6 heads, 2 -> 3)
CASES = [(8, 2, 1), (8, 1, 2), (8, 4, 2), (8, 2, 4), (2, 2, 1), (2, 1, 2), (6, 2, 3)]


@pytest.mark.parametrize(("total", "writers", "readers"), CASES)
def test_mooncake_reader_ranks_assemble_exactly_their_heads_from_the_writer_objects(
    store: MooncakeStore, total: int, writers: int, readers: int
) -> None:
    ns = f"h{total}"  # one namespace per model, as the connector keys them
    everything = full(total)
    write(store, everything, total, writers, ns)
    for q in range(readers):
        caches, expected, reads, errors = read(store, everything, total, writers, readers, q, ns)
        assert [e.ok for e in reads] == [True] * PAGES
        assert errors == set()
        for name, want in expected.items():
            assert torch.equal(caches[name][list(DST)], want[:PAGES])
            assert not caches[name][:3].any()  # nothing else written


def test_mooncake_page_with_one_writer_object_missing_is_recomputed(store: MooncakeStore) -> None:
    everything = full(8)
    write(store, everything, 8, 2, "missing")
    assert store.remove([store_key("missing", 1, key(0), 2)])[0].ok  # rank 1's object of page 0
    caches, expected, reads, errors = read(store, everything, 8, 2, 1, 0, "missing")
    assert {e.key: e.ok for e in reads} == {key(0): False, key(1): True, key(2): True}
    assert errors == set(DST)  # a hit is a leading run: all three blocks recomputed
    for name in expected:  # no page after the hole (nor a half-read one) reached the caches
        assert not caches[name].any()


def test_mooncake_same_size_pages_round_trip_through_registered_host_memory(
    store: MooncakeStore,
) -> None:
    everything = full(2)
    write(store, everything, 2, 2, "same")
    for q in range(2):
        caches, expected, reads, errors = read(store, everything, 2, 2, 2, q, "same")
        assert [e.ok for e in reads] == [True] * PAGES
        assert errors == set()
        for name, want in expected.items():
            assert torch.equal(caches[name][list(DST)], want[:PAGES])


def test_both_connector_roles_open_a_mooncake_store_in_one_process(cluster: LocalMooncake) -> None:
    # vLLM at tp 1 runs the scheduler and the worker in one process, each opening the store;
    # with the connector's settings neither serves store:mooncake host memory, so both open
    settings = ConnectorSettings.from_extra_config(
        {"storage_backend": "mooncake", "storage_extra_config": cluster.extra_config()}, env={}
    )
    scheduler_store = settings.open_store()
    assert scheduler_store is not None
    try:
        worker_store = settings.open_store()
        assert worker_store is not None
        try:
            everything = full(2)
            write(worker_store, everything, 2, 2, "roles")
            assert all(scheduler_store.exists([store_key("roles", r, key(0), 2) for r in (0, 1)]))
            caches, expected, reads, _ = read(worker_store, everything, 2, 2, 1, 0, "roles")
            assert [e.ok for e in reads] == [True] * PAGES
            for name, want in expected.items():
                assert torch.equal(caches[name][list(DST)], want[:PAGES])
        finally:
            worker_store.close()
    finally:
        scheduler_store.close()
