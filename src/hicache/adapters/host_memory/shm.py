"""Shared host memory: named POSIX shared-memory segments under /dev/shm.

- ShmRegion: one segment mapped MAP_SHARED; ShmRegion.create(nbytes) makes a new one (owner),
  ShmRegion.attach(name) maps an existing one (attacher, never removes it).
- SegmentInfo: name, owner pid, whether the owner is alive, size in bytes.
- list_segments: every hicache segment under /dev/shm.
- gc_segments: remove the segments whose owner died; returns the names removed.

Naming and ownership: a segment is named ``hicache-<owner pid>-<16 hex digits>``, created with
O_CREAT | O_EXCL and mode 0600. The owner holds an exclusive flock on it for its whole life,
removes it on close(), when the region is garbage-collected and at normal interpreter exit
(weakref.finalize, so a live region is not kept alive by the exit hook). A crashed owner
(SIGKILL, OOM kill) cannot remove it: the next ShmRegion.create in any process (once per process)
and ``hicache shm gc`` remove segments whose owner pid is dead and whose lock is free.
multiprocessing.shared_memory is deliberately not used: its resource tracker unlinks a segment
when a process that only attached to it exits.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import mmap
import os
import re
import secrets
import threading
import weakref
from pathlib import Path
from typing import Any

import attrs
import torch

from hicache.adapters.host_memory.anonymous import prefault
from hicache.adapters.host_memory.base import ViewedRegion, check_nbytes
from hicache.domain import ConfigError, HiCacheError, HostMemoryError, MemoryKind

SHM_DIR = Path("/dev/shm")
NAME_PREFIX = "hicache-"
SEGMENT_MODE = 0o600
_NAME_RE = re.compile(r"^hicache-([1-9][0-9]{0,9})-([0-9a-f]{8,64})$")
_PID_MAX_LIMIT = 1 << 22  # Linux never hands out a pid above this (PID_MAX_LIMIT)


@attrs.frozen
class SegmentInfo:
    """One hicache segment under /dev/shm as ``hicache shm list`` shows it."""

    name: str
    owner_pid: int
    alive: bool
    size: int

    def as_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "owner_pid": self.owner_pid,
            "alive": self.alive,
            "size": self.size,
        }


def parse_segment_name(name: str) -> int | None:
    """The owner pid encoded in a hicache segment name, or None if ``name`` is not one."""
    m = _NAME_RE.match(name)
    return int(m.group(1)) if m else None


def _check_name(name: object) -> str:
    if not isinstance(name, str) or parse_segment_name(name) is None:
        raise ConfigError(
            f"not a hicache shared-memory segment name: {name!r}: expected "
            "hicache-<owner pid>-<hex>, as `hicache shm list` shows"
        )
    return name


def _pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists and has not exited (a zombie counts as dead)."""
    if pid <= 0 or pid >= _PID_MAX_LIMIT:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # it exists; it belongs to someone else
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    fields = stat.rsplit(")", 1)[-1].split()
    return not (fields and fields[0] in ("Z", "X"))


def list_segments() -> list[SegmentInfo]:
    """Every hicache segment under /dev/shm, sorted by name (empty if there is no /dev/shm)."""
    try:
        entries = sorted(os.scandir(SHM_DIR), key=lambda e: e.name)
    except FileNotFoundError:
        return []
    except OSError as e:
        raise HostMemoryError(f"cannot list {SHM_DIR}: {e.strerror} (errno {e.errno})") from e
    found = []
    for entry in entries:
        pid = parse_segment_name(entry.name)
        if pid is None:
            continue
        try:
            st = entry.stat(follow_symlinks=False)
        except FileNotFoundError:
            continue  # removed while we looked
        found.append(SegmentInfo(entry.name, pid, _pid_alive(pid), st.st_size))
    return found


def gc_segments() -> list[str]:
    """Remove the segments whose owner pid is dead; returns the names removed.

    A segment is removed only if its exclusive lock can be taken, so a segment whose owner is
    alive in another pid namespace (a container sharing /dev/shm) is left alone. Segments that
    this user may not open or remove are skipped.
    """
    return [
        info.name
        for info in list_segments()
        if not info.alive and _remove_if_unlocked(SHM_DIR / info.name)
    ]


def _remove_if_unlocked(path: Path) -> bool:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except OSError:
        return False  # gone already, or someone else's
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return False  # its owner still holds it
        try:
            if os.stat(path, follow_symlinks=False).st_ino != os.fstat(fd).st_ino:
                return False  # replaced while we looked
            os.unlink(path)
        except OSError:
            return False
        return True
    finally:
        os.close(fd)


