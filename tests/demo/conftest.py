"""Shared set-up of the demo tests: one torch thread, and a DemoServer over an open cache face
whose pages are all checked back at the end (nothing leaked)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Iterator

import pytest
import torch

from hicache.bootstrap.cache import open_cache
from hicache.demo.framework import DemoServer, demo_cache_settings, demo_plan
from hicache.demo.model import HybridConfig, HybridLM
from hicache.domain import Tier
from hicache.domain.storage import Store

PS = 64
CFG = HybridConfig()
MODEL = HybridLM(CFG)


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@contextlib.asynccontextmanager
async def serving(store: Store | None = None) -> AsyncIterator[DemoServer]:
    """The cache is opened inside each test: its task group cannot span a fixture."""
    plan = demo_plan(CFG, page_size=PS, device_pages=48, host_pages=96, host_slots=64)
    crt = open_cache(
        plan,
        store=store,
        settings=demo_cache_settings(CFG, storage=store is not None),
        device_ownership="framework",
    )
    async with crt:
        srv = DemoServer(crt, MODEL)
        yield srv
        # Nothing leaked: once the cache's pages are evicted, every page and slot is back.
        await srv.evict_all(Tier.DEVICE)
        await srv.evict_all(Tier.HOST)
        rt = crt.runtime
        full_dev = {p.name: rt.device.pool(p.name).pages for p in plan.independent_pools()}
        assert rt.device_slots.free_counts() == full_dev
        assert rt.host_slots.free_counts() == {p.name: p.pages for p in plan.independent_pools()}
        assert len(rt.engine.device_pins) == 0
        assert len(rt.engine.host_pins) == 0


def prompt(n: int, seed: int = 0) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return [int(t) for t in torch.randint(0, CFG.vocab, (n,), generator=gen)]
