"""The prefix index replaces a page's placement, never changes it in place: a write-through
PageOp holds the placement itself (no copy), so it must still read as it was when the op was
made after the index fills, drops or evicts the page."""

from __future__ import annotations

from hicache.domain import (
    GroupRules,
    PoolName,
    PoolRule,
    PrefixIndex,
    Restore,
    Tier,
    WriteSettings,
    key_chain,
)

KV, MAMBA = PoolName.KV, PoolName.MAMBA
HYBRID = GroupRules(
    page_size=4,
    rules=[
        PoolRule(pool=KV, restore=Restore.ALL_PAGES),
        PoolRule(pool=MAMBA, restore=Restore.CHECKPOINT),
    ],
)


def test_a_backup_op_keeps_its_source_when_the_page_is_filled_then_dropped() -> None:
    ix = PrefixIndex(HYBRID, WriteSettings(host="write_through"))
    keys = key_chain(list(range(8)), 4)
    ops = ix.insert(keys, [{KV: 1}, {KV: 2}]).backup
    assert [op.source for op in ops] == [{KV: 1}, {KV: 2}]
    ix.insert(keys[:2], [{KV: 3}, {KV: 2, MAMBA: 7}])  # page 1 gets its checkpoint: a fill
    assert ix.placement(Tier.DEVICE, keys[1]) == {KV: 2, MAMBA: 7}
    ix.drop(Tier.DEVICE, [keys[1]], MAMBA)  # and loses it again
    ix.drop(Tier.DEVICE, [keys[0]])
    assert [op.source for op in ops] == [{KV: 1}, {KV: 2}]  # as when the ops were made
    ix.validate()


def test_placements_read_out_are_copies_the_caller_may_change() -> None:
    ix = PrefixIndex(HYBRID, WriteSettings(host="write_through"))
    keys = key_chain(list(range(4)), 4)
    ix.insert(keys, [{KV: 1}])
    got = ix.placement(Tier.DEVICE, keys[0])
    assert got is not None
    got[MAMBA] = 9
    assert ix.placement(Tier.DEVICE, keys[0]) == {KV: 1}


def test_a_tickets_sources_stay_as_they_were_when_its_pages_are_filled() -> None:
    ix = PrefixIndex(HYBRID, WriteSettings(host="write_through"))
    keys = key_chain(list(range(8)), 4)
    ix.insert(keys, [{KV: 1}, {KV: 2}])
    ticket = ix.prepare_backup(list(keys), [{KV: 11}, {KV: 12}])
    ix.insert(keys[:2], [{KV: 1}, {KV: 2, MAMBA: 7}])  # page 1's device copy gets a checkpoint
    assert ticket.sources == ({KV: 1}, {KV: 2})
    ix.complete(ticket, True)
    assert ix.placement(Tier.HOST, keys[1]) == {KV: 12}
    ix.validate()
