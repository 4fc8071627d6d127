"""The measurement behind `hicache bench storage`: a store against plain file I/O of the same bytes.

- StorageBench: what to measure (pages of a materialised host pool, repeats, where raw files go).
- run_storage_bench: put every page, probe exists, get every page into a second host pool
  (checked byte-exact), and write and read the same total bytes as one plain sequential file in
  the same directory; medians over the repeats.

Each round runs raw write (a fresh file, no fsync) then raw read (page cache warm: the file was
just written), and store remove (so the puts write), put, exists, get (page cache warm: the
objects were just written); the raw and the store halves alternate which goes first, after one
uncounted warm-up round. Raw I/O moves the pool's whole buffers in 64 MiB chunks.

A store with a ``raw_client()`` (Mooncake) is also timed through that client directly, in the
same rounds and on the same pages: ``batch_put_from_multi_buffers`` from the source pool's
registered pages and ``batch_get_into_multi_buffers`` into the destination pool's (fresh keys,
checked and removed): ``raw_put_gbps`` / ``raw_get_gbps``, the client's own speed, against which
the store's put and get are compared.

What a round put is removed before the next puts (not timed): Mooncake keeps an object read
within its lease (10 s by default) from removal and eviction, so removal is retried before each
put, and with a local cluster the bench waits until what it still holds leaves room in the
segment (hicache.bench.storage_cleanup); a round that cannot fit it is refused up front.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import statistics
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import attrs
import torch

from hicache.adapters.host_pool import HostPool, materialise_host_group
from hicache.adapters.storage.page_buffers import page_buffer
from hicache.bench.storage_cleanup import Leftovers, check_room, segment_budget
from hicache.domain import HostGroupPlan, StoreError
from hicache.domain.storage import PageBuffer, Store, StoreKey, StoreStatus

CHUNK = 64 << 20
EXISTS_PROBES = 20000  # keys probed per exists measurement (the batch is repeated)


@attrs.frozen(kw_only=True)
class StorageBench:
    plan: HostGroupPlan
    repeats: int
    raw_dir: Path


def _fill(pool: HostPool) -> None:
    gen = torch.Generator().manual_seed(0)
    for buf in pool.buffers.values():
        raw = buf.view(-1).view(torch.uint8)
        raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=gen))


def _whole(pool: HostPool) -> list[memoryview]:
    """Every buffer of the pool as one flat byte view (what raw I/O moves)."""
    return [b.reshape(-1).view(torch.uint8).numpy().data for b in pool.buffers.values()]


def _timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _chunks(views: list[memoryview]) -> Iterator[memoryview]:
    """The views in order, each cut into pieces of at most CHUNK bytes."""
    for view in views:
        for off in range(0, view.nbytes, CHUNK):
            yield view[off : off + CHUNK]


def _raw_write(path: Path, views: list[memoryview]) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        for chunk in _chunks(views):
            done = 0
            while done < chunk.nbytes:
                done += os.write(fd, chunk[done:])
    finally:
        os.close(fd)


def _raw_read(path: Path, views: list[memoryview]) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        for chunk in _chunks(views):
            done = 0
            while done < chunk.nbytes:
                got = os.readv(fd, [chunk[done:]])
                if got == 0:
                    raise StoreError(f"raw file {str(path)!r} ended early")
                done += got
    finally:
        os.close(fd)


def _check(op: str, statuses: list[StoreStatus]) -> None:
    bad = [s for s in statuses if s is not StoreStatus.OK]
    if bad:
        raise StoreError(f"bench {op}: {len(bad)} of {len(statuses)} pages answered {bad[0].value}")


def run_storage_bench(store: Store, bench: StorageBench) -> dict[str, Any]:
    """Measure ``store`` on every page of the plan's anchor pool; see the module docstring."""
    client = _raw_client(store)
    anchor = bench.plan.anchor
    check_room(store, anchor.bytes_per_page * anchor.pages * (2 if client is not None else 1))
    budget = segment_budget(store)
    with materialise_host_group(bench.plan) as src, materialise_host_group(bench.plan) as dst:
        a, b = src.anchor, dst.anchor
        _fill(a)
        # Zero-copy stores (Mooncake) must know the host memory before any transfer.
        store.register(_whole(a) + _whole(b))
        pages = a.pages
        # Fresh keys every round: a store may keep an object it was asked to remove (Mooncake
        # holds a lease on what was read recently) and then skip a put of the same key.
        key_rounds = [
            [
                StoreKey(
                    f"bench-{os.getpid()}-{r}", a.name.value, hashlib.sha256(b"%d" % i).hexdigest()
                )
                for i in range(pages)
            ]
            for r in range(bench.repeats + 1)
        ]
        keys = key_rounds[0]
        put_bufs: list[PageBuffer] = [page_buffer(a, i) for i in range(pages)]
        get_bufs: list[PageBuffer] = [page_buffer(b, i) for i in range(pages)]
        page_bytes = a.plan.bytes_per_page
        total = pages * page_bytes
        raw_path = bench.raw_dir / f"hicache-bench-raw-{os.getpid()}"
        loops = max(1, EXISTS_PROBES // pages)
        rounds: dict[str, list[float]] = {
            k: [] for k in ("raw_w", "raw_r", "put", "get", "ex", "client_put", "client_get")
        }
        leftovers = Leftovers(store, client, page_bytes, budget)

        def raw_round(times: dict[str, float]) -> None:
            raw_path.unlink(missing_ok=True)
            times["raw_w"] = _timed(lambda: _raw_write(raw_path, _whole(a)))
            times["raw_r"] = _timed(lambda: _raw_read(raw_path, _whole(b)))
            raw_path.unlink()

        def store_round(times: dict[str, float]) -> None:
            nonlocal keys
            keys = key_rounds[r]
            leftovers.make_room(total)
            got: list[list[StoreStatus]] = []
            times["put"] = _timed(lambda: got.append(store.put(keys, put_bufs)))
            leftovers.keys.extend(keys)
            times["ex"] = _timed(lambda: [store.exists(keys) for _ in range(loops)])
            times["get"] = _timed(lambda: got.append(store.get(keys, get_bufs)))
            _check("put", got[0])
            _check("get", got[1])

        def client_round(times: dict[str, float]) -> None:
            if client is not None:
                names = [f"raw-{k}" for k in key_rounds[r]]
                leftovers.make_room(total)
                leftovers.names.extend(names)
                times["client_put"], times["client_get"] = _client_round(
                    client, names, put_bufs, get_bufs
                )

        try:
            # One warm-up round, not counted; then the order of raw and store I/O alternates.
            for r in range(bench.repeats + 1):
                times: dict[str, float] = {}
                steps = (raw_round, client_round, store_round)
                for step in steps if r % 2 else steps[::-1]:
                    step(times)
                if r:
                    for k, v in times.items():
                        rounds[k].append(v)
            same = all(
                torch.equal(x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8))
                for x, y in zip(a.buffers.values(), b.buffers.values(), strict=True)
            )
            if not same:  # compared as bytes: random bf16 bytes hold NaNs
                raise StoreError("bench get: the pages read back differ from the pages put")
            if budget is None:  # a cluster that outlives the bench: wait out the last leases
                leftovers.drain()
        finally:
            raw_path.unlink(missing_ok=True)
            with contextlib.suppress(StoreError):
                leftovers.retry()

    def gbps(key: str) -> float:
        return round(total / statistics.median(rounds[key]) / 1e9, 3)

    extra = {}
    if client is not None:
        extra = {"raw_put_gbps": gbps("client_put"), "raw_get_gbps": gbps("client_get")}
    return {
        "store": store.name,
        "pages": pages,
        "page_bytes": page_bytes,
        "put_gbps": gbps("put"),
        "get_gbps": gbps("get"),
        "exists_per_s": round(pages * loops / statistics.median(rounds["ex"])),
        "raw_read_gbps": gbps("raw_r"),
        "raw_write_gbps": gbps("raw_w"),
        **extra,
    }


