"""The tiers' KV events (hicache.integrations.vllm.events) from the scheduler side, no engine:
saves, host evictions, store writes, store lookups (a restart), resets, bounds."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import pytest

from tests.integrations.vllm.vllm_support import require_vllm

require_vllm()

from vllm.distributed.kv_events import BlockRemoved, BlockStored  # noqa: E402

from hicache.domain.keys import chain_keys  # noqa: E402
from hicache.domain.storage import StoreKey  # noqa: E402
from hicache.engine.bounded import BoundedStorage  # noqa: E402
from hicache.integrations.vllm.events import (  # noqa: E402
    MEDIUM_HOST,
    MEDIUM_STORE,
    BlockInfo,
    TierEvents,
    hash_converter,
)
from hicache.integrations.vllm.plan import Event, Op  # noqa: E402
from hicache.integrations.vllm.scheduler import Scheduled, SchedulerSide  # noqa: E402
from hicache.integrations.vllm.stats import ConnectorStats  # noqa: E402
from tests.integrations.vllm.side_helpers import BS, PROMPT, Exists, store_keys  # noqa: E402

pytestmark = pytest.mark.vllm  # vLLM's event classes (no engine)


def vhash(tokens: Sequence[int], block: int) -> bytes:
    """A stand-in for vLLM's block hash of block ``block`` (its whole prefix, chained)."""
    return hashlib.sha256(repr(list(tokens[: (block + 1) * BS])).encode()).digest()


class Requests:
    """The requests' tokens; ``describe`` is what the connector reads from vLLM's Request."""

    def __init__(self) -> None:
        self.tokens: dict[str, list[int]] = {}

    def describe(self, req_id: str, block: int) -> BlockInfo | None:
        tokens = self.tokens.get(req_id)
        if tokens is None or (block + 1) * BS > len(tokens):
            return None
        return BlockInfo(
            block_hash=vhash(tokens, block),
            parent=vhash(tokens, block - 1) if block else None,
            token_ids=tuple(tokens[block * BS : (block + 1) * BS]),
        )


def make(
    reqs: Requests, *, slots: int = 16, store: Exists | None = None, store_limit: int | None = None
) -> tuple[SchedulerSide, TierEvents]:
    events = TierEvents(reqs.describe, block_size=BS, host_slots=slots, store_limit=store_limit)
    side = SchedulerSide(
        block_size=BS,
        host_slots=slots,
        store=BoundedStorage(store) if store is not None else None,  # type: ignore[arg-type]
        store_keys=store_keys(1),
        write_storage=store is not None,
        save_decode=False,
        ranks=1,
        stats=ConnectorStats(),
        events=events,
    )
    return side, events


def prefill(side: SchedulerSide, reqs: Requests, rid: str, tokens: list[int]) -> list[Event]:
    """One full prefill step of ``tokens``: the save events every rank reports."""
    reqs.tokens[rid] = tokens
    side.match(rid, tokens, 0)
    n = len(tokens) // BS
    plan = side.build([Scheduled(rid, tokens, 0, len(tokens))], lambda _r: list(range(n + 1)))
    return [Event(Op.SAVE, op.key, True) for op in plan.saves]


def test_a_save_publishes_one_block_stored_on_cpu_with_vllms_chained_hashes() -> None:
    reqs = Requests()
    side, events = make(reqs)
    saves = prefill(side, reqs, "a", PROMPT)
    assert events.take() == []  # planned, not copied yet
    side.on_events(saves)
    (stored,) = events.take()
    assert isinstance(stored, BlockStored)
    assert stored.medium == MEDIUM_HOST
    assert stored.block_hashes == [vhash(PROMPT, b) for b in range(4)]
    assert stored.parent_block_hash is None
    assert stored.token_ids == PROMPT[:16]
    assert stored.block_size == BS
    assert events.held(MEDIUM_HOST) == set(stored.block_hashes)
    assert events.take() == []


def test_a_later_blocks_event_names_its_parent_and_a_failed_save_publishes_nothing() -> None:
    reqs = Requests()
    side, events = make(reqs)
    side.on_events(prefill(side, reqs, "a", PROMPT[:8]))
    events.take()
    longer = [*PROMPT[:8], 90, 91, 92, 93, 94, 95, 96, 97]
    saves = prefill(side, reqs, "b", longer)  # blocks 2 and 3 are new
    side.on_events([saves[0], Event(Op.SAVE, saves[1].key, False)])
    (stored,) = events.take()
    assert stored.block_hashes == [vhash(longer, 2)]
    assert stored.parent_block_hash == vhash(longer, 1)
    assert stored.token_ids == longer[8:12]
    assert vhash(longer, 3) not in events.held(MEDIUM_HOST)


def test_a_host_eviction_publishes_block_removed_with_the_evicted_blocks_hash() -> None:
    reqs = Requests()
    side, events = make(reqs, slots=4)
    side.on_events(prefill(side, reqs, "a", PROMPT))  # 4 pages: the host tier is full
    events.take()
    other = [200 + t for t in PROMPT]
    side.on_events(prefill(side, reqs, "b", other[:8]))  # evicts a's blocks 0 and 1 (oldest)
    removed, stored = events.take()
    assert isinstance(removed, BlockRemoved)
    assert removed.medium == MEDIUM_HOST
    assert removed.block_hashes == [vhash(PROMPT, 0), vhash(PROMPT, 1)]
    assert stored.block_hashes == [vhash(other, 0), vhash(other, 1)]
    held = {vhash(PROMPT, 2), vhash(PROMPT, 3), vhash(other, 0), vhash(other, 1)}
    assert events.held(MEDIUM_HOST) == held
    assert len(side.index) == len(held)


