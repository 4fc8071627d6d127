"""The worker's data path on vLLM-shaped CUDA caches, on a machine without a GPU.

The caches are fake "cuda" tensors (torch's FakeTensorMode): they have devices and shapes but no
data, so these tests catch device mixing and check the ordering calls of a step of loads and
saves; the bytes are checked on real tensors in test_worker_transfers.py and, on a GPU, in
test_worker_gpu.py.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from hicache.domain import HostMemory, MemoryKind, Pinning
from hicache.domain.ports import Direction, Streams
from hicache.integrations.vllm.plan import LoadOp, Op, SaveOp, StateSave, StepPlan
from hicache.integrations.vllm.stats import ConnectorStats
from hicache.integrations.vllm.worker import WorkerTransfers, block_rows, choose_copier, state_rows

BLOCKS = 6
UNPINNED = HostMemory(kind=MemoryKind("anonymous"), pinned=Pinning.OFF)


class LoggedEvent:
    def __init__(self, log: list[tuple[Any, ...]], what: tuple[Any, ...]) -> None:
        self.log, self.what, self.exc = log, what, None

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        if self.exc is not None:
            raise self.exc

    def wait_current(self) -> None:
        self.log.append(("wait_current", *self.what))

    def exception(self) -> BaseException | None:
        return self.exc

    def elapsed_s(self) -> float | None:
        return 0.0


class LoggedStreams:
    """Issues the work inside submit on the caller's thread (as CUDA streams do) and logs it."""

    def __init__(self) -> None:
        self.log: list[tuple[Any, ...]] = []
        self.n = 0

    @property
    def device(self) -> str:
        return "cuda"

    def new_event(self) -> LoggedEvent:
        return LoggedEvent(self.log, ("idle",))

    def submit(
        self, direction: Direction, work: Callable[[], object], event: object = None
    ) -> LoggedEvent:
        self.n += 1
        ev = LoggedEvent(self.log, (direction.value, self.n))
        self.log.append(("submit", direction.value, self.n))
        try:
            work()
        except BaseException as exc:
            ev.exc = exc  # type: ignore[assignment]
            self.log.append(("error", direction.value, repr(exc)))
        return ev

    def after_compute(self, direction: Direction, after: object | None = None) -> None:
        self.log.append(("after_compute", direction.value, after))

    def close(self) -> None:
        pass


class LoggedOrder:
    def __init__(self, log: list[tuple[Any, ...]]) -> None:
        self.log = log
        self.points = 0

    def point(self) -> object | None:
        self.points += 1
        return f"compute-point-{self.points}"

    def fence(self, streams: Streams, events: Any) -> None:
        self.log.append(("fence", len(events)))


LAYOUTS = ["5D", "LBNHC", "BLHNC"]


def attention_caches(layout: str) -> dict[str, torch.Tensor]:
    """Three attention layers' caches as vLLM hands them over (call inside the fake mode).

    "5D": a contiguous ``(num_blocks, 2, block_size, kv_heads, head_dim)`` tensor per layer
    (vLLM before its KV cache layouts); "LBNHC" (CUDA's default in vLLM 0.32) and "BLHNC": the
    logical ``[blocks, heads, tokens, content]`` views whose strides follow the layout
    (vllm/v1/kv_cache_interface.py create_kv_cache_views), tokens outside the heads in a block
    of one layer, or heads outside the tokens with a block stride spanning all three layers.
    """
    names = [f"model.layers.{i}.self_attn.attn" for i in range(3)]
    if layout == "5D":
        return {
            n: torch.empty(BLOCKS, 2, 16, 2, 8, dtype=torch.bfloat16, device="cuda") for n in names
        }
    if layout == "LBNHC":
        return {
            n: torch.empty(BLOCKS, 16, 2, 32, dtype=torch.int8, device="cuda").permute(0, 2, 1, 3)
            for n in names
        }
    raw = torch.empty(BLOCKS, len(names), 2, 16, 32, dtype=torch.int8, device="cuda")
    return {n: raw.select(1, i) for i, n in enumerate(names)}


