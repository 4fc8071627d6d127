"""Review findings in the composition root."""

from __future__ import annotations

import pytest
import torch

from hicache.bootstrap.runtime import open_runtime
from hicache.domain import HiCacheError
from tests.engine.fakes import hybrid_plan


def test_wrapped_tensors_on_another_device_than_asked_are_refused() -> None:
    plan = hybrid_plan(pages=4, page_size=4, slots=2)
    tensors = {
        p.name: {
            b.name: [
                torch.zeros(
                    (p.device_capacity or 0, *b.shape),
                    dtype=torch.bfloat16 if b.dtype.value == "bf16" else torch.float32,
                )
                for _ in range(p.layers)
            ]
            for b in p.geometry.buffers
        }
        for p in plan.pools
    }
    # CPU tensors under device="cuda": the host group would be materialised for a GPU (pinned
    # under pinned=auto) and the runtime would silently run on the CPU, or, the other way
    # round, GPU tensors under the default device="cpu" would get pageable host memory.
    with pytest.raises(HiCacheError, match="cuda"):
        open_runtime(plan, device="cuda", device_tensors=tensors, backend="torch")
