"""The two stacks of the allocator story, MiniMax-M3 (indexer on the sparse layers) and Inkling
(short-conv state on every layer), materialised in real shared-memory segments that another
process opens by name, reads and writes."""

from __future__ import annotations

import json

import pytest
import torch

from hicache.adapters.host_memory import ShmRegion
from hicache.adapters.host_pool import materialise_host_group
from hicache.bootstrap import load_model_spec, storage_settings
from hicache.domain import PlanSettings, RatioSizing, plan_stack
from tests.adapters.conftest import run_python

READER = """
import json, sys
from hicache.adapters.host_memory import ShmRegion
out = {}
for name, nbytes, seed in json.loads(sys.argv[1]):
    with ShmRegion.attach(name, nbytes=nbytes) as region:
        t = region.tensor()
        out[name] = [int(t[0]), int(t[nbytes // 2]), int(t[-1])]
        t[1] = (seed + 1) % 256  # a write the owner must see
print(json.dumps(out))
"""


@pytest.mark.parametrize(
    ("model", "pools"),
    [("minimax-m3", {"kv", "indexer"}), ("inkling", {"kv", "swa", "mamba"})],
)
def test_every_pool_lives_in_shm_segments_another_process_opens(
    model: str, pools: set[str]
) -> None:
    settings = PlanSettings(
        tp_size=8,
        page_size=64,
        device_tokens=64,
        device_slots=1,
        sizing=RatioSizing(1.0),
        storage=storage_settings("dynamic", '{"allocator": "shm"}'),
    )
    plan = plan_stack(load_model_spec(model), settings)
    assert {p["name"]: p["host_memory"]["kind"] for p in plan.as_json()["pools"]} == dict.fromkeys(
        pools, "shm"
    )
    with materialise_host_group(plan) as group:
        regions = [
            (pool.name.value, buf, region)
            for pool in group.pools.values()
            for buf, region in pool.regions.items()
        ]
        assert {name for name, _, _ in regions} == pools
        listing = []
        for seed, (_, _, region) in enumerate(regions):
            assert isinstance(region, ShmRegion)
            t = region.tensor()
            t[0], t[region.nbytes // 2], t[-1] = seed % 256, (seed + 7) % 256, (seed + 13) % 256
            listing.append((region.name, region.nbytes, seed))
        proc = run_python(READER, json.dumps(listing))
        assert proc.returncode == 0, proc.stderr
        seen = json.loads(proc.stdout)
        for name, _, seed in listing:
            assert seen[name] == [seed % 256, (seed + 7) % 256, (seed + 13) % 256]
        for seed, (_, _, region) in enumerate(regions):
            assert int(region.tensor()[1]) == (seed + 1) % 256
        # the buffers the engine copies through are views of those same segments
        kv = group.pools[plan.anchor.name]
        buf, first = next(iter(kv.buffers.items()))
        first.view(torch.uint8).reshape(-1)[0] = 201
        assert int(kv.regions[buf].tensor()[0]) == 201
