"""Writers and readers of pages across tensor parallel sizes, below vLLM, over any Store (the
directory store in test_tp_reads.py, Mooncake in test_tp_reads_mooncake.py).

- full(total): every layer's KV of every head, distinct values per head.
- rank_caches(full, total, tp, rank): the heads rank ``rank`` of ``tp`` holds.
- transfers(caches, store, heads, tp, rank): a WorkerTransfers wired as WorkerConnector.register
  wires one (host memory registered with the store, a TpReader that registers its staging).
- close(w, store): close it as WorkerConnector.shutdown does (then unregister its host memory).
- write(store, full, total, writers): every writer rank saves pages 0..PAGES-1 and stores them.
- read(store, full, total, writers, reader_tp, rank): one reader rank loads those pages into
  blocks 3..5; returns (caches, the heads it should hold, READ events, error blocks).
"""

from __future__ import annotations

import torch

from hicache.domain.storage import Store
from hicache.engine.bounded import BoundedStorage
from hicache.integrations.vllm.plan import Event, LoadOp, Op, SaveOp, StepPlan, store_key
from hicache.integrations.vllm.stats import ConnectorStats
from hicache.integrations.vllm.tp_plan import TpHeads, heads_of
from hicache.integrations.vllm.tp_reads import TpReader, head_geometry
from hicache.integrations.vllm.worker import WorkerTransfers, block_rows
from hicache.integrations.vllm.worker_host import address, unregister

BLOCKS, TOKENS, CONTENT, LAYERS, PAGES = 6, 4, 8, 2, 3  # content: K + V of a head, bf16 units
DST = (3, 4, 5)  # the blocks pages 0..2 are loaded into


def full(total: int) -> list[torch.Tensor]:
    """Every layer's KV of every head: [BLOCKS, total heads, TOKENS, CONTENT] (vLLM's CPU
    logical order), distinct values per head."""
    g = torch.Generator().manual_seed(total)
    return [
        torch.randn(BLOCKS, total, TOKENS, CONTENT, generator=g).to(torch.bfloat16)
        for _ in range(LAYERS)
    ]


def rank_caches(
    everything: list[torch.Tensor], total: int, tp: int, rank: int
) -> dict[str, torch.Tensor]:
    lo, hi = heads_of(rank, tp, total)
    return {f"layer.{i}": t[:, lo:hi].contiguous() for i, t in enumerate(everything)}


def transfers(
    caches: dict[str, torch.Tensor],
    store: Store,
    heads: TpHeads,
    tp: int,
    rank: int,
    *,
    slicing: bool = True,
    ns: str = "ns",
) -> WorkerTransfers:
    layers = [(n, block_rows(n, t, BLOCKS)) for n, t in caches.items()]
    geometry = (
        [head_geometry(n, t, BLOCKS, heads.per_rank(tp)) for n, t in caches.items()]
        if slicing
        else None
    )
    w = WorkerTransfers(
        layers,
        host_bytes=(PAGES + 1) * sum(r.shape[1] for _, r in layers),
        store=BoundedStorage(store),
        store_key=lambda page: store_key(ns, rank, page, tp),
        stats=ConnectorStats(),
        rank=rank,
        tp_reads=TpReader(heads, tp, rank, geometry, store=store),
    )
    store.register(w.tier.regions())  # as WorkerConnector.register does
    return w


def close(w: WorkerTransfers, store: Store) -> None:
    starts = [address(v) for v in w.tier.regions()]
    w.close()
    if w.tp_reads is not None:  # as WorkerConnector.shutdown does
        w.tp_reads.close()
    for start in starts:
        unregister(store, start)


def key(i: int) -> bytes:
    return bytes([i + 1]) * 32


def write(
    store: Store, everything: list[torch.Tensor], total: int, writers: int, ns: str = "ns"
) -> None:
    """Every writer rank saves blocks 0..PAGES-1 as pages 0..PAGES-1 (namespace ``ns``) and
    stores them."""
    for r in range(writers):
        caches = rank_caches(everything, total, writers, r)
        w = transfers(caches, store, TpHeads(total), writers, r, ns=ns)
        w.start_step(StepPlan(saves=[SaveOp("w", key(p), p, p, True) for p in range(PAGES)]))
        w.finish_step()
        w.wait_idle()
        stored = [e for e in w.drain_events() if e.op is Op.STORE]
        assert len(stored) == PAGES
        assert all(e.ok for e in stored), stored
        close(w, store)


def read(
    store: Store,
    everything: list[torch.Tensor],
    total: int,
    writers: int,
    readers: int,
    rank: int,
    ns: str = "ns",
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], list[Event], set[int]]:
    """Reader ``rank`` of ``readers`` loads pages 0..PAGES-1 (stored by ``writers`` ranks)
    into blocks DST of zeroed caches."""
    expected = rank_caches(everything, total, readers, rank)
    caches = {n: torch.zeros_like(t) for n, t in expected.items()}
    w = transfers(caches, store, TpHeads(total), readers, rank, ns=ns)
    w.start_step(
        StepPlan(
            async_loads=[
                LoadOp(
                    "r",
                    tuple(key(p) for p in range(PAGES)),
                    (0, 1, 2),
                    DST,
                    (True,) * PAGES,
                    writers=(writers,) * PAGES,
                )
            ]
        )
    )
    w.finish_step()
    w.wait_idle()
    reads = [e for e in w.drain_events() if e.op is Op.READ]
    errors = w.drain_errors()
    close(w, store)
    return caches, expected, reads, errors
