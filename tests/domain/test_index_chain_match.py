"""PrefixIndex.match of a KeyChain (O(log n) lookups plus a checked walk over the hit's chain
links) gives exactly the per-page walk's hits, touches and eviction order, whatever holes,
missing links or wrong links the index holds; wrong links are caught and mended."""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

import pytest

import hicache.domain.prefix_index as prefix_index
from hicache.domain import (
    GroupRules,
    PoolName,
    PoolRule,
    PrefixIndex,
    Restore,
    Tier,
    chain_keys,
    key_chain,
)
from hicache.domain.index_pages import PageRecord
from tests.domain.per_page_index import PerPageIndex, dropped, outcome

KV = PoolName.KV


def rules(page_size: int = 1) -> GroupRules:
    return GroupRules(page_size=page_size, rules=[PoolRule(pool=KV, restore=Restore.ALL_PAGES)])


@pytest.fixture
def paths(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """How many matches the chain links answered, and how many walked the keys."""
    seen = {"links": 0, "walk": 0}
    real = prefix_index._chain_boundaries

    def counted(get: Any, keys: Sequence[bytes]) -> Any:
        found = real(get, keys)
        seen["links" if found is not None else "walk"] += 1
        return found

    monkeypatch.setattr(prefix_index, "_chain_boundaries", counted)
    return seen


@pytest.mark.parametrize("page_size", [1, 4])
def test_chain_matches_equal_the_per_page_walk_under_random_operations(
    page_size: int, paths: dict[str, int]
) -> None:
    rng = random.Random(100 + page_size)
    new, old = PrefixIndex(rules(page_size)), PerPageIndex(rules(page_size))
    stems = [[rng.randrange(50) for _ in range(rng.randrange(0, 40))] for _ in range(4)]
    prompts = [
        rng.choice(stems) + [rng.randrange(50) for _ in range(rng.randrange(0, 30))]
        for _ in range(12)
    ]
    pinned: list[list[bytes]] = []
    next_id = 0
    for _ in range(700):
        op = rng.random()
        prompt = rng.choice(prompts)
        chain = key_chain(prompt, page_size)
        keys = chain_keys(prompt, page_size)
        got: list[Any] = []
        if op < 0.25 and keys:
            # Whole prompts, a suffix only (its head may be missing: a hole before it), or the
            # keys in a wrong order as a plain list (links that name the wrong parent).
            kind = rng.random()
            start = rng.randrange(len(keys)) if kind < 0.3 else 0
            fed: Sequence[bytes] = chain[start:]
            if kind > 0.85:
                fed = list(reversed(keys))
            where = [{KV: next_id + i} for i in range(len(fed))]
            next_id += len(fed)
            acts = [new.insert(fed, where), old.insert(list(fed), where)]
            got = [outcome(a) for a in acts]
            backup = [b.key for b in acts[0].backup]
            if backup and rng.random() < 0.5:
                hosts = [{KV: next_id + i} for i in range(len(backup))]
                next_id += len(backup)
                for ix in (new, old):
                    ix.complete(ix.prepare_backup(backup, hosts), True)
        elif op < 0.55:
            got = [outcome(new.match(chain)), outcome(old.match(keys))]
        elif op < 0.65:
            hit = new.match(chain, touch=False).device_pages
            take = keys[:hit] + keys[: rng.randrange(0, hit + 1)]
            for ix in (new, old):
                ix.pin(Tier.DEVICE, take)
            pinned.append(take)
        elif op < 0.75 and pinned:
            take = pinned.pop(rng.randrange(len(pinned)))
            for ix in (new, old):
                ix.unpin(Tier.DEVICE, take)
        elif op < 0.85 and keys:
            hole = [rng.choice(keys)]
            got = [dropped(ix, hole) for ix in (new, old)]
        else:
            count = rng.randrange(1, 20)
            got = [outcome(new.evict(Tier.DEVICE, count)), outcome(old.evict(Tier.DEVICE, count))]
        if got:
            assert got[0] == got[1]
        new.validate()
        assert new.statistics() == old.statistics()
    assert paths["links"] > 50
    assert paths["walk"] > 10
    for take in pinned:
        for ix in (new, old):
            ix.unpin(Tier.DEVICE, take)
    assert outcome(new.evict(Tier.DEVICE, 10**6)) == outcome(old.evict(Tier.DEVICE, 10**6))


def test_a_wrong_link_is_caught_answered_by_the_walk_and_mended(paths: dict[str, int]) -> None:
    ix = PrefixIndex(rules())
    a, b = key_chain(list(range(10)), 1), key_chain(list(range(100, 110)), 1)
    ix.insert(a, [{KV: i} for i in range(10)])
    ix.insert(b, [{KV: 10 + i} for i in range(10)])
    assert ix.match(a).device_pages == 10
    assert paths == {"links": 1, "walk": 0}
    # The broken case: page 5 of a linked to page 4 of b (on device too, so only the keys
    # show the link is wrong).
    rec: dict[bytes, PageRecord] = ix._pages
    rec[a[5]].parent = rec[b[4]]
    m = ix.match(a)
    assert (m.device_pages, m.host_pages, m.storage_pages) == (10, 10, 10)
    assert paths == {"links": 1, "walk": 1}
    assert rec[a[5]].parent is rec[a[4]]  # mended by the walk
    assert ix.match(a).device_pages == 10
    assert paths == {"links": 2, "walk": 1}


def test_a_hole_in_the_chain_stops_the_hit_there_as_the_walk_does() -> None:
    ix = PrefixIndex(rules())
    a = key_chain(list(range(20)), 1)
    ix.insert(a, [{KV: i} for i in range(20)])
    ix.drop(Tier.DEVICE, [a[7]])  # device only: the record leaves; pages 8.. stay linked to it
    m = ix.match(a)
    assert (m.device_pages, m.host_pages, m.storage_pages) == (7, 7, 7)
    assert list(m.keys) == list(a[:7])


def test_a_record_that_leaves_the_index_drops_its_link() -> None:
    ix = PrefixIndex(rules())
    a = key_chain(list(range(6)), 1)
    ix.insert(a, [{KV: i} for i in range(6)])
    records = [ix._pages[k] for k in a]
    assert [r.parent for r in records[1:]] == records[:-1]
    ix.evict(Tier.DEVICE, 6)
    assert len(ix) == 0
    assert all(r.parent is None for r in records)  # no chain of records kept alive


def test_a_key_chain_slice_links_its_first_page_to_the_page_before_it() -> None:
    ix = PrefixIndex(rules())
    a = key_chain(list(range(12)), 1)
    ix.insert(a[:5], [{KV: i} for i in range(5)])
    ix.insert(a[5:], [{KV: 5 + i} for i in range(7)])
    assert ix._pages[a[5]].parent is ix._pages[a[4]]
    assert ix.match(a).device_pages == 12


def test_a_linked_page_on_no_tier_yet_ends_the_hit_as_the_walk_does(paths: dict[str, int]) -> None:
    ix = PrefixIndex(rules())
    a = key_chain(list(range(20)), 1)
    ix.insert(a, [{KV: i} for i in range(20)])
    ix.drop(Tier.DEVICE, [a[7]])
    ix.prepare_prefetch([a[7]], [{KV: 100}])  # a[7] again, on its way from storage: on no tier
    rec: dict[bytes, PageRecord] = ix._pages
    rec[a[8]].parent = rec[a[7]]  # linked, as a chain through it would link it
    rec[a[7]].parent = rec[a[6]]
    m = ix.match(a)
    assert (m.device_pages, m.host_pages, m.storage_pages) == (7, 7, 7)
    assert paths["walk"] == 1
