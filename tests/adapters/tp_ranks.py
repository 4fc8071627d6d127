"""The rank processes of tests/adapters/test_tp_agreement.py (started with multiprocessing spawn).

- run_rank(rank, world, port, scenario, out, deadline): joins a gloo group on 127.0.0.1:port
  (the store lives in rank 0), runs ``scenario`` and writes what it saw to ``out/<rank>.json``.
- Scenarios: "agree" (a cache per rank holding different pages: match and prefetch agree on
  the minimum), "dead" (rank 1 SIGKILLs itself; rank 0's match misses within the deadline),
  "late" (rank 1 calls once rank 0 gave up at its deadline: both miss, then both agree again),
  "store_dead" (rank 0, the store's host, SIGKILLs itself; rank 1 misses at once),
  "store_hung" (rank 0 SIGSTOPs itself: rank 1's store calls hang, its guard gives up at
  deadline + grace).
- No timing race: a call that must agree follows a barrier through the store (60 s), a rank
  that must come late waits for the other's miss, the call after a rank's death or stop waits
  until it is dead (its port refuses) or stopped (/proc); ``before`` is the statistics just
  before the call under test.
"""

from __future__ import annotations

import datetime
import json
import os
import signal
import socket
import time
from pathlib import Path
from typing import Any

import anyio
import attrs
import torch.distributed as dist

from hicache.adapters.storage import DirectorySettings, DirectoryStore
from hicache.adapters.tp_agreement import TorchRankAgreement
from hicache.bootstrap.cache import open_cache
from hicache.domain.keys import chain_keys
from hicache.domain.tiers import Tier, WriteSettings
from tests.cache.helpers import Request, stack_plan

STORE_THROUGH = WriteSettings(host="write_through", storage="write_through")


def _hit(m: Any) -> list[int]:
    return [m.device_pages, m.host_pages, m.storage_pages]


async def _agree(rank: int, out: Path, deadline: float, port: int) -> dict[str, Any]:
    ranks = TorchRankAgreement(dist.group.WORLD, deadline_s=deadline)
    seen: dict[str, Any] = {}
    plan, base = stack_plan("dense")
    settings = attrs.evolve(base, writes=STORE_THROUGH)
    store = DirectoryStore(DirectorySettings(root=str(out / f"store{rank}")))
    try:
        async with open_cache(plan, settings=settings, store=store, ranks=ranks) as rt:
            cache = rt.cache
            # Rank 0 computed 4 pages of the prompt, rank 1 only its first 2.
            mine = Request(rt, 4 if rank == 0 else 2)
            tokens = list(range(1000, 1000 + 4 * cache.page_size + 3))  # the 4-page prompt
            await mine.insert(cache)
            await cache.wait_idle()
            local = cache.index.match(chain_keys(tokens, cache.page_size))
            seen["local"] = [local.device_pages, local.host_pages, local.storage_pages]
            async with await cache.match(tokens) as m:
                seen["match"] = _hit(m)
            # Rank 0's copy leaves the device: the device tier agrees on 0, host on 2.
            if rank == 0:
                await cache.evict(Tier.DEVICE, 100)
            async with await cache.match(tokens) as m:
                seen["match_after_device_eviction"] = _hit(m)
            # Only the store keeps it: rank 0 has 4 pages there, rank 1 has 2.
            await cache.evict(Tier.DEVICE, 100)
            await cache.evict(Tier.HOST, 100)
            async with await cache.match(tokens) as m:
                seen["match_storage_only"] = _hit(m)
            got = await cache.prefetch(tokens)
            seen["prefetch"] = [got.requested, got.read, got.host_pages]
            async with await cache.match(tokens) as m:
                seen["match_after_prefetch"] = _hit(m)
                load = await cache.load(m)
                await load.wait()
                seen["restored_pages"] = mine.check_restored(m.placements(), m.host_pages)
            try:
                await ranks.agree_min([1, -1])
            except Exception as e:
                seen["negative_values"] = type(e).__name__
    finally:
        store.close()
    seen["statistics"] = attrs.asdict(ranks.statistics())
    return seen


def _barrier(name: str, rank: int) -> None:
    """Both ranks reach ``name`` before either goes on: keys in the default store, waited for
    up to 60 s. A call that must agree follows one, so that neither rank's start-up or load
    spends its deadline; the deadline then only measures the code under test."""
    store = dist.distributed_c10d._get_default_store()
    store.set(f"test/barrier/{name}/{rank}", "1")
    store.wait([f"test/barrier/{name}/{r}" for r in range(2)], datetime.timedelta(seconds=60))


async def _first(
    ranks: TorchRankAgreement, rank: int, values: tuple[int, ...], out: Path
) -> list[int]:
    """The pair's first agreement, after a barrier; then each rank waits until the other has
    its outcome too (files, not the store: its host may die or stop right after, and a store
    wait it left unanswered would fail or hang)."""
    _barrier("first", rank)
    got = list(await ranks.agree_min(values))
    (out / f"first_done.{rank}").write_text("")
    other = out / f"first_done.{1 - rank}"
    await _wait_until(f"rank {1 - rank}'s first outcome", other.exists)
    return got


