"""Shared host memory: exact segments, other processes, ownership, and cleanup after crashes."""

from __future__ import annotations

import fcntl
import os
import re
import secrets
import stat
import subprocess
from collections.abc import Iterator

import pytest
import torch

from hicache.adapters.host_memory import ShmRegion, gc_segments, list_segments
from hicache.domain import ConfigError, HostMemoryError, MemoryKind
from tests.adapters.conftest import PAGE, SHM_DIR, python_command, rss_bytes, run_python
from tests.child_process import dead_pid

MiB = 1 << 20

OWNER_THEN_SLEEP = """
import sys, time
from hicache.adapters.host_memory import ShmRegion
region = ShmRegion.create(int(sys.argv[1]))
region.tensor()[:3] = 1
print(region.name, flush=True)
time.sleep(120)
"""


def start_and_kill_owner(nbytes: int, cleanup: list[str]) -> tuple[str, int]:
    """A fresh process creates a segment and is killed with SIGKILL: (segment name, its pid)."""
    proc = subprocess.Popen(
        [*python_command(OWNER_THEN_SLEEP), str(nbytes)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        name = proc.stdout.readline().strip()
    finally:
        proc.kill()
        _, err = proc.communicate()
    assert name, f"the owner process printed no segment name: {err}"
    cleanup.append(name)
    return name, proc.pid


@pytest.fixture
def owner() -> Iterator[ShmRegion]:
    region = ShmRegion.create(3 * PAGE + 5)
    yield region
    region.close()


# --- one process --------------------------------------------------------------------------------


def test_segment_is_named_after_its_owner_and_has_exactly_the_size_asked() -> None:
    nbytes = 5 * PAGE + 7
    with ShmRegion.create(nbytes) as region:
        assert re.fullmatch(rf"hicache-{os.getpid()}-[0-9a-f]{{16}}", region.name)
        assert region.path == SHM_DIR / region.name
        assert region.owner
        assert region.owner_pid == os.getpid()
        assert region.kind == MemoryKind("shm")
        assert region.nbytes == nbytes
        assert region.tensor().shape == (nbytes,)
        assert os.stat(region.path).st_size == nbytes
        assert region.shm_name == region.name


@pytest.mark.parametrize("umask", [0o000, 0o022, 0o077])
def test_segment_mode_is_0600_whatever_the_umask(umask: int) -> None:
    old = os.umask(umask)
    try:
        region = ShmRegion.create(PAGE)
    finally:
        os.umask(old)
    with region:
        st = os.stat(region.path)
        assert stat.S_IMODE(st.st_mode) == 0o600
        assert st.st_uid == os.getuid()


def test_tensor_writes_are_seen_through_the_file_and_another_mapping(owner: ShmRegion) -> None:
    owner.tensor()[10:14] = torch.tensor([1, 2, 3, 4], dtype=torch.uint8)
    assert owner.path.read_bytes()[10:14] == bytes([1, 2, 3, 4])
    with ShmRegion.attach(owner.name) as other:
        assert not other.owner
        assert other.address != owner.address  # a second mapping of the same bytes
        assert other.tensor()[10:14].tolist() == [1, 2, 3, 4]
        other.tensor()[-1] = 77
        assert int(owner.tensor()[-1]) == 77


def test_owner_pages_are_reserved_and_faulted_in_at_creation() -> None:
    nbytes = 32 * MiB + 100
    before = rss_bytes("RssShmem")
    with ShmRegion.create(nbytes) as region:
        grown = rss_bytes("RssShmem") - before
        assert 0.99 * nbytes <= grown <= 1.01 * nbytes, f"RSS grew {grown} B for {nbytes} B"
        assert os.stat(region.path).st_blocks * 512 <= 1.01 * nbytes
        assert int(region.tensor().count_nonzero()) == 0


def test_attacher_close_keeps_the_segment_and_owner_close_removes_it() -> None:
    region = ShmRegion.create(PAGE)
    attached = ShmRegion.attach(region.name, nbytes=PAGE, prefault_pages=True)
    attached.close()
    attached.close()
    assert region.path.exists()
    region.close()
    assert not region.path.exists()
    region.close()
    assert region.closed
    with pytest.raises(HostMemoryError, match="closed"):
        region.tensor()
    with pytest.raises(HostMemoryError, match="no shared-memory segment"):
        ShmRegion.attach(region.name)


def test_a_dropped_owner_removes_its_segment() -> None:
    region = ShmRegion.create(PAGE)
    path = region.path
    del region
    assert not path.exists()


def test_a_view_outliving_close_no_longer_keeps_the_segment() -> None:
    # Deliberate change (issue 8): the name and the pages go at close, views or not.
    region = ShmRegion.create(2 * PAGE)
    view = region.tensor()[PAGE:]
    view.fill_(3)
    region.close()
    assert not region.path.exists()
    assert region.closed
    del view


def test_attach_checks_the_size(owner: ShmRegion) -> None:
    with pytest.raises(HostMemoryError, match=rf"holds {owner.nbytes} B, expected 4096 B"):
        ShmRegion.attach(owner.name, nbytes=4096)


@pytest.mark.parametrize(
    "name", ["../etc/passwd", "hicache-12-XYZ", "hicache-0-abcdef01", "psm_123", "", 42]
)
def test_attach_refuses_names_that_are_not_hicache_segments(name: object) -> None:
    with pytest.raises(ConfigError, match="hicache-<owner pid>-<hex>"):
        ShmRegion.attach(name)  # type: ignore[arg-type]


def test_a_full_dev_shm_is_an_error_and_leaves_no_segment() -> None:
    vfs = os.statvfs(SHM_DIR)
    too_big = vfs.f_blocks * vfs.f_frsize + (1 << 30)
    before = {p.name for p in SHM_DIR.iterdir()}
    with pytest.raises(HostMemoryError, match=rf"cannot reserve {too_big} B.*B free in /dev/shm"):
        ShmRegion.create(too_big)
    assert {p.name for p in SHM_DIR.iterdir()} - before == set()


# --- other processes ----------------------------------------------------------------------------


def test_a_second_process_attaches_by_name_and_reads_and_writes(owner: ShmRegion) -> None:
    owner.tensor()[:5] = torch.tensor([10, 20, 30, 40, 50], dtype=torch.uint8)
    owner.tensor()[-1] = 99
    proc = run_python(
        """
        import sys
        from hicache.adapters.host_memory import ShmRegion
        region = ShmRegion.attach(sys.argv[1], nbytes=int(sys.argv[2]))
        t = region.tensor()
        print(t[:5].tolist(), int(t[-1]), region.owner)
        t[100:103] = 7
        # exits without closing: an attacher never removes the segment, even at exit
        """,
        owner.name,
        str(owner.nbytes),
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[10, 20, 30, 40, 50] 99 False"
    assert owner.tensor()[100:103].tolist() == [7, 7, 7]
    assert owner.path.exists()
    with ShmRegion.attach(owner.name) as again:  # still attachable by name
        assert again.tensor()[100:103].tolist() == [7, 7, 7]


def test_the_owner_removes_its_segments_at_normal_exit_but_not_a_forked_child() -> None:
    proc = run_python(
        """
        import os, sys
        from hicache.adapters.host_memory import ShmRegion
        kept = ShmRegion.create(4096)  # never closed
        print(kept.name, flush=True)
        pid = os.fork()
        if pid == 0:
            sys.exit(0)  # a normal exit of a child that inherited the region
        os.waitpid(pid, 0)
        print(kept.path.exists(), flush=True)
        """
    )
    assert proc.returncode == 0, proc.stderr
    name, survived_child = proc.stdout.split()
    assert survived_child == "True"
    assert not (SHM_DIR / name).exists()


def test_a_segment_of_an_owner_killed_with_sigkill_is_removed_by_gc(
    shm_cleanup: list[str],
) -> None:
    name, pid = start_and_kill_owner(2 * PAGE, shm_cleanup)
    assert (SHM_DIR / name).exists()  # a crash leaves it
    info = {s.name: s for s in list_segments()}[name]
    assert (info.owner_pid, info.alive, info.size) == (pid, False, 2 * PAGE)
    removed = gc_segments()
    assert name in removed
    assert not (SHM_DIR / name).exists()
    assert all(re.fullmatch(r"hicache-\d+-[0-9a-f]+", n) for n in removed)


def test_the_next_create_in_a_fresh_process_removes_dead_owners_segments(
    shm_cleanup: list[str],
) -> None:
    name, _ = start_and_kill_owner(PAGE, shm_cleanup)
    assert (SHM_DIR / name).exists()
    proc = run_python(
        """
        from hicache.adapters.host_memory import ShmRegion
        ShmRegion.create(4096).close()
        """
    )
    assert proc.returncode == 0, proc.stderr
    assert not (SHM_DIR / name).exists()


# --- listing and gc -----------------------------------------------------------------------------


def _plain_segment(name: str, size: int = PAGE) -> int:
    fd = os.open(SHM_DIR / name, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    os.ftruncate(fd, size)
    return fd


def test_gc_keeps_live_owners_and_ignores_foreign_names(
    owner: ShmRegion, shm_cleanup: list[str]
) -> None:
    foreign = f"hicache-test-{secrets.token_hex(4)}"
    shm_cleanup.append(foreign)
    os.close(_plain_segment(foreign))
    info = {s.name: s for s in list_segments()}
    assert foreign not in info
    assert info[owner.name].alive
    assert info[owner.name].owner_pid == os.getpid()
    assert info[owner.name].size == owner.nbytes
    removed = gc_segments()
    assert owner.name not in removed
    assert foreign not in removed
    assert owner.path.exists()
    assert (SHM_DIR / foreign).exists()


def test_gc_leaves_a_dead_pid_segment_whose_lock_is_held(shm_cleanup: list[str]) -> None:
    # What an owner alive in another pid namespace (a container sharing /dev/shm) looks like.
    name = f"hicache-{dead_pid()}-{secrets.token_hex(8)}"
    shm_cleanup.append(name)
    fd = _plain_segment(name)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        assert not {s.name: s for s in list_segments()}[name].alive
        assert name not in gc_segments()
        assert (SHM_DIR / name).exists()
    finally:
        os.close(fd)  # drops the lock
    assert name in gc_segments()
    assert not (SHM_DIR / name).exists()
