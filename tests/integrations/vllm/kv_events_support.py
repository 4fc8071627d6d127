"""What a router keeps from vLLM's KV events (a support module of the KV-event tests).

- Consumer(block_size).feed(events): per medium, the block hashes held (vLLM's GPU tier
  publishes medium "GPU"), and hicache's page key of every block a GPU ``BlockStored`` described
  (its whole prefix's tokens, chained), so a test can name a tier's pages by the GPU tier's hashes.
- decode(payloads): vLLM's ZMQ payloads (msgpack ``KVEventBatch``) -> their events, in order.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import msgspec
from vllm.distributed.kv_events import (
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
)

from hicache.domain.keys import chain_keys


class Consumer:
    """What a router keeps from the published events: per medium, the hashes held (vLLM's GPU
    tier publishes medium None or "GPU"), and hicache's page key of every block a GPU
    BlockStored described (its whole prefix's tokens, chained)."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.held: dict[str, set[Any]] = {}
        self.prefix: dict[Any, list[int]] = {}
        self.key_hash: dict[bytes, Any] = {}

    def feed(self, events: Iterable[Any]) -> None:
        for e in events:
            if isinstance(e, BlockStored):
                medium = e.medium or MEDIUM_GPU
                self.held.setdefault(medium, set()).update(e.block_hashes)
                if medium == MEDIUM_GPU:
                    prefix = list(self.prefix[e.parent_block_hash]) if e.parent_block_hash else []
                    for i, h in enumerate(e.block_hashes):
                        prefix += e.token_ids[i * self.block_size : (i + 1) * self.block_size]
                        self.prefix[h] = list(prefix)
                        self.key_hash[chain_keys(prefix, self.block_size)[-1]] = h
            elif isinstance(e, BlockRemoved):
                self.held.setdefault(e.medium or MEDIUM_GPU, set()).difference_update(
                    e.block_hashes
                )
            elif isinstance(e, AllBlocksCleared):  # vLLM's GPU tier only (reset_prefix_cache)
                self.held[MEDIUM_GPU] = set()

    def get(self, medium: str) -> set[Any]:
        return self.held.get(medium, set())


def decode(payloads: Iterable[bytes]) -> list[Any]:
    """The events of vLLM's published batches, in order."""
    decoder = msgspec.msgpack.Decoder(KVEventBatch)
    return [e for p in payloads for e in decoder.decode(p).events]
