"""The prefix index after the long-prompt work (issue #19) gives the same answers as before it:
the same hits, actions and eviction order on random prompts, against the earlier per-page
implementation (one LRU entry per touched page, one stamp per unpinned page) kept in
tests/domain/per_page_index.py."""

from __future__ import annotations

import random

import pytest

from hicache.domain import (
    GroupRules,
    PoolName,
    PoolRule,
    PrefixIndex,
    Restore,
    Tier,
    chain_keys,
)
from tests.domain.per_page_index import PerPageIndex, dropped, outcome

KV = PoolName.KV


@pytest.mark.parametrize("page_size", [1, 4])
def test_hits_actions_and_eviction_order_equal_the_per_page_index(page_size: int) -> None:
    rng = random.Random(page_size)
    rules = GroupRules(page_size=page_size, rules=[PoolRule(pool=KV, restore=Restore.ALL_PAGES)])
    new, old = PrefixIndex(rules), PerPageIndex(rules)
    stems = [[rng.randrange(50) for _ in range(rng.randrange(0, 40))] for _ in range(4)]
    # Prompts come back (so later matches meet the holes and partial copies earlier ones left)
    # and share prefixes (so one prompt's insert or backup changes another's pages).
    prompts = [
        rng.choice(stems) + [rng.randrange(50) for _ in range(rng.randrange(0, 30))]
        for _ in range(12)
    ]
    pinned: list[list[bytes]] = []
    next_id = 0
    hosts_seen = 0
    for _ in range(600):
        op = rng.random()
        prompt = rng.choice(prompts)
        keys = chain_keys(prompt, page_size)
        if op < 0.3:
            where = [{KV: next_id + i} for i in range(len(keys))]
            next_id += len(keys)
            acts = [ix.insert(keys, where) for ix in (new, old)]
            got = [outcome(a) for a in acts]
            backup = [op.key for op in acts[0].backup]
            if backup and rng.random() < 0.5:  # host copies, so hits span device and host
                hosts = [{KV: next_id + i} for i in range(len(backup))]
                next_id += len(backup)
                for ix in (new, old):
                    ix.complete(ix.prepare_backup(backup, hosts), True)
        elif op < 0.55:
            got = [outcome(ix.match(keys)) for ix in (new, old)]
            hosts_seen += got[0][2] > got[0][1]  # the hit reaches past the device pages
        elif op < 0.7:
            hit = new.match(keys, touch=False).device_pages
            take = keys[:hit] + keys[: rng.randrange(0, hit + 1)]  # some keys twice
            for ix in (new, old):
                ix.pin(Tier.DEVICE, take)
            pinned.append(take)
            got = []
        elif op < 0.82 and pinned:
            take = pinned.pop(rng.randrange(len(pinned)))
            for ix in (new, old):
                ix.unpin(Tier.DEVICE, take)
            got = []
        elif op < 0.9 and keys:
            # Forget one page on the device (a hole: host-only pages amid device pages).
            hole = [rng.choice(keys)]
            got = [dropped(ix, hole) for ix in (new, old)]
        else:
            count = rng.randrange(1, 20)
            got = [outcome(ix.evict(Tier.DEVICE, count)) for ix in (new, old)]
        if got:
            assert got[0] == got[1]

        new.validate()
        assert new.statistics() == old.statistics()
    assert hosts_seen  # some matches found pages on host only: the host boundary was compared
    # Drain both: every remaining unpinned page leaves in the same order.
    for take in pinned:
        for ix in (new, old):
            ix.unpin(Tier.DEVICE, take)
    assert outcome(new.evict(Tier.DEVICE, 10**6)) == outcome(old.evict(Tier.DEVICE, 10**6))


def test_a_host_only_page_amid_device_pages_keeps_the_hit_going_as_before() -> None:
    rules = GroupRules(page_size=1, rules=[PoolRule(pool=KV, restore=Restore.ALL_PAGES)])
    results = []
    for ix in (PrefixIndex(rules), PerPageIndex(rules)):
        stem, tail = chain_keys(list(range(8)), 1), chain_keys(list(range(12)), 1)[8:]
        ix.insert(stem + tail, [{KV: i} for i in range(12)])  # no backup completed: device only
        ix.complete(ix.prepare_backup(stem, [{KV: 100 + i} for i in range(8)]), True)
        ix.drop(Tier.DEVICE, [stem[5]])  # page 5 now on host only, pages 8.. on device only
        m = ix.match(stem + tail)
        results.append((m.device_pages, m.host_pages, m.storage_pages))
    assert results[0] == results[1] == (5, 12, 12)
