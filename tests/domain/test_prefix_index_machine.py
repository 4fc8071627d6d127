"""A hypothesis state machine over the prefix index: nothing lost, pins respected, rollbacks whole.

The machine plays the cache face: it hands the index page ids it "allocated" and takes back the
ids the index frees. Invariants after every step:
- every id handed out is either held by the index (a placement or an in-flight destination) or
  was freed exactly once (never twice, never an id the index did not hold);
- an eviction never frees a page of a tier where the model holds a pin;
- the index's own validate() passes (LRU membership, pins of in-flight sources, no idle pages).
"""

from __future__ import annotations

import itertools

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from hicache.domain import CacheStateError, ConfigError, PoolName
from hicache.domain.hybrid import GroupRules, PoolRule, Restore
from hicache.domain.keys import chain_keys
from hicache.domain.prefix_index import PrefixIndex
from hicache.domain.tiers import Actions, OpKind, Ticket, Tier, WritePolicy, WriteSettings

KV, MAMBA = PoolName.KV, PoolName.MAMBA
RULES = GroupRules(
    page_size=2,
    rules=[
        PoolRule(pool=KV, restore=Restore.ALL_PAGES),
        PoolRule(pool=MAMBA, restore=Restore.CHECKPOINT),
    ],
)
KEYS = chain_keys(list(range(12)), 2)  # six pages of one prefix
POLICIES = st.sampled_from(list(WritePolicy))


class IndexMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.idx: PrefixIndex | None = None
        self.ids = itertools.count(1)
        self.held: set[tuple[Tier, PoolName, int]] = set()  # ids the index should hold
        self.pins: dict[tuple[Tier, bytes], int] = {}
        self.tickets: list[Ticket] = []

    # ---- helpers --------------------------------------------------------------------------

    def place(self, tier: Tier, with_state: bool) -> dict[PoolName, int]:
        where = {KV: next(self.ids)}
        if with_state:
            where[MAMBA] = next(self.ids)
        for pool, pid in where.items():
            self.held.add((tier, pool, pid))
        return where

    def take(self, actions: Actions) -> None:
        for f in actions.free:
            item = (f.tier, f.pool, f.page)
            assert item in self.held, f"freed {item}, which the index did not hold (or twice)"
            self.held.remove(item)

    def release(self, where: dict[PoolName, int], tier: Tier) -> None:
        for pool, pid in where.items():
            self.held.discard((tier, pool, pid))

    @property
    def index(self) -> PrefixIndex:
        assert self.idx is not None
        return self.idx

    # ---- rules ----------------------------------------------------------------------------

    @precondition(lambda self: self.idx is None)
    @rule(host=POLICIES, storage=st.one_of(st.none(), POLICIES))
    def start(self, host: WritePolicy, storage: WritePolicy | None) -> None:
        self.idx = PrefixIndex(RULES, WriteSettings(host=host, storage=storage, host_hits=2))

    @precondition(lambda self: self.idx is not None)
    @rule(n=st.integers(1, 6), state=st.lists(st.booleans(), min_size=6, max_size=6))
    def insert(self, n: int, state: list[bool]) -> None:
        keys = KEYS[:n]
        self.take(self.index.insert(keys, [self.place(Tier.DEVICE, s) for s in state[:n]]))

    @precondition(lambda self: self.idx is not None)
    @rule(tier=st.sampled_from([Tier.DEVICE, Tier.HOST]), i=st.integers(0, 5))
    def pin(self, tier: Tier, i: int) -> None:
        try:
            self.index.pin(tier, [KEYS[i]])
        except CacheStateError:
            assert self.index.placement(tier, KEYS[i]) is None
            return
        self.pins[tier, KEYS[i]] = self.pins.get((tier, KEYS[i]), 0) + 1

    @precondition(lambda self: self.pins)
    @rule(data=st.data())
    def unpin(self, data: st.DataObject) -> None:
        tier, key = data.draw(st.sampled_from(sorted(self.pins)))
        self.index.unpin(tier, [key])
        self.pins[tier, key] -= 1
        if not self.pins[tier, key]:
            del self.pins[tier, key]

    @precondition(lambda self: self.idx is not None)
    @rule(
        tier=st.sampled_from([Tier.DEVICE, Tier.HOST]),
        count=st.integers(1, 4),
        state_pool=st.booleans(),
    )
    def evict(self, tier: Tier, count: int, state_pool: bool) -> None:
        pinned = {k for (t, k), c in self.pins.items() if t is tier and c}
        before = {k: self.index.placement(tier, k) or {} for k in pinned}
        out = self.index.evict(tier, count, MAMBA if state_pool else None)
        freed_ids = {(f.tier, f.pool, f.page) for f in out.free}
        for where in before.values():
            assert not any((tier, p, i) in freed_ids for p, i in where.items()), "freed a pin"
        self.take(out)

    @precondition(lambda self: self.idx is not None)
    @rule(kind=st.sampled_from(list(OpKind)), n=st.integers(1, 6), state=st.booleans())
    def prepare(self, kind: OpKind, n: int, state: bool) -> None:
        keys = KEYS[:n]
        dests = [self.place(kind.dest, state) for _ in keys] if kind.dest != Tier.STORAGE else []
        try:
            if kind is OpKind.BACKUP:
                t = self.index.prepare_backup(keys, dests)
            elif kind is OpKind.LOAD:
                t = self.index.prepare_load(keys, dests)
            elif kind is OpKind.PREFETCH:
                t = self.index.prepare_prefetch(keys, dests)
            else:
                t = self.index.prepare_store(keys)
        except (CacheStateError, ConfigError):
            for d in dests:  # refused whole: the caller takes its pages back
                self.release(d, kind.dest)
            return
        self.tickets.append(t)

    @precondition(lambda self: self.tickets)
    @rule(data=st.data())
    def complete(self, data: st.DataObject) -> None:
        ticket = self.tickets.pop(data.draw(st.integers(0, len(self.tickets) - 1)))
        flags = data.draw(st.lists(st.booleans(), min_size=len(ticket), max_size=len(ticket)))
        self.take(self.index.complete(ticket, flags))

    @precondition(lambda self: self.idx is not None)
    @rule(tier=st.sampled_from(list(Tier)), i=st.integers(0, 5))
    def drop(self, tier: Tier, i: int) -> None:
        try:
            self.take(self.index.drop(tier, [KEYS[i]]))
        except CacheStateError:
            assert self.pins.get((tier, KEYS[i]), 0) > 0 or self.index.pins(tier, KEYS[i]) > 0

    # ---- invariants ---------------------------------------------------------------------------

    @invariant()
    def nothing_lost(self) -> None:
        if self.idx is None:
            return
        self.idx.validate()
        holding: set[tuple[Tier, PoolName, int]] = set()
        for key in KEYS:
            for tier in (Tier.DEVICE, Tier.HOST):
                for pool, pid in (self.idx.placement(tier, key) or {}).items():
                    holding.add((tier, pool, pid))
        for t in self.tickets:
            if t.kind.dest != Tier.STORAGE:
                for dest in t.dests:
                    holding.update((t.kind.dest, p, i) for p, i in dest.items())
        assert holding == self.held

    @invariant()
    def match_is_monotone_over_tiers(self) -> None:
        if self.idx is None:
            return
        m = self.idx.match(KEYS, touch=False)
        assert 0 <= m.device_pages <= m.host_pages <= m.storage_pages <= len(KEYS)

    @invariant()
    def pins_agree(self) -> None:
        if self.idx is None:
            return
        in_flight: dict[tuple[Tier, bytes], int] = {}
        for t in self.tickets:
            if t.kind.source != Tier.STORAGE:
                for k in t.keys:
                    in_flight[t.kind.source, k] = in_flight.get((t.kind.source, k), 0) + 1
        for key in KEYS:
            for tier in (Tier.DEVICE, Tier.HOST):
                want = self.pins.get((tier, key), 0) + in_flight.get((tier, key), 0)
                assert self.idx.pins(tier, key) == want


TestIndexMachine = IndexMachine.TestCase
TestIndexMachine.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)


def test_the_machine_catches_an_index_that_frees_a_pinned_page(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The broken case: eviction that ignores pins must fail the machine's invariants."""
    from hicache.domain import prefix_index

    def pin_that_leaves_the_lru_alone(self: PrefixIndex, tier: Tier, keys: list[bytes]) -> None:
        for k in keys:
            self._pages[k].pins[tier] += 1

    monkeypatch.setattr(prefix_index.PrefixIndex, "pin", pin_that_leaves_the_lru_alone)
    m = IndexMachine()
    m.start(WritePolicy.WRITE_THROUGH, None)
    m.insert(2, [False] * 6)
    m.pin(Tier.DEVICE, 0)
    with pytest.raises(AssertionError, match="freed a pin"):
        m.evict(Tier.DEVICE, 4, False)
