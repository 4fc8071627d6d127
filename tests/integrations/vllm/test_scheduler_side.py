"""Hits, load and save plans, and the ranks' agreement, without vLLM."""

from __future__ import annotations

import pytest

from hicache.domain.keys import chain_keys
from hicache.domain.storage import StoreKey
from hicache.integrations.vllm.plan import Agreement, Event, Op
from hicache.integrations.vllm.scheduler import Scheduled
from tests.integrations.vllm.side_helpers import BS, PROMPT, Exists, prefill, side


def test_hit_is_whole_blocks_and_leaves_the_last_token() -> None:
    s = side()
    s.on_events(prefill(s, "a", PROMPT[:16], [0, 1, 2, 3]))
    assert s.match("b", PROMPT[:16], 0) == (12, False)  # 16 tokens: the 4th block is left
    assert s.match("c", PROMPT, 0) == (16, False)
    assert s.match("d", PROMPT, 8) == (8, False)  # vLLM's own hit covers 2 blocks
    assert s.match("e", [99, *PROMPT[1:]], 0) == (0, False)


def test_a_page_is_no_hit_before_its_save_is_reported() -> None:
    s = side()
    events = prefill(s, "a", PROMPT, [0, 1, 2, 3, 4])
    assert s.match("b", PROMPT, 0) == (0, False)
    s.on_events(events)
    assert s.match("b", PROMPT, 0) == (16, False)


def test_load_plan_pins_host_pages_and_targets_vllm_blocks() -> None:
    s = side()
    s.on_events(prefill(s, "a", PROMPT, [0, 1, 2, 3, 4]))
    assert s.match("b", PROMPT, 4) == (12, False)
    s.after_alloc("b", [10, 11, 12, 13, 14], 12)
    plan = s.build([], lambda _r: [])
    (op,) = plan.loads
    assert op.blocks == (11, 12, 13)
    assert len(set(op.slots)) == 3
    assert all(s.index.known(key) for key in op.keys)
    assert s.index.clear_unpinned() == 1  # only block 0's page: the loaded ones are pinned
    s.on_events([Event(Op.LOAD, key, True) for key in op.keys])
    assert s.index.clear_unpinned() == 3


def test_decode_blocks_are_saved_when_they_fill() -> None:
    s = side()
    tokens = PROMPT[:6]
    s.match("a", tokens, 0)
    plan = s.build([Scheduled("a", tokens, 0, 6)], lambda _r: [7, 8])
    assert [op.block for op in plan.saves] == [7]
    tokens = [*tokens, 50]  # decode: the sampled token's KV is computed at position 6
    plan = s.build([Scheduled("a", tokens, 6, 1)], lambda _r: [7, 8])
    assert plan.saves == []
    tokens = [*tokens, 51]  # position 7 fills block 1
    plan = s.build([Scheduled("a", tokens, 7, 1)], lambda _r: [7, 8])
    assert [op.block for op in plan.saves] == [8]
    assert plan.saves[0].key == chain_keys(tokens, BS)[1]


def test_without_save_decode_only_prompt_blocks_are_saved() -> None:
    s = side(decode=False)
    tokens = PROMPT[:6]
    s.match("a", tokens, 0)
    s.build([Scheduled("a", tokens, 0, 6)], lambda _r: [7, 8])
    plan = s.build([Scheduled("a", [*tokens, 1, 2], 7, 1)], lambda _r: [7, 8])
    assert plan.saves == []


def test_storage_hit_is_asynchronous_and_reserves_host_slots() -> None:
    store = Exists()
    s = side(store=store)
    for key in chain_keys(PROMPT, BS)[:3]:
        store.held.add(str(StoreKey(namespace="t", pool="kv-r0", page_hash=key.hex())))
    assert s.match("a", PROMPT, 0) == (12, True)
    s.after_alloc("a", [5, 6, 7, 8, 9], 12)
    plan = s.build([], lambda _r: [])
    (op,) = plan.async_loads
    assert op.from_storage == (True, True, True)
    assert op.blocks == (5, 6, 7)
    s.on_events([Event(Op.READ, op.keys[0], True), Event(Op.READ, op.keys[1], False)])
    s.on_events([Event(Op.LOAD, key, True) for key in op.keys])
    # the page whose read failed is not offered again (vLLM reschedules at once)
    assert s.match("b", PROMPT, 0) == (4, False)


def test_a_hit_counts_only_where_every_rank_has_the_page() -> None:
    store = Exists()
    s = side(store=store, ranks=2)
    keys = chain_keys(PROMPT, BS)
    for key in keys[:3]:
        store.held.add(str(StoreKey(namespace="t", pool="kv-r0", page_hash=key.hex())))
    store.held.add(str(StoreKey(namespace="t", pool="kv-r1", page_hash=keys[0].hex())))
    assert s.match("a", PROMPT, 0) == (4, True)  # rank 1 holds only the first page


def test_host_save_is_ready_only_after_every_rank_reported() -> None:
    s = side(ranks=2)
    events = prefill(s, "a", PROMPT, [0, 1, 2, 3, 4])
    s.on_events(events)  # rank 0
    assert s.match("b", PROMPT, 0) == (0, False)
    s.on_events([Event(e.op, e.key, e.ok) for e in events][:2])  # rank 1: two pages ok
    s.on_events([Event(e.op, e.key, False) for e in events][2:])  # and two failed
    assert s.match("b", PROMPT, 0) == (8, False)


@pytest.mark.parametrize("ranks", [1, 2, 4])
def test_agreement_settles_once_per_op_after_every_rank(ranks: int) -> None:
    a = Agreement(ranks)
    key = b"k" * 32
    for r in range(ranks - 1):
        assert a.add([Event(Op.SAVE, key, r != 0)]) == []
    assert a.add([Event(Op.SAVE, key, True)]) == [(Op.SAVE, key, ranks == 1)]
    assert a.waiting == 0


def test_full_host_tier_skips_saves_instead_of_failing() -> None:
    s = side(slots=2)
    s.match("a", PROMPT, 0)
    plan = s.build([Scheduled("a", PROMPT, 0, 17)], lambda _r: [0, 1, 2, 3, 4])
    assert len(plan.saves) == 2
    assert s.stats.snapshot()["save_errors"] == 2


def test_a_request_vllm_fully_hit_still_saves_its_new_blocks() -> None:
    s = side()
    tokens = PROMPT[:8]
    assert s.match("a", tokens, 4) == (0, False)  # vLLM's own cache has all it may hit
    plan = s.build([Scheduled("a", tokens, 4, 4)], lambda _r: [3, 9])
    assert [op.block for op in plan.saves] == [3, 9]