class _GcOnce:
    """Runs gc_segments at the first segment creation of each process (fork included)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._done_in_pid: int | None = None

    def __call__(self) -> None:
        with self._lock:
            if self._done_in_pid == os.getpid():
                return
            self._done_in_pid = os.getpid()
        # Best effort: creating the segment reports a broken /dev/shm itself.
        with contextlib.suppress(HostMemoryError):
            gc_segments()


_gc_once = _GcOnce()


def _release_owned(path: Path, fd: int, owner_pid: int) -> None:
    """Finalizer of an owner: remove the segment and drop the lock (never in a forked child)."""
    if os.getpid() != owner_pid:
        return
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    finally:
        os.close(fd)


class ShmRegion(ViewedRegion):
    """A named POSIX shared-memory segment mapped MAP_SHARED; see the module docstring."""

    def __init__(
        self, *, name: str, mapping: mmap.mmap, view: torch.Tensor, owner_fd: int | None
    ) -> None:
        # Use ShmRegion.create or ShmRegion.attach; this only takes ownership of what they opened.
        self.kind = MemoryKind("shm")
        self.name = name
        self.path = SHM_DIR / name
        self.nbytes = len(mapping)
        self.owner = owner_fd is not None
        self.owner_pid = int(parse_segment_name(name) or 0)
        self._mmap: mmap.mmap | None = mapping
        self._tensor = view
        self._address = int(view.data_ptr())
        self._label = f"shared-memory region {name}"
        self._finalizer: weakref.finalize[Any, Any] | None = None
        if owner_fd is not None:
            self._finalizer = weakref.finalize(
                self, _release_owned, self.path, owner_fd, os.getpid()
            )

    @classmethod
    def create(cls, nbytes: int) -> ShmRegion:
        """A new segment of exactly ``nbytes`` (reserved and pre-faulted) owned by this process."""
        check_nbytes(nbytes)
        _gc_once()
        name = f"{NAME_PREFIX}{os.getpid()}-{secrets.token_hex(8)}"
        path = SHM_DIR / name
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW
        try:
            fd = os.open(path, flags, SEGMENT_MODE)
        except OSError as e:
            raise HostMemoryError(
                f"cannot create shared-memory segment {path}: {e.strerror} (errno {e.errno})"
            ) from e
        mapping: mmap.mmap | None = None
        try:
            os.fchmod(fd, SEGMENT_MODE)  # exactly 0600 whatever the umask
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            _reserve(fd, path, nbytes)
            mapping = mmap.mmap(
                fd, nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE
            )
            view = torch.frombuffer(mapping, dtype=torch.uint8)
            prefault(mapping, view, write=True)
            region = cls(name=name, mapping=mapping, view=view, owner_fd=fd)
        except BaseException as e:
            if mapping is not None:
                mapping.close()
            _unlink_quietly(path)
            os.close(fd)
            if isinstance(e, OSError) and not isinstance(e, HiCacheError):
                raise HostMemoryError(
                    f"cannot set up shared-memory segment {path} of {nbytes} B: "
                    f"{e.strerror} (errno {e.errno})"
                ) from e
            raise
        return region

    @classmethod
    def attach(
        cls, name: str, *, nbytes: int | None = None, prefault_pages: bool = False
    ) -> ShmRegion:
        """Map the existing segment ``name``; this process will never remove it.

        ``nbytes``, if given, must equal the segment's size. ``prefault_pages`` maps every page
        now (without changing a byte) instead of on first access.
        """
        _check_name(name)
        if nbytes is not None:
            check_nbytes(nbytes, "expected segment size")
        path = SHM_DIR / name
        try:
            fd = os.open(path, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
        except FileNotFoundError:
            raise HostMemoryError(
                f"no shared-memory segment {name!r} in {SHM_DIR}: its owner closed it or died "
                "(see `hicache shm list`)"
            ) from None
        except OSError as e:
            raise HostMemoryError(
                f"cannot open shared-memory segment {path}: {e.strerror} (errno {e.errno})"
            ) from e
        try:
            size = os.fstat(fd).st_size
            if size == 0:
                raise HostMemoryError(
                    f"shared-memory segment {name!r} is empty (still being created?)"
                )
            if nbytes is not None and size != nbytes:
                raise HostMemoryError(
                    f"shared-memory segment {name!r} holds {size} B, expected {nbytes} B"
                )
            mapping = mmap.mmap(
                fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE
            )
        except OSError as e:
            if isinstance(e, HiCacheError):
                raise
            raise HostMemoryError(
                f"cannot map shared-memory segment {path}: {e.strerror} (errno {e.errno})"
            ) from e
        finally:
            os.close(fd)  # the mapping keeps the memory; an attacher holds no lock
        try:
            view = torch.frombuffer(mapping, dtype=torch.uint8)
            if prefault_pages:
                prefault(mapping, view, write=False)
        except BaseException:
            mapping.close()
            raise
        return cls(name=name, mapping=mapping, view=view, owner_fd=None)

    @property
    def shm_name(self) -> str:
        return self.name

    def close(self) -> None:
        """Unmap (once no view is left); the owner also removes the segment. Idempotent."""
        self._tensor = None
        self._mmap = None  # see AnonymousRegion.close: views keep the mapping until they go
        if self._finalizer is not None:
            self._finalizer()  # runs once: unlink and drop the lock

    def __repr__(self) -> str:
        role = "owner" if self.owner else "attached"
        state = "closed" if self.closed else f"at 0x{self._address:x}"
        return f"<ShmRegion {self.name} {self.nbytes} B {role} {state}>"


def _reserve(fd: int, path: Path, nbytes: int) -> None:
    """Size the segment and reserve its pages now, so a full /dev/shm is an error, not SIGBUS."""
    try:
        os.posix_fallocate(fd, 0, nbytes)
    except OSError as e:
        if e.errno not in (errno.ENOSPC, errno.ENOMEM):
            raise
        try:
            vfs = os.statvfs(path.parent)
            free = f"; {vfs.f_bavail * vfs.f_frsize} B free in {path.parent}"
        except OSError:
            free = ""
        raise HostMemoryError(
            f"cannot reserve {nbytes} B for shared-memory segment {path.name}: {e.strerror}{free}"
        ) from e
    size = os.fstat(fd).st_size
    if size != nbytes:
        raise HostMemoryError(
            f"shared-memory segment {path.name} has {size} B after reserving {nbytes} B"
        )


def _unlink_quietly(path: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
