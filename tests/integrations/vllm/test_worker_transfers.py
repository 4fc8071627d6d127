"""The worker's data path without vLLM: whole-block copies, store writes and reads, failures."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from hicache.adapters.copy.rows import RowCopier
from hicache.adapters.storage import DirectorySettings, DirectoryStore
from hicache.domain import DeviceError, TransferError
from hicache.domain.storage import StoreKey
from hicache.integrations.vllm.plan import LoadOp, Op, SaveOp, StepPlan
from hicache.integrations.vllm.stats import ConnectorStats
from hicache.integrations.vllm.worker import WorkerTransfers, block_rows, choose_copier
from tests.integrations.vllm.worker_helpers import BLOCKS, caches, key, transfers

ARRANGEMENTS = ["layers", "blocks"]


@pytest.mark.parametrize("arrangement", ARRANGEMENTS)
def test_blocks_saved_then_loaded_into_other_blocks_are_byte_identical(arrangement: str) -> None:
    c = caches(arrangement)
    w = transfers(c)
    # a block's layers side by side: saved as one row per page
    assert (w.page_rows is not None) == (arrangement == "blocks")
    before = {n: t[2].clone() for n, t in c.items()}
    w.start_step(StepPlan(saves=[SaveOp("r", key(1), 3, 2, False)]))
    w.save_layer("layer.0")  # vLLM reports layers as they are computed
    w.finish_step()
    w.wait_saves()  # saves settle off the step
    assert [(e.op, e.ok) for e in w.drain_events()] == [(Op.SAVE, True)]
    w.start_step(StepPlan(loads=[LoadOp("q", (key(1),), (3,), (5,), (False,))]))
    for n in c:
        w.wait_layer(n)
        assert torch.equal(c[n][5], before[n])
    w.finish_step()
    w.wait_saves()  # saves settle off the step
    assert [(e.op, e.ok) for e in w.drain_events()] == [(Op.LOAD, True)]
    assert w.drain_errors() == set()
    w.close()


@pytest.mark.parametrize("arrangement", ARRANGEMENTS)
def test_store_write_then_async_read_restores_the_blocks(tmp_path: Path, arrangement: str) -> None:
    c = caches(arrangement)
    store = DirectoryStore(DirectorySettings(root=tmp_path))
    w = transfers(c, store)
    before = {n: t[1].clone() for n, t in c.items()}
    w.start_step(StepPlan(saves=[SaveOp("r", key(1), 0, 1, True)]))
    w.finish_step()
    w.wait_idle()
    assert {(e.op, e.ok) for e in w.drain_events()} == {(Op.SAVE, True), (Op.STORE, True)}
    w.host.zero_()  # the host copy is gone: the store must supply the bytes
    w.start_step(StepPlan(async_loads=[LoadOp("q", (key(1),), (2,), (6,), (True,))]))
    w.finish_step()
    w.wait_idle()
    assert w.drain_finished() == {"q"}
    assert {(e.op, e.ok) for e in w.drain_events()} == {(Op.READ, True), (Op.LOAD, True)}
    for n in c:
        assert torch.equal(c[n][6], before[n])
    w.close()


def test_a_missing_store_page_is_a_load_error_for_it_and_the_blocks_after(tmp_path: Path) -> None:
    c = caches()
    w = transfers(c, DirectoryStore(DirectorySettings(root=tmp_path)))
    w.start_step(StepPlan(saves=[SaveOp("r", key(1), 0, 1, True)]))
    w.finish_step()
    w.wait_idle()
    w.drain_events()
    op = LoadOp(
        "q", (key(1), key(2), key(3)), (1, 2, 3), (5, 6, 7), (True, True, True), missing=(4,)
    )
    w.start_step(StepPlan(async_loads=[op]))
    w.finish_step()
    w.wait_idle()
    assert w.drain_finished() == {"q"}
    assert w.drain_errors() == {6, 7, 4}
    reads = {e.key: e.ok for e in w.drain_events() if e.op is Op.READ}
    assert reads == {key(1): True, key(2): False, key(3): False}
    w.close()


def test_a_cache_without_blocks_first_is_refused() -> None:
    t = torch.zeros(2, BLOCKS, 4)
    with pytest.raises(DeviceError, match="blocks first"):
        block_rows("layer.0", t, BLOCKS)
    # blocks first in the shape, but another dimension outside them in memory
    with pytest.raises(DeviceError, match="one dense run"):
        block_rows("layer.0", torch.zeros(4, BLOCKS, 4).transpose(0, 1), BLOCKS)
    # a block with holes (every other element)
    with pytest.raises(DeviceError, match="one dense run"):
        block_rows("layer.0", torch.zeros(BLOCKS, 8)[:, ::2], BLOCKS)


def test_a_block_in_another_inner_order_is_one_row_of_its_bytes_in_memory_order() -> None:
    t = torch.arange(BLOCKS * 12, dtype=torch.float32).view(BLOCKS, 3, 4).transpose(1, 2)
    rows = block_rows("layer.0", t, BLOCKS)
    for b in range(BLOCKS):
        assert torch.equal(rows[b], t[b].transpose(0, 1).contiguous().view(torch.uint8).flatten())


def test_a_dimension_of_one_with_any_stride_leaves_the_block_one_row() -> None:
    # vLLM's CPU cache of a one-head layer: [blocks, K/V, tokens, 1 head, dim], whose head
    # dimension's stride is the dim's; the row is the block's bytes all the same
    dense = torch.arange(BLOCKS * 2 * 16 * 8, dtype=torch.float32).to(torch.bfloat16)
    t = dense.view(BLOCKS, 2, 16, 1, 8)
    assert t.stride() == (256, 128, 8, 8, 1)
    rows = block_rows("layer.0", t, BLOCKS)
    assert torch.equal(rows, dense.view(torch.uint8).view(BLOCKS, -1))


@pytest.mark.parametrize("backend", ["native", "torch"])
def test_both_copy_backends_move_the_same_bytes(backend: str) -> None:
    c = caches()
    layers = [(n, block_rows(n, t, BLOCKS)) for n, t in c.items()]
    w = WorkerTransfers(
        layers,
        host_bytes=4 * sum(r.shape[1] for _, r in layers),
        store=None,
        store_key=lambda page: StoreKey(namespace="t", pool="kv-r0", page_hash=page.hex()),
        stats=ConnectorStats(),
        copier=choose_copier(backend, list(c.values())),
    )
    before = {n: (t[2].clone(), t[4].clone()) for n, t in c.items()}
    w.start_step(
        StepPlan(saves=[SaveOp("r", key(1), 3, 2, False), SaveOp("r", key(2), 0, 4, False)])
    )
    w.finish_step()
    w.wait_saves()  # saves settle off the step
    w.start_step(StepPlan(loads=[LoadOp("q", (key(2), key(1)), (0, 3), (6, 7), (False, False))]))
    w.finish_step()
    w.wait_saves()  # saves settle off the step
    for n in c:
        assert torch.equal(c[n][7], before[n][0])
        assert torch.equal(c[n][6], before[n][1])
    w.close()


def test_native_copies_of_device_memory_are_refused() -> None:
    with pytest.raises(DeviceError, match="copy_backend"):
        choose_copier("native", [torch.empty(4, 8, dtype=torch.uint8, device="meta")])
    assert choose_copier("torch", [torch.empty(4, 8, device="meta")]).backend == "torch"
    assert choose_copier("auto", [torch.empty(4, 8)]).backend == "memcpy"  # hicache's native
    with pytest.raises(DeviceError, match="cuda_batch"):  # auto on a device: the batch copy
        choose_copier("auto", [torch.empty(4, 8, device="meta")])


class GatedCopier(RowCopier):
    """hicache's memcpy rows, but device-to-host copies wait until the test opens the gate."""

    def __init__(self) -> None:
        super().__init__("memcpy")
        self.gate = threading.Event()

    def copy(self, dst: torch.Tensor, dst_rows: Any, src: torch.Tensor, src_rows: Any) -> None:
        if dst.shape[0] == 4:  # the host pages (4 slots): a save
            self.gate.wait(10)
        super().copy(dst, dst_rows, src, src_rows)