def _raw_client(store: Store) -> Any:
    """The client of a store that has one, looking through wrappers (DelegatingStore.inner)."""
    layer: Any = store
    for _ in range(8):
        get = getattr(layer, "raw_client", None)
        if callable(get):
            return get()
        layer = getattr(layer, "inner", None)
        if layer is None:
            break
    return None


def _addresses(buffers: list[PageBuffer]) -> tuple[list[list[int]], list[list[int]]]:
    from hicache.adapters.storage.mooncake import buffer_address

    ptrs = [[buffer_address(v) for v in buf if v.nbytes] for buf in buffers]
    sizes = [[v.nbytes for v in buf if v.nbytes] for buf in buffers]
    return ptrs, sizes


def _client_round(
    client: Any, names: list[str], put_bufs: list[PageBuffer], get_bufs: list[PageBuffer]
) -> tuple[float, float]:
    """(put seconds, get seconds) of the client's own batch calls on the same pages."""
    src_ptrs, sizes = _addresses(put_bufs)
    dst_ptrs, _ = _addresses(get_bufs)
    put: list[int] = []
    got: list[int] = []
    t_put = _timed(lambda: put.extend(client.batch_put_from_multi_buffers(names, src_ptrs, sizes)))
    t_get = _timed(lambda: got.extend(client.batch_get_into_multi_buffers(names, dst_ptrs, sizes)))
    if any(code != 0 for code in put):
        raise StoreError(f"bench: the Mooncake client's own put answered {sorted(set(put))}")
    want = [sum(s) for s in sizes]
    if got != want:
        raise StoreError(f"bench: the Mooncake client's own get answered {got[:4]}..., not sizes")
    return t_put, t_get
