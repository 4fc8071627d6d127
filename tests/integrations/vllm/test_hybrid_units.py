"""Hybrid models (state groups beside one attention group) without vLLM: where a hit may end,
when a state is saved, and that a failed hybrid load leaves nothing pinned and fails the whole
request instead of reporting blocks."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest
import torch

from hicache.adapters.storage import DirectorySettings, DirectoryStore
from hicache.domain import DeviceError
from hicache.domain.keys import chain_keys
from hicache.domain.load_choice import attention_work
from hicache.domain.storage import StoreKey
from hicache.engine.bounded import BoundedStorage
from hicache.integrations.vllm.load_policy import LoadPolicy
from hicache.integrations.vllm.plan import (
    Event,
    LoadOp,
    Op,
    SaveOp,
    StateLoad,
    StateSave,
    StepPlan,
    state_key,
    store_key,
)
from hicache.integrations.vllm.scheduler import Scheduled, SchedulerSide
from hicache.integrations.vllm.stats import ConnectorStats
from hicache.integrations.vllm.worker import WorkerTransfers, block_rows, state_rows

BS = 4
PROMPT = list(range(1, 18))  # 4 full blocks and 1 token: a hit may end at boundary 1..4
GROUPS = 2  # state groups


class Exists:
    def __init__(self) -> None:
        self.held: set[str] = set()

    def exists(self, keys: Sequence[StoreKey], *, deadline: float | None = None) -> list[bool]:
        return [str(k) in self.held for k in keys]

    name = "exists"

    def close(self) -> None:
        pass


def _store_keys(page: bytes) -> list[StoreKey]:
    return [store_key("t", 0, page)]


def side(store: Exists | None = None, state_slots: int = 8) -> SchedulerSide:
    return SchedulerSide(
        block_size=BS,
        host_slots=16,
        store=BoundedStorage(store) if store is not None else None,  # type: ignore[arg-type]
        store_keys=_store_keys,
        write_storage=store is not None,
        save_decode=True,
        ranks=1,
        stats=ConnectorStats(),
        state_groups=GROUPS,
        state_slots=state_slots,
    )


def state_ids(blocks: int) -> list[list[int]]:
    """Each state group's block ids: group g's block at index i is 100 * (g + 1) + i."""
    return [[100 * (g + 1) + i for i in range(blocks)] for g in range(GROUPS)]


def run_step(s: SchedulerSide, rid: str, tokens: list[int], done: int, n: int) -> StepPlan:
    """One step of ``n`` tokens after ``done``; every save in it is reported done."""
    plan = s.build(
        [Scheduled(rid, tokens, done, n)],
        lambda _r: list(range(10, 20)),
        lambda _r: state_ids(5),
    )
    s.on_events([Event(Op.SAVE, op.key, True) for op in [*plan.saves, *plan.state_saves]])
    return plan


def test_a_state_is_saved_only_where_a_step_ends_on_a_block_boundary() -> None:
    s = side()
    s.match("a", PROMPT, 0)
    first = run_step(s, "a", PROMPT, 0, 12)  # ends at boundary 3
    assert [(op.blocks, op.key) for op in first.state_saves] == [
        ((102, 202), state_key(chain_keys(PROMPT, BS)[2]))
    ]
    second = run_step(s, "a", PROMPT, 12, 5)  # ends at 17: no state there
    assert second.state_saves == []
    assert len(first.saves) + len(second.saves) == 4


def test_a_hybrid_hit_ends_at_the_deepest_boundary_with_a_state() -> None:
    s = side()
    s.match("a", PROMPT, 0)
    run_step(s, "a", PROMPT, 0, 8)  # state at boundary 2
    run_step(s, "a", PROMPT, 8, 9)  # KV of blocks 2 and 3, no state at 3 or 4
    assert s.match("b", PROMPT, 0) == (8, True)  # always asynchronous
    assert s.match("c", PROMPT, 8) == (0, False)  # vLLM holds 2 blocks: no deeper state


def test_kv_without_a_state_is_no_hybrid_hit() -> None:
    s = side()
    s.match("a", PROMPT, 0)
    s.on_events(
        [
            Event(Op.SAVE, op.key, True)
            for op in s.build([Scheduled("a", PROMPT, 0, 17)], lambda _r: list(range(5))).saves
        ]
    )  # no state ids given: KV only
    assert len(s.index) == 4
    assert s.match("b", PROMPT, 0) == (0, False)


def test_a_state_in_the_store_counts_where_every_kv_block_is_held() -> None:
    store = Exists()
    s = side(store)
    keys = chain_keys(PROMPT, BS)
    for k in keys[:3]:
        store.held.add(str(_store_keys(k)[0]))
    store.held.add(str(_store_keys(state_key(keys[1]))[0]))  # state at boundary 2
    store.held.add(str(_store_keys(state_key(keys[3]))[0]))  # at 4: KV block 3 is missing
    assert s.match("a", PROMPT, 0) == (8, True)
    s.after_alloc("a", [50, 51, 52], 8, state_ids(2))
    (op,) = s.build([], lambda _r: []).async_loads
    assert op.blocks == (50, 51)
    assert op.state is not None
    assert op.state.blocks == (101, 201)
    assert op.state.from_storage
    assert op.all_or_nothing


def test_a_state_evicted_before_alloc_unpins_everything_and_plans_no_copy() -> None:
    s = side(state_slots=1)
    s.match("a", PROMPT, 0)
    run_step(s, "a", PROMPT, 0, 8)  # state at boundary 2 (the only state slot)
    assert s.match("b", PROMPT, 0) == (8, True)
    s.match("x", [7, *PROMPT[1:]], 0)
    run_step(s, "x", [7, *PROMPT[1:]], 0, 4)  # another state evicts b's
    s.after_alloc("b", [60, 61, 62], 8, state_ids(2))
    (op,) = s.build([], lambda _r: []).async_loads
    assert op.keys == ()
    assert op.state is None
    assert op.missing == (60, 61)
    assert op.all_or_nothing
    # nothing stays pinned: every page b's hit took is evictable again
    assert s.states is not None
    held, states = len(s.index), len(s.states)
    assert s.index.clear_unpinned() == held
    assert s.states.clear_unpinned() == states


# ---- the worker ----------------------------------------------------------------------------

BLOCKS = 6
STATE_USED, STATE_PAGE = 24, 32  # vLLM pads every state page to a common page size


def shared_buffer() -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    return torch.randint(-128, 127, (BLOCKS * STATE_PAGE * 4,), generator=g, dtype=torch.int8)


def state_view(buf: torch.Tensor, layer: int) -> torch.Tensor:
    """A state layer's cache as vLLM registers it: (blocks, 1, 1, used) int8, row stride =
    the padded page, every layer a view of one shared buffer at its own offset."""
    return buf.as_strided((BLOCKS, 1, 1, STATE_USED), (STATE_PAGE * 4, 0, 0, 1), layer * 64)


def hybrid_worker(store: DirectoryStore | None = None) -> tuple[WorkerTransfers, torch.Tensor]:
    buf = shared_buffer()
    kv = torch.zeros(BLOCKS, 2, 8, dtype=torch.bfloat16)
    layers = [("attn", block_rows("attn", kv, BLOCKS))]
    states = [(f"gdn{g}", g, state_rows(f"gdn{g}", state_view(buf, g), BLOCKS)) for g in (0, 1)]
    w = WorkerTransfers(
        layers,
        host_bytes=4 * 32,
        store=BoundedStorage(store) if store is not None else None,
        store_key=lambda page: _store_keys(page)[0],
        stats=ConnectorStats(),
        state_layers=states,
        state_host_bytes=4 * 2 * STATE_USED,
    )
    return w, buf


def test_state_rows_skip_the_padding_and_refuse_a_scattered_block() -> None:
    buf = shared_buffer()
    rows = state_rows("gdn0", state_view(buf, 0), BLOCKS)
    assert rows.shape == (BLOCKS, STATE_USED)
    assert torch.equal(rows[2], buf[2 * 128 : 2 * 128 + STATE_USED].view(torch.uint8))
    scattered = buf.as_strided((BLOCKS, 2, 12), (128, 1, 2))
    with pytest.raises(DeviceError, match="one run of bytes"):
        state_rows("gdn0", scattered, BLOCKS)


def test_states_saved_then_loaded_land_in_each_groups_own_block(tmp_path: Path) -> None:
    w, _ = hybrid_worker(DirectoryStore(DirectorySettings(root=tmp_path)))
    rows = {name: r for name, _, r in w.state_layers}
    before = (rows["gdn0"][1].clone(), rows["gdn1"][3].clone())
    skey = state_key(b"k" * 32)
    w.start_step(StepPlan(state_saves=[StateSave("r", skey, 0, (1, 3), True)]))
    w.finish_step()
    w.wait_idle()
    assert {(e.op, e.ok) for e in w.drain_events()} == {(Op.SAVE, True), (Op.STORE, True)}
    w.state_host.zero_()  # only the store has the state now
    op = LoadOp("q", (), (), (), (), state=StateLoad(skey, 1, (4, 5), True), all_or_nothing=True)
    w.start_step(StepPlan(async_loads=[op]))
    w.finish_step()
    w.wait_idle()
    assert w.drain_finished() == {"q"}
    assert w.drain_failed() == set()
    assert torch.equal(rows["gdn0"][4], before[0])
    assert torch.equal(rows["gdn1"][5], before[1])
    w.close()


def test_a_failed_state_read_fails_the_request_and_copies_nothing(tmp_path: Path) -> None:
    w, _ = hybrid_worker(DirectoryStore(DirectorySettings(root=tmp_path)))
    kv = w.rows["attn"]
    w.start_step(StepPlan(saves=[SaveOp("r", b"p" * 32, 0, 1, True)]))
    w.finish_step()
    w.wait_idle()
    w.drain_events()
    kv[2].fill_(7)
    op = LoadOp(
        "q",
        (b"p" * 32,),
        (0,),
        (2,),
        (False,),
        state=StateLoad(state_key(b"never saved" * 3), 0, (4, 5), True),
        all_or_nothing=True,
    )
    w.start_step(StepPlan(async_loads=[op]))
    w.finish_step()
    w.wait_idle()
    assert w.drain_failed() == {"q"}
    assert w.drain_finished() == {"q"}
    assert w.drain_errors() == set()  # vLLM refuses block errors with several groups
    assert bool((kv[2] == 7).all())  # the KV block was not touched either
    loads = {e.key: e.ok for e in w.drain_events() if e.op is Op.LOAD}
    assert loads == {b"p" * 32: True, op.state.key: True}  # pins end; the pages are fine
    w.close()


def test_a_hybrid_hit_not_worth_loading_is_declined_whole() -> None:
    """load_policy measured on a hybrid model: the hit ends at a state, so it is offered whole
    or not at all (here host copies slower than computing the tokens)."""
    s = side()
    s.match("a", PROMPT, 0)
    run_step(s, "a", PROMPT, 0, 8)  # state at boundary 2
    assert s.match("b", PROMPT, 0) == (8, True)
    policy = LoadPolicy("measured", clock=lambda: 0.0)
    policy.prefill.observe(64, attention_work(64, 0), 0.064)  # 1 ms a token
    policy.host.per_page_s = 1.0  # a block of 4 tokens takes 250x its compute to copy
    s.policy = policy
    assert s.match("c", PROMPT, 0) == (0, False)
    s.after_alloc("c", [], 0)
    assert s.stats.snapshot()["declined_tokens"] == 8
    policy.host.per_page_s = 0.0001
    assert s.match("d", PROMPT, 0) == (8, True)
