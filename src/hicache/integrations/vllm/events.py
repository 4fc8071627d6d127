"""KV-cache events of hicache's tiers, published through vLLM's own KV events (issue #25).

vLLM's scheduler collects ``KVConnectorBase_V1.take_events()`` of the scheduler-side connector
after every step, appends them to its own GPU block pool's events and publishes the batch
(``KVEventBatch``) through the publisher of ``--kv-events-config`` (ZMQ). This module makes those
events for hicache's two tiers:

- ``BlockStored`` with ``medium`` "CPU" when a block's page becomes matchable in the host tier
  (a save's copy ended on every rank, or a store read landed), ``BlockRemoved`` "CPU" when it
  stops being so (LRU eviction, ``reset_prefix_cache(reset_connector=True)``, a dropped page);
- ``BlockStored`` "STORAGE" when every rank's write of the page reached the store, or when a
  lookup found the page in the store (after a restart, or written by another instance);
  ``BlockRemoved`` "STORAGE" when a lookup finds a page announced as stored missing (the store
  evicts on its own: the connector learns it then), or when the connector stops tracking it
  (more than ``store_limit`` store blocks tracked: the oldest goes).

Each block carries the hash vLLM's own prefix cache uses for it (``request.block_hashes``,
converted as vLLM converts them for its events: ``maybe_convert_block_hash``, bytes or, with
``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``, a 64-bit int), its parent's, its token ids, the block
size and the LoRA adapter, so a consumer matches them against the GPU tier's events. The hash
is snapshotted when the page's copy is planned, while vLLM's ``Request`` is alive (the page key
-> hash map is bounded: pages being copied, pages the host holds, ``store_limit`` store pages).
Only the attention group's KV blocks are published: a hybrid model's state pages have no vLLM
block hash. ``extra_keys`` are left None (as vLLM's OffloadingConnector does).

- TierEvents: the tracker (plain values; ``take`` builds vLLM's event objects).
- BlockInfo / describer(requests, block_size, hash_block_size): a block's event payload read
  from vLLM's ``Request``; hash_converter(): vLLM's conversion of a block hash for events.

Reference (vLLM 0.32): vllm/distributed/kv_events.py (``BlockStored``, ``BlockRemoved``,
``MEDIUM_CPU``, ``MEDIUM_STORAGE``), vllm/v1/core/sched/scheduler.py (``connector.take_events()``
after each step), vllm/v1/core/block_pool.py (the GPU tier's events),
vllm/distributed/kv_transfer/kv_connector/v1/offloading/events.py (the OffloadingConnector's).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import attrs

from hicache.domain.lru_map import LruMap

if TYPE_CHECKING:
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.v1.request import Request

# vLLM's names (vllm.distributed.kv_events.MEDIUM_CPU / MEDIUM_STORAGE), as its
# OffloadingConnector publishes them.
MEDIUM_HOST = "CPU"
MEDIUM_STORE = "STORAGE"
# Store blocks tracked at least (key -> hash, ~200 bytes each), or 4 per host page if more.
STORE_TRACKED = 100_000

Hash = bytes | int


@attrs.frozen
class BlockInfo:
    """What a ``BlockStored`` says of one block (the hashes already as vLLM publishes them)."""

    block_hash: Hash
    parent: Hash | None
    token_ids: tuple[int, ...]
    lora_id: int | None = None
    lora_name: str | None = None


# (request id, block index) -> the block's payload, or None when it cannot be told
Describe = Callable[[str, int], BlockInfo | None]


class TierEvents:
    """Which blocks each tier holds, as vLLM events; one owner thread (vLLM's scheduler).

    SchedulerSide calls ``planned`` when it plans a page's copy (a save or a store read),
    ``store_answer`` with what a lookup learnt of the store, ``stored`` when a store write
    settled; the host index's listener is ``host_change``. vLLM drains ``take``.
    """

    def __init__(
        self,
        describe: Describe,
        *,
        block_size: int,
        host_slots: int,
        group_idx: int = 0,
        store_limit: int | None = None,
    ) -> None:
        self._describe = describe
        self.block_size = block_size
        self.group_idx = group_idx
        # planned copies not settled yet; bounded (a copy that never settles is forgotten)
        self._pending: LruMap[bytes, BlockInfo] = LruMap(host_slots + 1024)
        self._host: dict[bytes, BlockInfo] = {}  # bounded by the host index
        self.store_limit = store_limit or max(STORE_TRACKED, 4 * host_slots)
        self._store: LruMap[bytes, Hash] = LruMap(self.store_limit)  # announced store blocks
        # (medium, a stored block's payload or a removed block's hash)
        self._queue: list[tuple[str, BlockInfo | Hash]] = []

    # ---- what the scheduler side reports ----------------------------------------------------

    def planned(self, req_id: str, block: int, key: bytes) -> None:
        """A copy of block ``block`` of ``req_id`` into page ``key`` was planned."""
        info = self._describe(req_id, block)
        if info is None:
            return
        self._pending.put(key, info)  # the oldest planned copy past the limit is forgotten

    def host_change(self, key: bytes, held: bool) -> None:
        """HostPages' listener: page ``key`` became matchable (``held``) or stopped being so."""
        if held:
            info = self._pending.pop(key)
            if info is not None:
                self._host[key] = info
                self._queue.append((MEDIUM_HOST, info))
        else:
            info = self._host.pop(key, None)
            if info is not None:
                self._queue.append((MEDIUM_HOST, info.block_hash))

    def stored(self, key: bytes) -> None:
        """Every rank's write of page ``key`` reached the store."""
        info = self._host.get(key) or self._pending.get(key)
        if info is not None:
            self._in_store(key, info)

    def store_answer(self, req_id: str, first: int, keys: Sequence[bytes], held: int) -> None:
        """A lookup asked the store for ``keys`` (blocks ``first``, ``first + 1``, ... of
        ``req_id``) and learnt that it holds the leading ``held`` of them and not the next."""
        for n, key in enumerate(keys[:held]):
            if self._store.touch(key):
                continue
            info = self._host.get(key) or self._describe(req_id, first + n)
            if info is not None:
                self._in_store(key, info)
        if held < len(keys):
            gone = self._store.pop(keys[held])
            if gone is not None:
                self._queue.append((MEDIUM_STORE, gone))

    def _in_store(self, key: bytes, info: BlockInfo) -> None:
        if self._store.touch(key):
            return
        evicted = self._store.put(key, info.block_hash)
        self._queue.append((MEDIUM_STORE, info))
        self._queue.extend((MEDIUM_STORE, old) for _, old in evicted)

    # ---- what vLLM takes --------------------------------------------------------------------

    def held(self, medium: str) -> set[Hash]:
        """The hashes of the blocks the events say ``medium`` holds now."""
        if medium == MEDIUM_HOST:
            return {info.block_hash for info in self._host.values()}
        if medium == MEDIUM_STORE:
            return set(self._store.values())
        return set()

    def take(self) -> list[KVCacheEvent]:
        """The events since the last call, as vLLM's objects; a run of blocks of one chain
        stored in one medium is one ``BlockStored`` (as vLLM's GPU tier publishes them), a
        run of removals from one medium one ``BlockRemoved``."""
        if not self._queue:
            return []
        from vllm.distributed.kv_events import BlockRemoved, BlockStored

        queue, self._queue = self._queue, []
        out: list[Any] = []
        last_kind: tuple[str, bool] | None = None
        for medium, payload in queue:
            kind = (medium, isinstance(payload, BlockInfo))
            prev = out[-1] if out and last_kind == kind else None
            if isinstance(payload, BlockInfo):
                info = payload
                if (
                    prev is not None
                    and prev.block_hashes[-1] == info.parent
                    and prev.lora_name == info.lora_name
                ):
                    prev.block_hashes.append(info.block_hash)
                    prev.token_ids.extend(info.token_ids)
                    continue
                out.append(
                    BlockStored(
                        block_hashes=[info.block_hash],
                        parent_block_hash=info.parent,
                        token_ids=list(info.token_ids),
                        block_size=self.block_size,
                        lora_id=info.lora_id,
                        medium=medium,
                        lora_name=info.lora_name,
                        group_idx=self.group_idx,
                    )
                )
            elif prev is not None:
                prev.block_hashes.append(payload)
                continue
            else:
                out.append(
                    BlockRemoved(block_hashes=[payload], medium=medium, group_idx=self.group_idx)
                )
            last_kind = kind
        return out


_LOW_64 = (1 << 64) - 1


def hash_converter() -> Callable[[bytes], Hash]:
    """What vLLM's ``maybe_convert_block_hash`` does to a block hash for its events (the bytes,
    or with ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``, vLLM 0.32's default, the big-endian
    integer's low 64 bits), with vLLM's environment flag read once here rather than per
    block (reading it costs more than the rest of a block's event)."""
    import vllm.envs as envs

    if not envs.VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES:
        return bytes
    return lambda digest: int.from_bytes(digest, "big") & _LOW_64


def describer(requests: Mapping[str, Request], block_size: int, hash_block_size: int) -> Describe:
    """A Describe over vLLM's live requests: block ``b`` of a request (``block_size`` tokens)
    is hashed by vLLM at ``hash_block_size``; its hash is the chained hash of its last token,
    ``block_hashes[(b + 1) * ratio - 1]`` (vLLM's ``BlockHashListWithBlockSize``)."""
    maybe_convert_block_hash = hash_converter()
    ratio = max(block_size // max(hash_block_size, 1), 1)

    def describe(req_id: str, block: int) -> BlockInfo | None:
        request = requests.get(req_id)
        if request is None:
            return None
        hashes = request.block_hashes
        at = (block + 1) * ratio - 1
        if at >= len(hashes):
            return None
        parent = maybe_convert_block_hash(hashes[at - ratio]) if block > 0 else None
        lora = request.lora_request
        return BlockInfo(
            block_hash=maybe_convert_block_hash(hashes[at]),
            parent=parent,
            token_ids=tuple(request.all_token_ids[block * block_size : (block + 1) * block_size]),
            lora_id=lora.adapter_id if lora is not None else None,
            lora_name=lora.name if lora is not None else None,
        )

    return describe


__all__ = [
    "MEDIUM_HOST",
    "MEDIUM_STORE",
    "STORE_TRACKED",
    "BlockInfo",
    "Describe",
    "TierEvents",
    "describer",
    "hash_converter",
]
