"""The torch backend on a GPU: runs split into contiguous pieces, copied without blocking."""

from __future__ import annotations

import pytest
import torch

from hicache.adapters.copy import make_transfer
from hicache.adapters.copy.pairs import logical_host_view
from hicache.adapters.copy.torch_batched import contiguous_pieces
from hicache.adapters.device_pool import DeviceGroup
from hicache.adapters.host_pool import materialise_host_group
from hicache.domain import Layout, TransferError
from hicache.domain.ports import PageMap
from tests.adapters.pool_plans import group_plan

L, PAGES, P, H, D = 3, 6, 4, 2, 8


def _host(layout: Layout) -> torch.Tensor:
    units = PAGES * P
    shapes = {
        Layout.LAYER_FIRST: (L, units, H, D),
        Layout.PAGE_FIRST: (units, L, H, D),
        Layout.PAGE_FIRST_DIRECT: (PAGES, L, P, H, D),
        Layout.PAGE_HEAD: (PAGES, H, P, L, D),
    }
    raw = torch.arange(L * units * H * D, dtype=torch.int32).view(shapes[layout])
    return logical_host_view(raw, layout, P)  # (L, pages, P, H, D)


@pytest.mark.parametrize("layout", list(Layout))
def test_pieces_are_contiguous_on_both_sides_and_copy_exactly_the_run(layout: Layout) -> None:
    host = _host(layout)
    device = torch.full((PAGES, P, H, D), -1, dtype=torch.int32)
    run_h, run_d = host[1][2:5], device[0:3]
    pieces = contiguous_pieces([run_d], [run_h])
    assert all(d.is_contiguous() and s.is_contiguous() for d, s in pieces)
    for d, s in pieces:
        d.copy_(s)
    assert torch.equal(device[0:3], run_h)
    assert bool((device[3:] == -1).all())


def test_a_run_contiguous_on_both_sides_stays_one_piece() -> None:
    host = _host(Layout.LAYER_FIRST)
    device = torch.zeros((PAGES, P, H, D), dtype=torch.int32)
    assert len(contiguous_pieces([device[0:3]], [host[0][1:4]])) == 1


@pytest.mark.parametrize(
    ("layout", "pieces"),
    [(Layout.PAGE_FIRST_DIRECT, 3), (Layout.PAGE_FIRST, 3 * P), (Layout.PAGE_HEAD, 3 * P * H)],
)
def test_pieces_are_as_large_as_the_layout_allows(layout: Layout, pieces: int) -> None:
    host = _host(layout)
    device = torch.zeros((PAGES, P, H, D), dtype=torch.int32)
    assert len(contiguous_pieces([device[0:3]], [host[0][1:4]])) == pieces


def test_pieces_of_different_shapes_are_refused() -> None:
    with pytest.raises(TransferError, match="different shapes"):
        contiguous_pieces([torch.zeros(2, 3)], [torch.zeros(3, 2).t().t()[:2, :2]])


@pytest.mark.gpu
@pytest.mark.parametrize("layout", [Layout.PAGE_FIRST, Layout.PAGE_FIRST_DIRECT, Layout.PAGE_HEAD])
def test_torch_backend_gpu_copies_of_strided_host_views_do_not_block(layout: Layout) -> None:
    from hicache.domain import HostMemory, MemoryKind, Pinning

    plan, name = group_plan("mha", layout, memory=HostMemory(MemoryKind("anonymous"), Pinning.ON))
    host = materialise_host_group(plan, device="cuda")
    try:
        assert host.anchor.pinned
        device = DeviceGroup.allocate(plan, device="cuda")
        transfer = make_transfer(host, device, backend="torch")
        pages = list(range(0, device.pool(name).pages, 2))
        m = PageMap(name, pages, pages)
        stream = torch.cuda.Stream()
        done = torch.cuda.Event()
        with torch.cuda.stream(stream):
            torch.cuda._sleep(200_000_000)  # keep the stream busy well past the issue calls
            for t in range(transfer.transfer_layers):
                transfer.load_layer(t, [m])
            transfer.backup([m])
            done.record(stream)
        # Had any copy gone through an unpinned temporary, the issuing thread would have waited
        # for the stream, and the event would be complete by now.
        assert not done.query()
        stream.synchronize()
    finally:
        host.close()