def test_a_reset_of_the_host_tier_removes_every_unpinned_block() -> None:
    reqs = Requests()
    side, events = make(reqs)
    side.on_events(prefill(side, reqs, "a", PROMPT))
    events.take()
    assert side.index.clear_unpinned() == 4
    (removed,) = events.take()
    assert removed.medium == MEDIUM_HOST
    assert sorted(removed.block_hashes) == sorted(vhash(PROMPT, b) for b in range(4))
    assert events.held(MEDIUM_HOST) == set()


def test_a_store_write_publishes_block_stored_on_storage() -> None:
    reqs, store = Requests(), Exists()
    side, events = make(reqs, store=store)
    saves = prefill(side, reqs, "a", PROMPT)
    side.on_events(saves)
    events.take()
    side.on_events([Event(Op.STORE, saves[0].key, True), Event(Op.STORE, saves[1].key, False)])
    (stored,) = events.take()
    assert stored.medium == MEDIUM_STORE
    assert stored.block_hashes == [vhash(PROMPT, 0)]
    assert stored.token_ids == PROMPT[:4]
    assert events.held(MEDIUM_STORE) == {vhash(PROMPT, 0)}


def test_after_a_restart_a_lookup_publishes_what_the_store_holds_and_what_it_lost() -> None:
    store = Exists()
    for key in chain_keys(PROMPT, BS)[:3]:
        store.held.add(str(StoreKey(namespace="t", pool="kv-r0", page_hash=key.hex())))
    reqs = Requests()
    side, events = make(reqs, store=store)  # a fresh connector: nothing published yet
    reqs.tokens["a"] = PROMPT
    assert side.match("a", PROMPT, 0) == (12, True)
    (stored,) = events.take()
    assert stored.medium == MEDIUM_STORE
    assert stored.block_hashes == [vhash(PROMPT, b) for b in range(3)]
    # the read into host memory publishes them on CPU once it settled
    side.after_alloc("a", [5, 6, 7, 8, 9], 12)
    plan = side.build([], lambda _r: [])
    (op,) = plan.async_loads
    side.on_events([Event(Op.READ, key, True) for key in op.keys])
    (host,) = events.take()
    assert (host.medium, host.block_hashes) == (MEDIUM_HOST, stored.block_hashes)
    side.on_events([Event(Op.LOAD, key, True) for key in op.keys])
    side.finished("a")
    # the store lost block 1: a lookup that needs it from the store says so
    store.held.discard(
        str(StoreKey(namespace="t", pool="kv-r0", page_hash=chain_keys(PROMPT, BS)[1].hex()))
    )
    side.index.clear_unpinned()
    events.take()
    reqs.tokens["b"] = PROMPT
    assert side.match("b", PROMPT, 0) == (4, True)
    (removed,) = events.take()
    assert (removed.medium, removed.block_hashes) == (MEDIUM_STORE, [vhash(PROMPT, 1)])
    assert events.held(MEDIUM_STORE) == {vhash(PROMPT, 0), vhash(PROMPT, 2)}


def test_the_store_blocks_tracked_are_bounded_and_the_oldest_is_published_removed() -> None:
    reqs, store = Requests(), Exists()
    side, events = make(reqs, store=store, store_limit=3)
    saves = prefill(side, reqs, "a", PROMPT)
    side.on_events(saves)
    side.on_events([Event(Op.STORE, e.key, True) for e in saves])
    stored_host, stored, removed = events.take()
    assert stored_host.medium == MEDIUM_HOST
    assert stored.block_hashes == [vhash(PROMPT, b) for b in range(4)]
    assert (removed.medium, removed.block_hashes) == (MEDIUM_STORE, [vhash(PROMPT, 0)])
    assert len(events.held(MEDIUM_STORE)) == 3


def test_pages_without_a_vllm_request_publish_nothing() -> None:
    reqs = Requests()
    side, events = make(reqs)
    side.match("a", PROMPT, 0)  # reqs never learnt "a": its blocks cannot be described
    plan = side.build([Scheduled("a", PROMPT, 0, len(PROMPT))], lambda _r: list(range(5)))
    side.on_events([Event(Op.SAVE, op.key, True) for op in plan.saves])
    assert events.take() == []
    assert events.held(MEDIUM_HOST) == set()


@pytest.mark.parametrize("as_int", ["1", "0"])
def test_hashes_are_converted_as_vllm_converts_them_for_its_own_events(
    as_int: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from vllm.v1.core.kv_cache_utils import BlockHash, maybe_convert_block_hash

    monkeypatch.setenv("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", as_int)
    convert = hash_converter()
    for n in range(20):
        digest = hashlib.sha256(bytes([n])).digest()
        assert convert(digest) == maybe_convert_block_hash(BlockHash(digest))
    assert isinstance(convert(digest), int if as_int == "1" else bytes)
