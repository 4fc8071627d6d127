"""A whole cache process SIGKILLed while it writes through to the DirectoryStore (host memory in
shm): a fresh process over the same directory hits only whole pages, byte-exact; the dead
process's temp files and shm segments are removed by the next store open and `shm gc`.

(tests/storage/test_directory.py kills bare store writers; this kills the whole cache face:
background backups, storage writes and the engine's copies, at a random moment.)
"""

from __future__ import annotations

import random
import subprocess
from pathlib import Path

import pytest

from hicache.adapters.host_memory import gc_segments
from hicache.adapters.page_patterns import DevicePatterns
from hicache.adapters.storage import DirectorySettings, DirectoryStore
from hicache.adapters.storage.directory import TMP_SUFFIX
from hicache.bootstrap.cache import open_cache
from hicache.domain import PoolName
from hicache.domain.keys import chain_keys
from hicache.domain.tiers import Tier
from tests.cache.killed_cache import PAGE, PAGES, SETTINGS, plan, request
from tests.child_process import kill_after_first_line

KV = PoolName.KV


CHILD = """
import logging, sys, anyio, structlog
structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.CRITICAL))
from hicache.adapters.host_memory import list_segments
from hicache.adapters.page_patterns import DevicePatterns
from hicache.adapters.storage import DirectorySettings, DirectoryStore
from hicache.bootstrap.cache import open_cache
from hicache.domain import OutOfSlotsError, PoolName
from hicache.domain.keys import chain_keys
from hicache.domain.tiers import Tier
from tests.cache.killed_cache import PAGE, SETTINGS, plan, request
import os

async def main():
    store = DirectoryStore(DirectorySettings(root=sys.argv[1]))
    async with open_cache(plan(True), backend="torch", settings=SETTINGS, store=store) as rt:
        cache, slots = rt.cache, rt.runtime.device_slots
        patterns = DevicePatterns(rt.runtime.device, rt.plan)
        mine = [s.name for s in list_segments() if s.owner_pid == os.getpid()]
        r = 0
        while True:
            tokens = request(r)
            keys = chain_keys(tokens, PAGE)
            await cache.evict(Tier.DEVICE, len(keys))
            try:
                pages = list(slots.allocate({PoolName.KV: len(keys)}).pages[PoolName.KV])
            except OutOfSlotsError:  # backups still in flight pin the device pages: let them end
                await cache.wait_idle()
                await cache.evict(Tier.DEVICE, 1 << 20)
                pages = list(slots.allocate({PoolName.KV: len(keys)}).pages[PoolName.KV])
            for key, page in zip(keys, pages):
                patterns.fill(PoolName.KV, page, key)
            await cache.insert(tokens, {PoolName.KV: pages})
            if r == 0:
                await cache.wait_idle()  # request 0 is whole in the store
                print("ready", *mine, flush=True)
            await cache.evict(Tier.HOST, 2)
            r += 1

anyio.run(main)
"""


def run_and_kill(root: Path, delay: float) -> list[str]:
    return kill_after_first_line(CHILD, [str(root)], "ready", delay, stderr=subprocess.DEVNULL)


@pytest.mark.asyncio
@pytest.mark.parametrize("delay", [0.05, 0.3])
async def test_a_cache_killed_mid_write_through_leaves_only_whole_pages_and_no_leftovers(
    tmp_path: Path, delay: float
) -> None:
    segments = run_and_kill(tmp_path, delay + random.Random(7).uniform(0.0, 0.05))
    assert segments, "the child's host memory was in shm"
    # SIGKILL runs no clean-up; gc (or another process's first segment, which runs the same
    # clean-up) removes the dead owner's segments.
    gc_segments()
    assert not any(Path("/dev/shm", s).exists() for s in segments)
    store = DirectoryStore(DirectorySettings(root=tmp_path, stale_tmp_s=0))
    try:
        assert not list(tmp_path.rglob(f"*{TMP_SUFFIX}")), "a dead writer's temp file stayed"
        p = plan(False)
        async with open_cache(p, backend="torch", settings=SETTINGS, store=store) as rt:
            cache = rt.cache
            patterns = DevicePatterns(rt.runtime.device, p)
            hits = checked = 0
            for r in range(200):
                tokens = request(r)
                keys = chain_keys(tokens, PAGE)
                async with await cache.match(tokens) as m:
                    if m.storage_pages == 0:
                        continue
                    await cache.prefetch(m)
                async with await cache.match(tokens) as m:
                    if m.host_pages == 0:
                        continue
                    hits += 1
                    load = await cache.load(m)
                    await load.wait()
                    for i, where in enumerate(m.placements()):
                        assert patterns.check(KV, where[KV], keys[i]), (r, i)
                        checked += 1
                await cache.evict(Tier.DEVICE, 100)
            assert hits >= 1  # request 0 was whole in the store before the kill
            assert checked >= PAGES
    finally:
        store.close()
