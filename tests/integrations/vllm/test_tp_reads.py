"""Pages stored by N ranks and read by M ranks, below vLLM: the worker assembles each rank's
blocks byte for byte from the writer objects that hold its heads (hicache.integrations.vllm.
tp_reads, through WorkerTransfers and a DirectoryStore), and the scheduler side finds which
size stored each page (tp_sources.WriterProbe)."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch

from hicache.adapters.storage import DirectoryStore
from hicache.adapters.storage.directory_settings import DirectorySettings
from hicache.domain import ConfigError
from hicache.domain.keys import chain_keys
from hicache.domain.storage import StoreKey
from hicache.engine.bounded import BoundedSettings, BoundedStorage
from hicache.integrations.vllm.plan import LoadOp, Op, StepPlan, store_key, store_tier
from hicache.integrations.vllm.scheduler import SchedulerSide
from hicache.integrations.vllm.stats import ConnectorStats
from hicache.integrations.vllm.tp_plan import TpHeads, writer_tag
from hicache.integrations.vllm.tp_reads import LayerHeads, head_geometry
from hicache.integrations.vllm.tp_sources import MAX_SWITCHES, WriterProbe, reader_keys
from hicache.integrations.vllm.worker_host import address
from tests.integrations.vllm.side_helpers import BS, Exists
from tests.integrations.vllm.tp_reads_support import (
    BLOCKS,
    CONTENT,
    DST,
    LAYERS,
    PAGES,
    TOKENS,
    close,
    full,
    key,
    rank_caches,
    read,
    transfers,
    write,
)

CASES = [
    (2, 2, 1),
    (2, 1, 2),
    (4, 4, 2),
    (4, 2, 4),
    (4, 1, 4),
    (2, 4, 1),
    (2, 1, 4),
    (2, 4, 2),
    (6, 3, 2),
    (6, 2, 3),  # a reader block from a whole object and part of another
]


@pytest.mark.parametrize(("total", "writers", "readers"), CASES)
def test_each_reader_rank_assembles_exactly_its_heads_from_the_writer_objects(
    tmp_path: Path, total: int, writers: int, readers: int
) -> None:
    store = DirectoryStore(DirectorySettings(root=tmp_path))
    everything = full(total)
    write(store, everything, total, writers)
    for q in range(readers):
        caches, expected, reads, errors = read(store, everything, total, writers, readers, q)
        assert len(reads) == PAGES
        assert all(e.ok for e in reads)
        assert errors == set()
        for name, want in expected.items():
            assert torch.equal(caches[name][list(DST)], want[:PAGES])
            assert not caches[name][:3].any()  # nothing else written
    store.close()


def test_a_cache_that_cannot_be_sliced_recomputes_pages_that_need_slices(
    tmp_path: Path,
) -> None:
    store = DirectoryStore(DirectorySettings(root=tmp_path))
    everything = full(2)
    write(store, everything, 2, 2)
    caches = {n: torch.zeros_like(t) for n, t in rank_caches(everything, 2, 1, 0).items()}
    w = transfers(caches, store, TpHeads(2), 1, 0, slicing=False)
    w.start_step(StepPlan(async_loads=[LoadOp("r", (key(0),), (0,), (3,), (True,), writers=(2,))]))
    w.finish_step()
    w.wait_idle()
    (read,) = [e for e in w.drain_events() if e.op is Op.READ]
    assert not read.ok
    assert w.drain_errors() == {3}  # vLLM recomputes the block
    assert not any(t.any() for t in caches.values())
    close(w, store)
    store.close()


def test_a_page_with_one_object_missing_fails_whole(tmp_path: Path) -> None:
    store = DirectoryStore(DirectorySettings(root=tmp_path))
    everything = full(2)
    write(store, everything, 2, 2)
    store.remove([store_key("ns", 1, key(0), 2)])
    caches = {n: torch.zeros_like(t) for n, t in rank_caches(everything, 2, 1, 0).items()}
    w = transfers(caches, store, TpHeads(2), 1, 0)
    keys = (key(0), key(1))
    w.start_step(
        StepPlan(async_loads=[LoadOp("r", keys, (0, 1), (3, 4), (True, True), writers=(2, 2))])
    )
    w.finish_step()
    w.wait_idle()
    reads = {e.key: e.ok for e in w.drain_events() if e.op is Op.READ}
    assert reads == {key(0): False, key(1): True}
    assert w.drain_errors() == {3, 4}  # a hit is a leading run: both recomputed
    close(w, store)
    store.close()


def test_head_geometry_follows_the_caches_physical_order() -> None:
    cpu = torch.zeros(BLOCKS, 2, TOKENS, CONTENT, dtype=torch.bfloat16)
    assert head_geometry("l", cpu, BLOCKS, 2) == LayerHeads("l", 1, TOKENS * CONTENT * 2)
    token_major = torch.zeros(BLOCKS, TOKENS, 2, CONTENT, dtype=torch.bfloat16).transpose(1, 2)
    assert head_geometry("l", token_major, BLOCKS, 2) == LayerHeads("l", TOKENS, CONTENT * 2)
    with pytest.raises(ConfigError, match="expected \\[6 blocks, 2 KV heads"):
        head_geometry("l", torch.zeros(BLOCKS, 2, TOKENS, 2, CONTENT), BLOCKS, 2)
    with pytest.raises(ConfigError, match="not one dense run"):
        head_geometry("l", torch.zeros(BLOCKS, 2, TOKENS, 2 * CONTENT)[..., :CONTENT], BLOCKS, 2)


# ---- the scheduler side -------------------------------------------------------------------

PROMPT = list(range(1, 18))  # 4 full blocks and 1 token


def _side(store: Exists, ranks: int, heads: TpHeads | None) -> SchedulerSide:
    return SchedulerSide(
        block_size=BS,
        host_slots=16,
        store=BoundedStorage(store),  # type: ignore[arg-type]
        store_keys=reader_keys("ns", ranks, heads),
        write_storage=True,
        save_decode=False,
        ranks=ranks,
        stats=ConnectorStats(),
        heads=heads,
    )


def _hold(store: Exists, writers: int, pages: list[bytes]) -> None:
    for page in pages:
        for r in range(writers):
            store.held.add(str(store_key("ns", r, page, writers)))


def test_a_reader_finds_pages_another_size_stored_and_plans_them_from_it() -> None:
    store = Exists()
    keys = chain_keys(PROMPT, BS)
    _hold(store, 2, keys[:2])  # stored at tp 2
    _hold(store, 1, keys[2:3])  # the next page at tp 1 (the reader's own size)
    s = _side(store, 1, TpHeads(2))
    assert s.match("a", PROMPT, 0) == (12, True)
    s.after_alloc("a", [5, 6, 7, 8, 9], 12)
    (op,) = s.build([], lambda _r: []).async_loads
    assert op.keys == tuple(keys[:3])
    assert op.writers == (2, 2, 1)


def test_a_reader_without_the_heads_of_a_page_does_not_hit_it() -> None:
    store = Exists()
    keys = chain_keys(PROMPT, BS)
    store.held.add(str(store_key("ns", 0, keys[0], 2)))  # rank 1 of 2 never stored it
    assert _side(store, 1, TpHeads(2)).match("a", PROMPT, 0) == (0, False)


def test_replicated_writers_need_one_replica_of_each_head() -> None:
    store = Exists()
    keys = chain_keys(PROMPT, BS)
    for page in keys[:1]:  # tp 4 over 2 heads: ranks 0 and 2 are one replica of each
        for r in (0, 2):
            store.held.add(str(store_key("ns", r, page, 4)))
    s = _side(store, 1, TpHeads(2))
    assert s.match("a", PROMPT, 0) == (4, True)
    assert [str(k) for k in reader_keys("ns", 1, TpHeads(2))(writer_tag(4, keys[0]))] == [
        str(store_key("ns", r, keys[0], 4)) for r in (0, 2)
    ]


def test_a_model_read_only_at_its_own_size_never_asks_for_other_sizes() -> None:
    store = Exists()
    keys = chain_keys(PROMPT, BS)
    _hold(store, 2, keys[:2])
    assert _side(store, 1, None).match("a", PROMPT, 0) == (0, False)


def test_switches_between_sizes_are_bounded() -> None:
    store = Exists()
    prompt = list(range(1, 4 * (MAX_SWITCHES + 3) + 2))
    keys = chain_keys(prompt, BS)
    for i, page in enumerate(keys):  # the size alternates page by page
        _hold(store, 2 if i % 2 else 1, [page])
    s = _side(store, 1, TpHeads(2))
    got, _ = s.match("a", prompt, 0)
    assert got == (MAX_SWITCHES + 1) * BS


class _StallsOtherSizes(Exists):
    """Answers at the reader's own size; asked about another size, hangs until released."""

    def __init__(self) -> None:
        super().__init__()
        self.release = threading.Event()

    def exists(self, keys: Sequence[StoreKey], *, deadline: float | None = None) -> list[bool]:
        if any(not k.pool.endswith("of1") for k in keys):
            self.release.wait(30)
        return super().exists(keys, deadline=deadline)


