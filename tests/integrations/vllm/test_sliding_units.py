"""Sliding-window groups under vLLM's hybrid KV cache manager, without vLLM: which window
pages are saved, where a hit may end (every KV page before it, the window pages vLLM keeps
before it, and a state where the model has one), what a hit loads into which blocks, and the
worker's copies of window pages."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest
import torch

from hicache.adapters.storage import DirectorySettings, DirectoryStore
from hicache.domain import ConfigError
from hicache.domain.keys import chain_keys
from hicache.domain.storage import StoreKey
from hicache.engine.bounded import BoundedStorage
from hicache.integrations.vllm.hybrid_hits import window_pages
from hicache.integrations.vllm.plan import (
    Event,
    LoadOp,
    Op,
    StateLoad,
    StateSave,
    StepPlan,
    state_key,
    store_key,
    window_key,
)
from hicache.integrations.vllm.scheduler import Scheduled, SchedulerSide
from hicache.integrations.vllm.stats import ConnectorStats
from hicache.integrations.vllm.worker import WorkerTransfers, block_rows

BS = 4
PROMPT = list(range(1, 34))  # 8 full blocks and 1 token: a hit may end at boundary 1..8
KEYS = chain_keys(PROMPT, BS)
GROUPS = 2  # sliding-window groups
WINDOW_TOKENS = 7  # a window of 8 tokens: the next token reads the 7 before it (2 blocks)


class Exists:
    def __init__(self) -> None:
        self.held: set[str] = set()

    def exists(self, keys: Sequence[StoreKey], *, deadline: float | None = None) -> list[bool]:
        return [str(k) in self.held for k in keys]

    name = "exists"

    def close(self) -> None:
        pass

    def add(self, page: bytes) -> None:
        self.held.add(str(_store_keys(page)[0]))


def _store_keys(page: bytes) -> list[StoreKey]:
    return [store_key("t", 0, page)]


def side(store: Exists | None = None, *, states: int = 0, window_slots: int = 16) -> SchedulerSide:
    return SchedulerSide(
        block_size=BS,
        host_slots=16,
        store=BoundedStorage(store) if store is not None else None,  # type: ignore[arg-type]
        store_keys=_store_keys,
        write_storage=False,
        save_decode=True,
        ranks=1,
        stats=ConnectorStats(),
        state_groups=states,
        state_slots=8 if states else 0,
        window_groups=GROUPS,
        window_tokens=WINDOW_TOKENS,
        window_slots=window_slots,
    )


def window_ids(blocks: int, null_below: int = 0) -> list[list[int]]:
    """Each sliding group's block ids: group g's block i is 100 * (g + 1) + i, vLLM's null
    block (0) below ``null_below`` (blocks it freed outside the window)."""
    return [
        [0 if i < null_below else 100 * (g + 1) + i for i in range(blocks)] for g in range(GROUPS)
    ]


def run_prefill(
    s: SchedulerSide, rid: str = "a", null_below: int = 0, states: bool = False
) -> StepPlan:
    """One step computing the whole prompt (with states: its 8 blocks, ending on a boundary
    whose state is saved); every save reported done."""
    s.match(rid, PROMPT, 0)
    plan = s.build(
        [Scheduled(rid, PROMPT, 0, 8 * BS if states else len(PROMPT))],
        lambda _r: list(range(10, 20)),
        (lambda _r: [list(range(200, 209))]) if states else None,
        lambda _r: window_ids(9, null_below),
    )
    s.on_events([Event(Op.SAVE, op.key, True) for op in [*plan.saves, *plan.state_saves]])
    return plan


def drop_window(s: SchedulerSide, page: int) -> None:
    assert s.windows is not None
    s.windows.drop(window_key(KEYS[page]))


@pytest.mark.parametrize(
    ("window", "block", "extra"), [(8, 4, 0), (9, 4, 0), (64, 32, 0), (4096, 16, 0), (64, 32, 5)]
)
def test_window_pages_are_the_blocks_vllm_keeps_before_a_boundary(
    window: int, block: int, extra: int
) -> None:
    """vLLM (SlidingWindowManager.get_num_skipped_tokens) frees the first
    ``T - window + 1 - extra`` tokens' whole blocks of ``T`` computed; a boundary of ``b``
    blocks keeps the rest."""
    need = window_pages(window - 1 + extra, block)
    for b in range(need, need + 40):
        skipped_blocks = max(0, b * block - window + 1 - extra) // block
        assert b - skipped_blocks == need


def test_window_pages_of_no_window_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="0 tokens"):
        window_pages(0, 4)


def test_every_block_vllm_holds_in_every_sliding_group_is_saved_as_a_window_page() -> None:
    plan = run_prefill(side(), null_below=3)  # blocks 0-2 already freed (null) in the groups
    saved = {op.key: op.blocks for op in plan.state_saves}
    assert saved == {window_key(KEYS[i]): (100 + i, 200 + i) for i in range(3, 8)}
    assert len(plan.saves) == 8  # the full-attention pages: every block


def test_a_hit_needs_only_the_window_pages_before_its_boundary() -> None:
    s = side()
    run_prefill(s)
    drop_window(s, 2)  # outside boundary 8's window (pages 6, 7)
    assert s.match("b", PROMPT, 0) == (8 * BS, True)  # all or nothing: asynchronous


@pytest.mark.parametrize(("lost", "end"), [(7, 7), (6, 6), (0, 8)])
def test_a_lost_window_page_ends_the_hit_where_every_window_is_whole(lost: int, end: int) -> None:
    """Boundary b needs window pages b-2 and b-1: losing page 7 leaves boundary 7 the deepest,
    losing page 6 boundary 6 (7 and 8 need it); losing page 0 costs nothing at 8."""
    s = side()
    run_prefill(s)
    drop_window(s, lost)
    assert s.match("b", PROMPT, 0) == (end * BS, True)


def test_window_pages_lost_at_every_boundary_make_a_miss() -> None:
    s = side()
    run_prefill(s)
    for page in (0, 2, 4, 6):  # every boundary's window has one of them
        drop_window(s, page)
    assert s.match("b", PROMPT, 0) == (0, False)


def test_a_lost_full_attention_page_ends_the_hit_before_it() -> None:
    s = side()
    run_prefill(s)
    s.index.drop(KEYS[5])
    assert s.match("b", PROMPT, 0) == (5 * BS, True)


def test_vllms_own_hit_holds_the_window_before_it() -> None:
    """vLLM hit 6 blocks itself (its sliding groups hold blocks 4 and 5): hicache adds 6..8
    with window pages 6 and 7 only; page 5 lost changes nothing."""
    s = side()
    run_prefill(s)
    drop_window(s, 5)
    assert s.match("b", PROMPT, 6 * BS) == (2 * BS, True)


def test_a_hit_loads_the_window_pages_into_the_blocks_vllm_keeps() -> None:
    s = side()
    run_prefill(s)
    assert s.match("b", PROMPT, 0) == (8 * BS, True)
    s.after_alloc("b", list(range(50, 58)), 8 * BS, (), window_ids(8, null_below=6))
    (op,) = s.build([], lambda _r: []).async_loads
    assert op.blocks == tuple(range(50, 58))
    assert [(w.key, w.blocks, w.from_storage) for w in op.windows] == [
        (window_key(KEYS[6]), (106, 206), False),
        (window_key(KEYS[7]), (107, 207), False),
    ]
    assert op.all_or_nothing
    assert op.missing == ()
    assert s.windows is not None
    assert s.windows.pin_count(window_key(KEYS[7])) == 1


def test_a_block_vllm_keeps_without_a_page_plans_no_copy_and_unpins_everything() -> None:
    """vLLM's sliding groups keep blocks 5..7 (a wider window than hicache planned): the hit
    is not loaded (vLLM recomputes the request) and no page stays pinned."""
    s = side()
    run_prefill(s)
    assert s.match("b", PROMPT, 0) == (8 * BS, True)
    drop_window(s, 5)
    s.after_alloc("b", list(range(50, 58)), 8 * BS, (), window_ids(8, null_below=5))
    (op,) = s.build([], lambda _r: []).async_loads
    assert (op.keys, op.windows, op.state) == ((), (), None)
    assert op.missing == tuple(range(50, 58))
    assert s.windows is not None
    assert s.index.clear_unpinned() == 8
    assert s.windows.clear_unpinned() == 7


def test_window_pages_in_the_store_are_read_with_the_kv_pages() -> None:
    store = Exists()
    s = side(store)
    for p in range(8):
        store.add(KEYS[p])
    for p in (5, 6):  # boundary 7's window; 8 lacks page 7
        store.add(window_key(KEYS[p]))
    assert s.match("b", PROMPT, 0) == (7 * BS, True)
    s.after_alloc("b", list(range(50, 57)), 7 * BS, (), window_ids(7, null_below=5))
    (op,) = s.build([], lambda _r: []).async_loads
    assert op.from_storage == (True,) * 7
    assert [(w.key, w.from_storage) for w in op.windows] == [
        (window_key(KEYS[5]), True),
        (window_key(KEYS[6]), True),
    ]


def test_with_state_groups_a_hit_needs_the_state_and_the_window_at_one_boundary() -> None:
    """States at 8 (the step's end) only: losing window page 7 leaves no boundary with both."""
    s = side(states=1)
    run_prefill(s, states=True)
    assert s.match("b", PROMPT, 0) == (8 * BS, True)
    drop_window(s, 7)
    assert s.match("c", PROMPT, 0) == (0, False)


# ---- the worker ----------------------------------------------------------------------------

BLOCKS = 8


def sliding_worker(store: DirectoryStore | None) -> WorkerTransfers:
    g = torch.Generator().manual_seed(0)
    caches = {n: torch.randn(BLOCKS, 2, 8, generator=g) for n in ("full", "swa0", "swa1")}
    rows = {n: block_rows(n, t, BLOCKS) for n, t in caches.items()}
    return WorkerTransfers(
        [("full", rows["full"])],
        host_bytes=4 * rows["full"].shape[1],
        store=BoundedStorage(store) if store is not None else None,
        store_key=lambda page: _store_keys(page)[0],
        stats=ConnectorStats(),
        window_layers=[("swa0", 0, rows["swa0"]), ("swa1", 1, rows["swa1"])],
        window_host_bytes=4 * 2 * rows["swa0"].shape[1],
    )


def test_window_pages_saved_then_read_from_the_store_land_in_each_groups_block(
    tmp_path: Path,
) -> None:
    w = sliding_worker(DirectoryStore(DirectorySettings(root=tmp_path)))
    swa = {name: rows for name, _, rows in w.window_layers}
    before = (swa["swa0"][1].clone(), swa["swa1"][3].clone())
    wkey = window_key(KEYS[0])
    w.start_step(StepPlan(state_saves=[StateSave("r", wkey, 2, (1, 3), True)]))
    w.finish_step()
    w.wait_idle()
    assert {(e.op, e.ok, e.nbytes) for e in w.drain_events()} == {
        (Op.SAVE, True, w.tier.window_bytes),
        (Op.STORE, True, w.tier.window_bytes),
    }
    w.tier.windows.zero_()  # only the store has the window page now
    op = LoadOp(
        "q", (), (), (), (), windows=(StateLoad(wkey, 0, (6, 7), True),), all_or_nothing=True
    )
    w.start_step(StepPlan(async_loads=[op]))
    w.finish_step()
    w.wait_idle()
    assert w.drain_finished() == {"q"}
    assert w.drain_failed() == set()
    assert torch.equal(swa["swa0"][6], before[0])
    assert torch.equal(swa["swa1"][7], before[1])
    w.close()


def test_a_failed_window_read_fails_the_request_and_copies_nothing(tmp_path: Path) -> None:
    w = sliding_worker(DirectoryStore(DirectorySettings(root=tmp_path)))
    kv = w.rows["full"]
    kv[2].fill_(7)
    op = LoadOp(
        "q",
        (KEYS[0],),
        (0,),
        (2,),
        (False,),
        windows=(StateLoad(window_key(b"never saved" * 3), 0, (4, 5), True),),
        all_or_nothing=True,
    )
    w.start_step(StepPlan(async_loads=[op]))
    w.finish_step()
    w.wait_idle()
    assert w.drain_failed() == {"q"}
    assert bool((kv[2] == 7).all())  # the KV block was not touched either
    w.close()


def test_a_state_key_and_a_window_key_of_one_block_are_different_store_objects() -> None:
    (a,), (b,) = _store_keys(state_key(KEYS[0])), _store_keys(window_key(KEYS[0]))
    assert (a.pool, b.pool) == ("state-r0", "swa-r0")
    assert a.page_hash == b.page_hash


# ---- one sliding-window group (a model whose every layer slides: a dense layout) ------------


def dense_side(states: int = 0, store: Exists | None = None) -> SchedulerSide:
    """One sliding group as the attention group (vLLM's null blocks), with ``states`` state
    groups beside it (then a hit needs only the last WINDOW_TOKENS' pages)."""
    return SchedulerSide(
        block_size=BS,
        host_slots=16,
        store=BoundedStorage(store) if store is not None else None,  # type: ignore[arg-type]
        store_keys=_store_keys,
        write_storage=False,
        save_decode=True,
        ranks=1,
        stats=ConnectorStats(),
        state_groups=states,
        state_slots=8 if states else 0,
        window_tokens=WINDOW_TOKENS if states else 0,
        null_blocks=True,
    )


def test_one_sliding_group_saves_no_block_vllm_freed_and_loads_none_into_its_null_block() -> None:
    s = dense_side()
    s.match("a", PROMPT, 0)
    freed = [0, 0, 12, 13, 14, 15, 16, 17]  # vLLM's null block where it freed blocks 0 and 1
    plan = s.build([Scheduled("a", PROMPT, 0, len(PROMPT))], lambda _r: freed)
    assert [op.block for op in plan.saves] == freed[2:]
    s.on_events([Event(Op.SAVE, op.key, True) for op in plan.saves])
    s.index.drop(KEYS[0])  # never saved anyway
    assert s.match("b", PROMPT, 0) == (0, False)  # the dense rule: every page from the first
    s.match("c", PROMPT, 2 * BS)  # vLLM's own hit covers blocks 0 and 1
    s.after_alloc("c", [0, 0, 0, 0, 0, 0, 56, 57], 6 * BS)  # its window: blocks 6 and 7
    (op,) = s.build([], lambda _r: []).loads
    assert op.blocks == (56, 57)
    assert op.keys == tuple(KEYS[6:8])


# ---- one sliding-window group beside state groups (NemotronH with a sliding_window) ---------


def prefill_sliding_state(s: SchedulerSide, attn_ids: Sequence[int]) -> StepPlan:
    """The prompt's 8 blocks in one step (vLLM holds ``attn_ids`` in its sliding group), the
    state at boundary 8 saved; every save reported done."""
    s.match("a", PROMPT, 0)
    plan = s.build(
        [Scheduled("a", PROMPT, 0, 8 * BS)],
        lambda _r: list(attn_ids),
        lambda _r: [list(range(200, 209))],
    )
    s.on_events([Event(Op.SAVE, op.key, True) for op in [*plan.saves, *plan.state_saves]])
    return plan


def test_a_sliding_group_beside_state_loads_only_its_window_and_the_state() -> None:
    """vLLM allocates real blocks only for the window of the hit's end (blocks 6 and 7 here)
    and the state group's block of the boundary: the pages of blocks 6 and 7 and the state at
    8 are loaded, nothing into the null blocks, and every token of the hit counts as hit."""
    s = dense_side(states=1)
    plan = prefill_sliding_state(s, range(10, 18))
    assert [op.block for op in plan.saves] == list(range(10, 18))
    assert [op.key for op in plan.state_saves] == [state_key(KEYS[7])]
    assert s.match("b", PROMPT, 0) == (8 * BS, True)
    s.after_alloc("b", [0, 0, 0, 0, 0, 0, 56, 57], 8 * BS, [[0, 0, 0, 0, 0, 0, 0, 307]])
    plan = s.build([], lambda _r: [])
    (op,) = plan.async_loads
    assert op.blocks == (56, 57)
    assert op.keys == tuple(KEYS[6:8])
    assert op.state is not None
    assert (op.state.key, op.state.blocks) == (state_key(KEYS[7]), (307,))
    assert op.all_or_nothing
    assert op.missing == ()
    assert s.stats.snapshot()["hit_tokens_host"] == 8 * BS
    assert s.index.pin_count(KEYS[7]) == 1
    assert s.index.pin_count(KEYS[0]) == 0  # outside the window: neither pinned nor loaded


def test_a_sliding_group_beside_state_saves_no_block_vllm_freed() -> None:
    """A request that starts from vLLM's own hit: its sliding group's blocks before the
    window are the null block and are not saved."""
    s = dense_side(states=1)
    plan = prefill_sliding_state(s, [0, 0, 0, 0, 0, 15, 16, 17])
    assert [op.block for op in plan.saves] == [15, 16, 17]


@pytest.mark.parametrize(("lost", "hit"), [(2, 8), (0, 8), (6, 0), (7, 0)])
def test_a_sliding_group_beside_state_needs_only_the_pages_of_its_window(
    lost: int, hit: int
) -> None:
    """Boundary 8 (the only one with a state) needs pages 6 and 7: a page lost before them
    costs nothing, one of them lost makes a miss, never a wrong load."""
    s = dense_side(states=1)
    prefill_sliding_state(s, range(10, 18))
    s.index.drop(KEYS[lost])
    assert s.match("b", PROMPT, 0) == (hit * BS, hit > 0)


def test_a_sliding_group_beside_state_reads_its_window_and_state_from_the_store() -> None:
    """A new server (empty host tier): the store holds pages 6 and 7 and the state at 8 only;
    the hit reads those three, and its tokens count as the store's for those two pages."""
    store = Exists()
    for p in (6, 7):
        store.add(KEYS[p])
    store.add(state_key(KEYS[7]))
    s = dense_side(states=1, store=store)
    assert s.match("b", PROMPT, 0) == (8 * BS, True)
    s.after_alloc("b", [0, 0, 0, 0, 0, 0, 56, 57], 8 * BS, [[0, 0, 0, 0, 0, 0, 0, 307]])
    (op,) = s.build([], lambda _r: []).async_loads
    assert (op.keys, op.blocks, op.from_storage) == (tuple(KEYS[6:8]), (56, 57), (True, True))
    assert op.state is not None
    assert op.state.from_storage
    assert s.hit_sources("b", 8 * BS) == (6 * BS, 2 * BS)
    got = s.stats.snapshot()
    assert (got["hit_tokens_host"], got["hit_tokens_storage"]) == (6 * BS, 2 * BS)


def test_a_sliding_group_beside_state_whose_blocks_vllm_keeps_lack_a_page_loads_nothing() -> None:
    """vLLM keeps blocks 5..7 (a wider window than hicache planned) and page 5 is gone: the
    request is recomputed whole and nothing stays pinned."""
    s = dense_side(states=1)
    prefill_sliding_state(s, range(10, 18))
    assert s.match("b", PROMPT, 0) == (8 * BS, True)
    s.index.drop(KEYS[5])
    s.after_alloc("b", [0, 0, 0, 0, 0, 55, 56, 57], 8 * BS, [[0, 0, 0, 0, 0, 0, 0, 307]])
    (op,) = s.build([], lambda _r: []).async_loads
    assert (op.keys, op.state) == ((), None)
    assert op.missing == (55, 56, 57)
    assert s.index.pin_count(KEYS[7]) == 0
    assert s.states is not None
    assert s.states.pin_count(state_key(KEYS[7])) == 0