def vllm_caches(
    mode: FakeTensorMode, layout: str = "5D"
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    with mode:
        kv = attention_caches(layout)
        # a hybrid model's state layer: raw int8 pages, blocks first
        state = torch.empty(BLOCKS, 3, 64, dtype=torch.int8, device="cuda")
    return kv, state


def worker(
    kv: dict[str, torch.Tensor], state: torch.Tensor, streams: LoggedStreams
) -> WorkerTransfers:
    layers = [(n, block_rows(n, t, BLOCKS)) for n, t in kv.items()]
    states = [("model.layers.3.linear_attn", 0, state_rows("s", state, BLOCKS))]
    return WorkerTransfers(
        layers,
        host_bytes=4 * sum(r.shape[1] for _, r in layers),
        store=None,
        store_key=lambda page: None,  # type: ignore[arg-type,return-value]
        stats=ConnectorStats(),
        state_layers=states,
        state_host_bytes=4 * states[0][2].shape[1],
        copier=choose_copier("torch", [r for _, r in layers], pinned=False),  # UNPINNED host
        host_memory=UNPINNED,
        streams=(streams, LoggedOrder(streams.log)),  # type: ignore[arg-type]
    )


def test_torch_row_copies_of_cpu_rows_into_cuda_caches_mix_devices() -> None:
    """The failure the worker used to hit on a GPU: a CPU index into a CUDA cache."""
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    kv, _ = vllm_caches(mode)
    rows = block_rows("l", next(iter(kv.values())), BLOCKS)
    host = torch.zeros(4, rows.shape[1], dtype=torch.uint8)
    with mode, pytest.raises(RuntimeError, match="device"):
        rows.index_copy_(0, torch.tensor([1]), host.index_select(0, torch.tensor([0])))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_step_of_loads_and_saves_on_cuda_caches_mixes_no_devices(layout: str) -> None:
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    kv, state = vllm_caches(mode, layout)
    streams = LoggedStreams()
    w = worker(kv, state, streams)
    names = list(kv)
    plan = StepPlan(
        loads=[LoadOp("a", (b"k1", b"k2"), (0, 1), (4, 5), (False, False))],
        saves=[SaveOp("b", b"k3", 2, 1, False)],
        state_saves=[StateSave("b", b"state:k3", 0, (3,), False)],
    )
    whole = layout == "BLHNC"  # a block's layers side by side: one copy per page
    assert (w.page_rows is not None) == whole
    with mode:
        w.bind(plan)
        w.start_step()
        for name in names:
            w.wait_layer(name)
            before_last = len(streams.log)
            w.save_layer(name)
        w.finish_step()
    if whole:  # the page's copy waits for the last layer's compute
        assert not any(e[1:2] == ("backup",) for e in streams.log[:before_last])
    assert [e for e in streams.log if e[0] == "error"] == []  # no copy raised (device mixing)
    # the loads come after vLLM's compute so far (its zeroing of the new blocks)
    first_load = streams.log.index(next(e for e in streams.log if e[:2] == ("submit", "load")))
    assert any(e[:2] == ("after_compute", "load") for e in streams.log[:first_load])
    loads = [e for e in streams.log if e[:2] == ("submit", "load")]
    assert len(loads) == len(names)  # one load per layer, each with its own event
    # every layer's load was waited for through its event (compute waits, no host sync)
    waits = [e for e in streams.log if e[0] == "wait_current" and e[1] == "load"]
    assert [e[2] for e in waits] == [e[2] for e in loads]
    # every save (each layer or the whole pages, then the states) is ordered after a compute
    # point, on the backup stream
    backup = [e for e in streams.log if e[1:2] == ("backup",)]
    saves = 1 if whole else len(names)
    assert [e[0] for e in backup] == ["after_compute", "submit"] * (saves + 1)
    assert all(e[2].startswith("compute-point") for e in backup if e[0] == "after_compute")
    w.wait_saves()
    got = [(e.op, e.key, e.ok) for e in w.drain_events()]
    assert (Op.SAVE, b"k3", True) in got
    assert (Op.SAVE, b"state:k3", True) in got
    assert (Op.LOAD, b"k1", True) in got
    assert (Op.LOAD, b"k2", True) in got
    assert w.drain_errors() == set()
    w.close()


def test_the_next_step_is_fenced_after_saves_in_flight() -> None:
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    kv, state = vllm_caches(mode)
    streams = LoggedStreams()
    w = worker(kv, state, streams)
    pending = [True]

    class Pending(LoggedEvent):
        def query(self) -> bool:
            return not pending[0]

    submit = streams.submit

    def slow_submit(direction: Direction, work: Callable[[], object], event: object = None) -> Any:
        ev = submit(direction, work)
        out = Pending(streams.log, ev.what)
        out.exc = ev.exc
        return out

    streams.submit = slow_submit  # type: ignore[method-assign]
    with mode:
        w.bind(StepPlan(saves=[SaveOp("b", b"k3", 2, 1, False)]))
        for name in kv:
            w.save_layer(name)
        w.finish_step()
        assert w.drain_events() == []  # the copies are still in flight: nothing settled
        w.bind(StepPlan())  # vLLM's next step: compute must wait for them
    assert ("fence", len(kv)) in streams.log
    pending[0] = False
    w.poll()
    assert [(e.op, e.ok) for e in w.drain_events()] == [(Op.SAVE, True)]
    w.close()


def test_the_worker_side_imports_without_vllm() -> None:
    """scripts/gpu-check runs the worker's gpu tests on machines without vLLM."""
    code = (
        "import sys; sys.modules['vllm'] = None\n"
        "import hicache.integrations.vllm.worker, hicache.integrations.vllm.worker_parts\n"
        "import hicache.bench.vllm_worker\n"
        "assert sys.modules['vllm'] is None\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert proc.returncode == 0, proc.stderr
