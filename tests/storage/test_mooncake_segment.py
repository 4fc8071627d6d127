"""A Mooncake store without a usable segment fails at open; the bench's local cluster is reliable.

Real processes (a mooncake_master, a mooncake_client storage node) on 127.0.0.1. Skipped where
the Mooncake wheel cannot be imported, unless HICACHE_REQUIRE_MOONCAKE=1.
"""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.storage.mooncake_support import require_mooncake

require_mooncake()

from hicache.adapters.storage import mooncake_local  # noqa: E402
from hicache.adapters.storage.mooncake import MooncakeStore  # noqa: E402
from hicache.adapters.storage.mooncake_config import load_mooncake_config  # noqa: E402
from hicache.adapters.storage.mooncake_local import (  # noqa: E402
    local_mooncake,
    open_mooncake_or_local,
)
from hicache.adapters.storage.mooncake_probe import MooncakeSegmentError  # noqa: E402
from hicache.bench.overlap import bench_plan  # noqa: E402
from hicache.bench.storage import StorageBench, run_storage_bench  # noqa: E402
from hicache.bootstrap import machine  # noqa: E402
from hicache.bootstrap.storage import open_named_store  # noqa: E402
from hicache.domain import SizingError, StoreError  # noqa: E402
from hicache.domain.storage import StoreKey, StoreStatus  # noqa: E402

pytestmark = [pytest.mark.mooncake]

PAGE = 64 << 10


def _open(extra: dict[str, object]) -> MooncakeStore:
    return MooncakeStore.open(load_mooncake_config(extra), provide_host_memory=False)


@pytest.mark.timeout(60)
def test_a_store_on_a_master_with_no_segment_fails_at_open_naming_the_cause() -> None:
    with local_mooncake(node=False) as cluster:
        with pytest.raises(MooncakeSegmentError) as err:
            _open(cluster.extra_config())
        text = str(err.value)
        assert cluster.master_address in text
        assert "no mounted segment" in text
        assert "NO_AVAILABLE_HANDLE (-200)" in text
        assert "global_segment_size is 0 B" in text
        assert isinstance(err.value, StoreError)


@pytest.mark.timeout(60)
def test_a_client_with_a_segment_of_its_own_opens_without_a_storage_node() -> None:
    with local_mooncake(node=False) as cluster:
        store = _open(cluster.extra_config(global_segment_size=16 << 20))
        try:
            buf = memoryview(bytearray(random.Random(1).randbytes(PAGE)))
            back = memoryview(bytearray(PAGE))
            store.register([buf, back])
            key = [StoreKey("seg", "kv", "a" * 64)]
            assert store.put(key, [[buf]]) == [StoreStatus.OK]
            assert store.get(key, [[back]]) == [StoreStatus.OK]
            assert bytes(back) == bytes(buf)
        finally:
            store.close()


@pytest.mark.timeout(90)
def test_a_store_whose_storage_node_was_lost_fails_at_open_and_opens_once_it_is_back() -> None:
    with local_mooncake(segment_bytes=16 << 20, client_ttl_s=2) as cluster:
        _open(cluster.extra_config()).close()
        cluster.kill_node()
        # The master answers TRANSFER_FAIL for the dead node's segment, then (after its
        # --client_ttl) NO_AVAILABLE_HANDLE: either way the open fails, naming the segment.
        with pytest.raises(MooncakeSegmentError, match="segment"):
            _open(cluster.extra_config(setup_timeout_s=6))
        cluster.start_node()
        _open(cluster.extra_config()).close()