def test_a_probe_that_overran_its_bound_says_so_and_keeps_what_it_found() -> None:
    store = _StallsOtherSizes()
    keys = chain_keys(PROMPT, BS)
    _hold(store, 1, keys[:1])
    _hold(store, 2, keys[1:3])
    storage = BoundedStorage(store, BoundedSettings(deadline_s=0.1, grace_s=0.1))  # type: ignore[arg-type]
    try:
        probe = WriterProbe(
            store_tier(storage, reader_keys("ns", 1, TpHeads(2))), 1, TpHeads(2), ConnectorStats()
        )
        found, answered = probe.leading(keys[:3])
        assert found == [1]  # the tp 2 pages are not claimed: the store did not answer
        assert not answered
    finally:
        store.release.set()
        storage.close()


class _Registrations(DirectoryStore):
    """A directory store that records what is registered with it and unregistered."""

    def __init__(self, root: Path) -> None:
        super().__init__(DirectorySettings(root=root))
        self.held: dict[int, int] = {}  # start -> bytes
        self.unregistered: list[int] = []
        self.sizes: list[int] = []

    def register(self, regions: Sequence[memoryview]) -> None:
        for view in regions:
            self.held[address(view)] = view.nbytes
            self.sizes.append(view.nbytes)

    def unregister(self, start: int) -> None:
        self.unregistered.append(start)
        del self.held[start]


def test_host_memory_and_staging_buffers_are_registered_and_unregistered_at_close(
    tmp_path: Path,
) -> None:
    store = _Registrations(tmp_path)
    everything = full(2)
    write(store, everything, 2, 1)  # tp 1 objects: a tp 2 rank stages each whole
    assert store.held == {}  # every writer's host memory unregistered at its close
    for _ in range(2):
        caches, expected, reads, _errors = read(store, everything, 2, 1, 2, 0)
        assert all(e.ok for e in reads)
        for name, want in expected.items():
            assert torch.equal(caches[name][list(DST)], want[:PAGES])
        assert store.held == {}  # host memory and staging unregistered at close
    # each reader registered its host memory and one staging buffer for its three source
    # objects (the tp 1 object: both heads of every layer), each unregistered
    staging = PAGES * 2 * TOKENS * CONTENT * 2 * LAYERS
    assert len(store.unregistered) == 1 + 2 * 2  # the writer: host memory; each reader: both
    assert staging in store.sizes
    store.close()