async def _wait_until(what: str, ready: Any) -> None:
    stop = time.monotonic() + 60
    while not ready():
        if time.monotonic() > stop:
            raise TimeoutError(f"tp_ranks: {what} did not happen within 60 s")
        await anyio.sleep(0.02)


def _stats(ranks: TorchRankAgreement) -> dict[str, Any]:
    return attrs.asdict(ranks.statistics())


async def _dead(rank: int, out: Path, deadline: float, port: int) -> dict[str, Any]:
    ranks = TorchRankAgreement(dist.group.WORLD, deadline_s=deadline)
    seen: dict[str, Any] = {"first": await _first(ranks, rank, (5 + rank, 7 - rank), out)}
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    plan, settings = stack_plan("dense")
    async with open_cache(plan, settings=settings, ranks=ranks) as rt:
        req = Request(rt, 4)
        await req.insert(rt.cache)
        seen["before"] = _stats(ranks)
        started = time.monotonic()
        async with await rt.cache.match(req.tokens) as m:
            seen["elapsed"] = time.monotonic() - started
            seen["match"] = _hit(m)
    seen["statistics"] = _stats(ranks)
    return seen


async def _late(rank: int, out: Path, deadline: float, port: int) -> dict[str, Any]:
    ranks = TorchRankAgreement(dist.group.WORLD, deadline_s=deadline)
    seen: dict[str, Any] = {"first": await _first(ranks, rank, (5 + rank,), out)}
    gave_up = out / "rank0_gave_up"
    if rank == 1:  # alive, but calling only once rank 0's deadline has passed and it returned
        await _wait_until("rank 0's late call", gave_up.exists)
    started = time.monotonic()
    seen["late_call"] = list(await ranks.agree_min((10 + rank, 3)))
    seen["elapsed"] = time.monotonic() - started
    if rank == 0:
        gave_up.write_text("")
    # The next call pairs again.
    _barrier("next", rank)
    seen["next_call"] = list(await ranks.agree_min((20 + rank, 4 - rank)))
    seen["statistics"] = _stats(ranks)
    return seen


async def _store_dead(rank: int, out: Path, deadline: float, port: int) -> dict[str, Any]:
    ranks = TorchRankAgreement(dist.group.WORLD, deadline_s=deadline)
    seen: dict[str, Any] = {"first": await _first(ranks, rank, (5 + rank,), out)}
    if rank == 0:
        os.kill(os.getpid(), signal.SIGKILL)

    def refused() -> bool:  # rank 0 is gone, and the store it hosted with it
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
        except OSError:
            return True
        return False

    await _wait_until("the store host's death", refused)
    seen["before"] = _stats(ranks)
    started = time.monotonic()
    seen["after"] = list(await ranks.agree_min((9,)))
    seen["elapsed"] = time.monotonic() - started
    seen["statistics"] = _stats(ranks)
    return seen


def _stopped(pid: int) -> bool:
    """Whether process ``pid`` is stopped (SIGSTOP): its state in /proc is T."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    return stat[stat.rindex(")") + 2] in "Tt"


async def _store_hung(rank: int, out: Path, deadline: float, port: int) -> dict[str, Any]:
    ranks = TorchRankAgreement(dist.group.WORLD, deadline_s=deadline, grace_s=GRACE)
    pid_file = out / "rank0.pid"
    if rank == 0:
        pid_file.write_text(str(os.getpid()))
    seen: dict[str, Any] = {"first": await _first(ranks, rank, (5 + rank,), out)}
    if rank == 0:
        os.kill(os.getpid(), signal.SIGSTOP)  # the store's host stops answering (the test kills it)
    pid = int(pid_file.read_text())
    await _wait_until("rank 0's stop", lambda: _stopped(pid))
    seen["before"] = _stats(ranks)
    started = time.monotonic()
    seen["after"] = list(await ranks.agree_min((9,)))
    seen["elapsed"] = time.monotonic() - started
    seen["statistics"] = _stats(ranks)
    return seen


GRACE = 0.5
SCENARIOS = {
    "agree": _agree,
    "dead": _dead,
    "late": _late,
    "store_dead": _store_dead,
    "store_hung": _store_hung,
}


def run_rank(rank: int, world: int, port: int, scenario: str, out: str, deadline: float) -> None:
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=60),
    )
    folder = Path(out)
    seen = anyio.run(SCENARIOS[scenario], rank, folder, deadline, port)
    (folder / f"{rank}.json").write_text(json.dumps(seen))
    if rank == 0 and scenario not in ("dead", "store_hung"):
        # The store lives here: stay until the other rank is done with it.
        stop = time.monotonic() + 120
        while not (folder / "1.json").exists() and time.monotonic() < stop:
            time.sleep(0.05)
    os._exit(0)  # no destroy_process_group: a dead peer must not hold the exit
