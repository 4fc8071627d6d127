"""WorkerTransfers test helpers: vLLM-shaped CPU caches, page keys, a WorkerTransfers builder."""

from __future__ import annotations

import torch

from hicache.adapters.storage import DirectoryStore
from hicache.domain.storage import StoreKey
from hicache.engine.bounded import BoundedStorage
from hicache.integrations.vllm.stats import ConnectorStats
from hicache.integrations.vllm.worker import WorkerTransfers, block_rows

BLOCKS = 8


def caches(arrangement: str = "layers") -> dict[str, torch.Tensor]:
    """Three layers' caches, blocks first, then K/V, heads, tokens, head dim (the order inside
    is opaque to the worker). "layers": a tensor per layer (vLLM's layer-outermost layouts,
    the CPU's); "blocks": views of one tensor whose block holds every layer side by side
    (vLLM's block-outermost layouts, BLHNC / BLNHC)."""
    g = torch.Generator().manual_seed(0)
    names = [f"layer.{i}" for i in range(3)]
    if arrangement == "blocks":
        raw = torch.randn(BLOCKS, len(names), 2, 2, 4, 8, generator=g).to(torch.bfloat16)
        return {n: raw.select(1, i) for i, n in enumerate(names)}
    return {n: torch.randn(BLOCKS, 2, 2, 4, 8, generator=g).to(torch.bfloat16) for n in names}


def key(i: int) -> bytes:
    return bytes([i]) * 32


def transfers(c: dict[str, torch.Tensor], store: DirectoryStore | None = None) -> WorkerTransfers:
    layers = [(n, block_rows(n, t, BLOCKS)) for n, t in c.items()]
    return WorkerTransfers(
        layers,
        host_bytes=4 * sum(r.shape[1] for _, r in layers),
        store=BoundedStorage(store) if store is not None else None,
        store_key=lambda page: StoreKey(namespace="t", pool="kv-r0", page_hash=page.hex()),
        stats=ConnectorStats(),
    )