def test_a_local_segment_the_machine_cannot_back_is_refused_before_anything_starts(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(machine, "available_memory_bytes", lambda: 1 << 30)
    before = _children()
    with pytest.raises(SizingError, match=r"no master is named\) needs 2147483648 B"):
        open_named_store("mooncake", {})
    assert _children() == before


@pytest.mark.timeout(60)
def test_a_master_port_taken_before_the_master_binds_it_is_replaced_by_a_fresh_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        busy = squatter.getsockname()[1]
        handed = iter([busy])
        free = mooncake_local.free_port
        # The first port handed out is one another process listens on by the time it is used.
        monkeypatch.setattr(mooncake_local, "free_port", lambda: next(handed, None) or free())
        with local_mooncake(segment_bytes=16 << 20) as cluster:
            assert cluster.master_port != busy
            _open(cluster.extra_config()).close()


@pytest.mark.timeout(120)
def test_the_bench_keeps_a_small_segment_from_filling_round_after_round(tmp_path: Path) -> None:
    # 128 pages of 64 KiB: 8 MiB per round for the store and as much for its client, 6 rounds.
    # Objects read back hold a lease: removed at once they stayed, and 96 MiB overflowed the
    # 64 MiB segment by the 4th round (every put FULL). Each round's objects must be gone first.
    plan = bench_plan(layers=2, tokens=128 * 16, page_size=16, layout="page_first_direct")
    store = open_mooncake_or_local({}, {}, segment_bytes=64 << 20)
    try:
        doc = run_storage_bench(store, StorageBench(plan=plan, repeats=5, raw_dir=tmp_path))
    finally:
        store.close()
    assert doc["pages"] == 128
    assert doc["put_gbps"] > 0
    assert doc["get_gbps"] > 0


@pytest.mark.timeout(60)
def test_the_bench_refuses_a_round_larger_than_the_local_segment(tmp_path: Path) -> None:
    plan = bench_plan(layers=2, tokens=160 * 16, page_size=16, layout="page_first_direct")
    store = open_mooncake_or_local({}, {}, segment_bytes=16 << 20)
    try:
        with pytest.raises(StoreError, match=r"segment of 16777216 B takes.*lower --pages"):
            run_storage_bench(store, StorageBench(plan=plan, repeats=1, raw_dir=tmp_path))
    finally:
        store.close()


def _children() -> set[int]:
    """Live or zombie processes whose parent is this test process."""
    found = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue
        if int(text[text.rindex(")") + 2 :].split()[1]) == os.getpid():
            found.add(int(stat.parent.name))
    return found


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_bench_local_cluster_opens_stores_and_closes_20_times_in_a_row() -> None:
    before = _children()
    pages = 16
    src = memoryview(bytearray(random.Random(7).randbytes(pages * PAGE)))
    dst = memoryview(bytearray(pages * PAGE))
    failures: list[str] = []
    for run in range(20):
        # The path `hicache bench storage --store mooncake` takes: a master, a storage node,
        # a store probed at open, all stopped at close.
        try:
            store = open_named_store("mooncake", {})
        except StoreError as e:
            failures.append(f"run {run}: open: {e}")
            continue
        try:
            store.register([src, dst])
            keys = [StoreKey(f"run{run}", "kv", f"{i:064x}") for i in range(pages)]
            put = store.put(keys, [[src[i * PAGE : (i + 1) * PAGE]] for i in range(pages)])
            got = store.get(keys, [[dst[i * PAGE : (i + 1) * PAGE]] for i in range(pages)])
            if put != [StoreStatus.OK] * pages or got != [StoreStatus.OK] * pages:
                failures.append(f"run {run}: put {set(put)}, get {set(got)}")
            elif bytes(dst) != bytes(src):
                failures.append(f"run {run}: the pages read back differ")
            dst[:] = bytes(len(dst))
        finally:
            store.close()
        if _children() - before:
            failures.append(f"run {run}: processes left behind: {_children() - before}")
    assert failures == []


CHILD = """
import json, sys, time
from hicache.adapters.storage.mooncake_local import local_mooncake
with local_mooncake(segment_bytes=16 << 20) as c:
    print(json.dumps(c.pids), flush=True)
    time.sleep(120)
"""


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie waiting for a reaper does not)."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return text[text.rindex(")") + 2] != "Z"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
@pytest.mark.timeout(90)
def test_the_local_cluster_does_not_outlive_a_process_killed_with_sigkill() -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env
    )
    try:
        assert child.stdout is not None
        pids = json.loads(child.stdout.readline())
        assert len(pids) == 2
        assert all(_alive(p) for p in pids)
    finally:
        os.kill(child.pid, signal.SIGKILL)
        child.wait()
    deadline = time.monotonic() + 30  # SIGKILL is immediate; this bounds a wedged kernel
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = [p for p in pids if _alive(p)]
    for p in left:  # do not leak them into the rest of the run, then fail
        os.kill(p, signal.SIGKILL)
    assert left == []
