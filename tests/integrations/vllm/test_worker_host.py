"""The worker's host tier: pages on hicache's host memory, states only where a model has them."""

from __future__ import annotations

import pytest
import torch

from hicache.domain import DeviceError
from hicache.integrations.vllm.worker_host import HostTier
from hicache.integrations.vllm.worker_parts import HostRows, host_memory_for

CPU = torch.device("cpu")


def tier(state_layers: list[tuple[str, int]], state_bytes: int = 0) -> HostTier:
    return HostTier(
        [("a", 64), ("b", 32)],
        state_layers,
        host_bytes=4 * 96,
        state_host_bytes=state_bytes,
        host_memory=host_memory_for(CPU),
        device=CPU,
    )


def test_a_page_is_one_block_of_every_layer_back_to_back() -> None:
    t = tier([])
    try:
        assert (t.slots, t.page_bytes) == (4, 96)
        t.layer("b")[2] = 7
        assert bytes(t.page(2, b"k")[0]) == bytes(64) + bytes([7]) * 32
    finally:
        t.close()


def test_a_model_without_state_layers_has_no_host_states() -> None:
    t = tier([])
    try:
        with pytest.raises(DeviceError, match="no state layers"):
            _ = t.states
    finally:
        t.close()


def test_states_live_in_their_own_rows() -> None:
    t = tier([("s", 40)], state_bytes=2 * 40)
    try:
        assert tuple(t.states.shape) == (2, 40)
        assert t.nbytes(b"state:" + b"k") == 40
        assert t.nbytes(b"k") == 96
    finally:
        t.close()


def test_host_gib_below_one_page_is_refused() -> None:
    with pytest.raises(DeviceError, match="less than one page"):
        HostTier([("a", 64)], host_bytes=63, host_memory=host_memory_for(CPU), device=CPU)


def test_empty_host_rows_are_refused_not_allocated_elsewhere() -> None:
    with pytest.raises(DeviceError, match="at least one byte row"):
        HostRows(0, 64, host_memory=host_memory_for(CPU), device=CPU)