def test_saves_do_not_block_the_step_and_settle_once_copied() -> None:
    c = caches()
    layers = [(n, block_rows(n, t, BLOCKS)) for n, t in c.items()]
    copier = GatedCopier()
    w = WorkerTransfers(
        layers,
        host_bytes=4 * sum(r.shape[1] for _, r in layers),
        store=None,
        store_key=lambda page: StoreKey(namespace="t", pool="kv-r0", page_hash=page.hex()),
        stats=ConnectorStats(),
        copier=copier,
    )
    before = {n: t[2].clone() for n, t in c.items()}
    w.start_step(StepPlan(saves=[SaveOp("r", key(1), 3, 2, False)]))
    w.finish_step()  # returns with every save still waiting at the gate
    w.poll()
    assert w.drain_events() == []  # nothing is reported before the copies ended
    copier.gate.set()
    w.wait_saves()
    assert [(e.op, e.ok) for e in w.drain_events()] == [(Op.SAVE, True)]
    w.start_step(StepPlan(loads=[LoadOp("q", (key(1),), (3,), (5,), (False,))]))
    for n in c:
        w.wait_layer(n)
        assert torch.equal(c[n][5], before[n])
    w.finish_step()
    w.close()


def test_the_next_step_waits_for_saves_still_reading_its_blocks() -> None:
    c = caches()
    layers = [(n, block_rows(n, t, BLOCKS)) for n, t in c.items()]
    copier = GatedCopier()
    w = WorkerTransfers(
        layers,
        host_bytes=4 * sum(r.shape[1] for _, r in layers),
        store=None,
        store_key=lambda page: StoreKey(namespace="t", pool="kv-r0", page_hash=page.hex()),
        stats=ConnectorStats(),
        copier=copier,
    )
    before = {n: t[2].clone() for n, t in c.items()}
    w.start_step(StepPlan(saves=[SaveOp("r", key(1), 3, 2, False)]))
    w.finish_step()
    threading.Timer(0.2, copier.gate.set).start()
    w.bind(StepPlan())  # vLLM's next step may overwrite block 2: the fence waits for the save
    for t in c.values():
        t[2].zero_()  # what the next step's compute might write into the freed block
    w.wait_saves()
    w.start_step(StepPlan(loads=[LoadOp("q", (key(1),), (3,), (5,), (False,))]))
    for n in c:
        w.wait_layer(n)
        assert torch.equal(c[n][5], before[n])  # the page holds the bytes from before
    w.finish_step()
    w.close()


