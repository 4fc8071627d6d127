"""The worker's data path on a CUDA GPU (no vLLM needed): vLLM-shaped CUDA caches driven through
steps of loads and saves while a compute stream runs. Skipped without a CUDA GPU."""

from __future__ import annotations

import pytest
import torch

from hicache.domain.storage import StoreKey
from hicache.integrations.vllm.plan import LoadOp, Op, SaveOp, StateLoad, StateSave, StepPlan
from hicache.integrations.vllm.stats import ConnectorStats
from hicache.integrations.vllm.worker import WorkerTransfers, block_rows, choose_copier, state_rows

pytestmark = pytest.mark.gpu
BLOCKS = 64
LAYERS = 4


def cuda_caches(layout: str = "5D") -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Attention caches as vLLM hands them over: "5D", a contiguous (blocks, 2, block_size,
    kv_heads, head_dim) tensor per layer; "LBNHC" (vLLM 0.32's CUDA default) and "BLHNC", the
    logical [blocks, heads, tokens, content] views whose strides follow the layout
    (vllm/v1/kv_cache_interface.py create_kv_cache_views); and a state layer's raw pages."""
    g = torch.Generator(device="cuda").manual_seed(0)
    names = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g, device="cuda").to(torch.bfloat16)

    if layout == "5D":
        kv = {n: randn(BLOCKS, 2, 16, 8, 128) for n in names}
    elif layout == "LBNHC":
        kv = {n: randn(BLOCKS, 16, 8, 256).permute(0, 2, 1, 3) for n in names}
    else:  # BLHNC: one buffer, a block's stride spans every layer's page
        raw = randn(BLOCKS, LAYERS, 8, 16, 256)
        kv = {n: raw.select(1, i) for i, n in enumerate(names)}
    state = torch.randint(-128, 127, (BLOCKS, 3, 512), dtype=torch.int8, device="cuda")
    return kv, state


def make(
    kv: dict[str, torch.Tensor], state: torch.Tensor, backend: str = "auto"
) -> WorkerTransfers:
    layers = [(n, block_rows(n, t, BLOCKS)) for n, t in kv.items()]
    states = [("model.layers.9.linear_attn", 0, state_rows("s", state, BLOCKS))]
    return WorkerTransfers(
        layers,
        host_bytes=16 * sum(r.shape[1] for _, r in layers),
        store=None,
        store_key=lambda page: StoreKey(namespace="t", pool="kv-r0", page_hash=page.hex()),
        stats=ConnectorStats(),
        state_layers=states,
        state_host_bytes=8 * states[0][2].shape[1],
        copier=None if backend == "auto" else choose_copier(backend, [r for _, r in layers]),
    )


def busy(n: int = 2048, rounds: int = 8) -> None:
    """Compute on the current stream that takes a while (the copies must wait for it)."""
    a = torch.randn(n, n, device="cuda")
    for _ in range(rounds):
        a = a @ a
        a = a / a.norm()


@pytest.mark.parametrize("layout", ["5D", "LBNHC", "BLHNC"])
@pytest.mark.parametrize("backend", ["auto", "torch"])
def test_saves_read_each_layer_after_its_compute_and_loads_restore_bytes_exactly(
    backend: str, layout: str
) -> None:
    kv, state = cuda_caches(layout)
    w = make(kv, state, backend)
    assert w.host.is_pinned()
    compute = torch.cuda.Stream()
    names = list(kv)
    with torch.cuda.stream(compute):
        w.bind(
            StepPlan(
                saves=[SaveOp("r", bytes([b]) * 32, b, b, False) for b in range(4)],
                state_saves=[StateSave("r", b"state:" + bytes(32), 0, (7,), False)],
            )
        )
        w.start_step()
        for i, name in enumerate(names):
            busy()
            kv[name][:4].fill_(float(i + 1))  # this layer's compute writes the blocks
            w.save_layer(name)  # ordered after the fill, on the backup stream
        w.finish_step()  # returns at once: nothing waited on the host
    # what each layer's compute wrote (a save that ran before it would hold the random bytes)
    expected = {n: torch.full_like(t[:4], float(i + 1)) for i, (n, t) in enumerate(kv.items())}
    expected_state = state[7].clone()  # written by no compute: same stream as its creation
    w.wait_saves()
    events = w.drain_events()
    assert all(e.ok for e in events)
    assert {e.op for e in events} == {Op.SAVE}
    with torch.cuda.stream(compute):
        for t in kv.values():
            t[10:14].zero_()  # vLLM zeroing new blocks on its stream: the loads come after
        state[9].zero_()
        w.bind(
            StepPlan(
                loads=[
                    LoadOp(
                        "q",
                        tuple(bytes([b]) * 32 for b in range(4)),
                        (0, 1, 2, 3),
                        (10, 11, 12, 13),
                        (False,) * 4,
                    )
                ],
                async_loads=[  # a hybrid hit's state: on the load stream, off the step
                    LoadOp(
                        "h",
                        (),
                        (),
                        (),
                        (),
                        state=StateLoad(b"state:" + bytes(32), 0, (9,), False),
                        all_or_nothing=True,
                    )
                ],
            )
        )
        w.start_step()
        for name in names:
            w.wait_layer(name)  # the compute stream waits on the layer's event
            kv[name][10:14].add_(0)  # compute reading the loaded blocks
        w.finish_step()
    w.wait_idle()
    assert w.drain_finished() == {"h"}
    assert w.drain_failed() == set()
    torch.cuda.synchronize()
    for name in names:
        assert torch.equal(kv[name][10:14], expected[name]), name
    assert torch.equal(state[9], expected_state)
    w.wait_saves()
    assert all(e.ok for e in w.drain_events())
    w.close()


def test_wait_layer_does_not_block_the_host() -> None:
    kv, state = cuda_caches()
    w = make(kv, state)
    compute = torch.cuda.Stream()
    with torch.cuda.stream(compute):
        w.bind(StepPlan(loads=[LoadOp("q", (bytes(32),), (0,), (5,), (False,))]))
        busy(4096, 16)  # the compute stream is busy
        w.start_step()
        w.wait_layer(next(iter(kv)))
        assert not compute.query()  # the host went on while the GPU still computes
        w.finish_step()
    torch.cuda.synchronize()
    w.wait_saves()
    w.close()