class FailingCopier(RowCopier):
    """hicache's memcpy rows; copies into ``fail_into`` rows raise (a failing copy engine)."""

    def __init__(self, fail_rows: int) -> None:
        super().__init__("memcpy")
        self.fail_rows = fail_rows

    def copy(self, dst: torch.Tensor, dst_rows: Any, src: torch.Tensor, src_rows: Any) -> None:
        if dst.shape[0] == self.fail_rows:
            raise TransferError("injected copy failure")
        super().copy(dst, dst_rows, src, src_rows)


def failing(c: dict[str, torch.Tensor], fail_rows: int) -> WorkerTransfers:
    layers = [(n, block_rows(n, t, BLOCKS)) for n, t in c.items()]
    return WorkerTransfers(
        layers,
        host_bytes=4 * sum(r.shape[1] for _, r in layers),
        store=None,
        store_key=lambda page: StoreKey(namespace="t", pool="kv-r0", page_hash=page.hex()),
        stats=ConnectorStats(),
        copier=FailingCopier(fail_rows),
    )


def test_a_failed_save_copy_is_reported_failed_and_fences_nothing_forever() -> None:
    w = failing(caches(), fail_rows=4)  # copies into the 4 host slots fail
    w.start_step(StepPlan(saves=[SaveOp("r", key(1), 3, 2, True)]))
    w.finish_step()
    w.bind(StepPlan())  # the fence returns: a failed copy is a finished one
    w.wait_saves()
    got = sorted((e.op.value, e.ok) for e in w.drain_events())
    assert got == [("save", False), ("store", False)]  # the scheduler frees the slot's pins
    assert w.stats.take()["save_errors"] == 1
    w.close()


def test_a_failed_load_copy_reports_its_blocks_when_the_step_ends() -> None:
    w = failing(caches(), fail_rows=BLOCKS)  # copies into vLLM's blocks fail
    w.start_step(StepPlan(loads=[LoadOp("q", (key(1), key(2)), (0, 1), (5, 6), (False, False))]))
    for n in w.names:
        w.wait_layer(n)
    w.finish_step()
    assert w.drain_errors() == {5, 6}  # vLLM recomputes them in this very step's output
    w.wait_saves()
    assert sorted((e.op.value, e.ok) for e in w.drain_events()) == [("load", False)] * 2
    w.close()


def test_store_writes_still_pending_at_interpreter_exit_are_written_by_close(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import concurrent.futures.thread as cf_thread

    c = caches()
    store = DirectoryStore(DirectorySettings(root=tmp_path))
    w = transfers(c, store)
    w.start_step(StepPlan(saves=[SaveOp("r", key(1), 0, 1, True)]))
    w.finish_step()
    # Python's exit stops new thread-pool work before vLLM's exit hook closes the connector:
    # the settling of this step's saves in close() must still write the page to the store.
    monkeypatch.setattr(cf_thread, "_shutdown", True)
    w.close()
    assert {(e.op, e.ok) for e in w.drain_events()} == {(Op.SAVE, True), (Op.STORE, True)}
    monkeypatch.undo()
    c2 = caches()
    assert not torch.equal(c2["layer.0"][6], c["layer.0"][1])
    w2 = transfers(c2, store)  # a new process: the page comes from the store
    w2.start_step(StepPlan(async_loads=[LoadOp("q", (key(1),), (2,), (6,), (True,))]))
    w2.finish_step()
    w2.wait_idle()
    assert w2.drain_errors() == set()
    for n in c:
        assert torch.equal(c2[n][6], c[n][1])
    w2.close()
