"""Shared host memory: named POSIX shared-memory segments under /dev/shm.

- ShmRegion: one segment mapped MAP_SHARED; ShmRegion.create(nbytes) makes a new one (owner),
  ShmRegion.attach(name) maps an existing one (attacher, never removes it).
- SegmentInfo: name, owner pid, whether the owner is alive, size in bytes.
- shm_dir: the segment directory, /dev/shm or $HICACHE_SHM_DIR (an absolute path).
- list_segments: every hicache segment under shm_dir().
- gc_segments: remove the segments whose owner died; returns the names removed.
- remove_owned_segments: unlink every segment this process owns now (what the SIGTERM/SIGINT
  hook runs; for applications whose own signal handlers replace hicache's).

Naming and ownership: a segment is named ``hicache-<owner pid>-<16 hex digits>``, created with
O_CREAT | O_EXCL and mode 0600. The owner holds an exclusive flock on it for its whole life,
removes it on close(), when the region is garbage-collected and at normal interpreter exit
(weakref.finalize, so a live region is not kept alive by the exit hook). A crashed owner
(SIGKILL, OOM kill) cannot remove it: the next ShmRegion.create in any process (once per process)
and ``hicache shm gc`` remove segments whose owner pid is dead and whose lock is free.

Robustness: a child forked from the owner (os.fork, multiprocessing's fork start method) closes
its inherited copy of the owner's lock descriptor at once (os.register_at_fork), so the lock dies
with the owner, not with an unrelated child; exec'd children never get it (O_CLOEXEC). Clean-up
opens only regular files of this user whose name matches ``hicache-<pid>-<16 hex>`` exactly, and
opens them O_NONBLOCK | O_NOFOLLOW after an lstat, so a FIFO, symlink or device planted under a
segment-like name is skipped and can never block it. At the first segment created from the main
thread, hicache hooks SIGTERM and SIGINT: the hook unlinks this process's segments, then hands
the signal on to the handler that was there before (the default action, or the application's
handler); a signal the application ignores (SIG_IGN) is left ignored and removes nothing.
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
import signal
import stat
import threading
import weakref
from pathlib import Path
from types import FrameType
from typing import Any

import attrs
import torch

from hicache.adapters.host_memory.anonymous import prefault
from hicache.adapters.host_memory.base import ViewedRegion, check_nbytes, release_range
from hicache.domain import ConfigError, HiCacheError, HostMemoryError, MemoryKind

SHM_DIR = Path("/dev/shm")
SHM_DIR_ENV = "HICACHE_SHM_DIR"
NAME_PREFIX = "hicache-"
SEGMENT_MODE = 0o600
_NAME_RE = re.compile(r"^hicache-([1-9][0-9]{0,9})-([0-9a-f]{16})$")
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


def shm_dir() -> Path:
    """Where segments live: $HICACHE_SHM_DIR if set (an absolute path), else /dev/shm.

    Read at each call, so every process that shares segments must see the same value. Meant for
    a private tmpfs (tests, a container that mounts its own); /dev/shm is what POSIX shm_open
    uses.
    """
    value = os.environ.get(SHM_DIR_ENV)
    if not value:
        return SHM_DIR
    path = Path(value)
    if not path.is_absolute():
        raise ConfigError(f"{SHM_DIR_ENV} must be an absolute path, got {value!r}")
    return path


def list_segments() -> list[SegmentInfo]:
    """Every hicache segment under shm_dir(), sorted by name (empty if there is no such dir)."""
    root = shm_dir()
    try:
        entries = sorted(os.scandir(root), key=lambda e: e.name)
    except FileNotFoundError:
        return []
    except OSError as e:
        raise HostMemoryError(f"cannot list {root}: {e.strerror} (errno {e.errno})") from e
    found = []
    for entry in entries:
        pid = parse_segment_name(entry.name)
        if pid is None:
            continue
        try:
            st = entry.stat(follow_symlinks=False)
        except FileNotFoundError:
            continue  # removed while we looked
        if not stat.S_ISREG(st.st_mode):
            continue  # a FIFO, symlink or device under a segment-like name is no segment
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
        if not info.alive and _remove_if_unlocked(shm_dir() / info.name)
    ]


def _remove_if_unlocked(path: Path) -> bool:
    try:
        st = os.lstat(path)
    except OSError:
        return False
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
        return False  # not a segment, or not ours to remove: never opened
    flags = os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY
    try:
        fd = os.open(path, flags)
    except OSError:
        return False  # gone already, swapped for a symlink, or someone else's
    try:
        opened = os.fstat(fd)
        if not stat.S_ISREG(opened.st_mode) or opened.st_ino != st.st_ino:
            return False  # swapped between the lstat and the open
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return False  # its owner still holds it
        try:
            if os.stat(path, follow_symlinks=False).st_ino != opened.st_ino:
                return False  # replaced while we looked
            os.unlink(path)
        except OSError:
            return False
        return True
    finally:
        os.close(fd)


# -- what this process owns: closed in forked children, unlinked on SIGTERM / SIGINT ------------

# lock descriptor -> segment path, for the segments this process owns. Plain dict operations
# (atomic under the GIL): the fork and signal hooks must not take a lock the interrupted code
# may hold.
_OWNED: dict[int, Path] = {}
_OWNED_PID = os.getpid()
_HOOKED_SIGNALS = (signal.SIGTERM, signal.SIGINT)
_previous_handlers: dict[int, Any] = {}


def _forget_owned_in_child() -> None:
    """After fork, in the child: drop the inherited lock descriptors (the lock is the owner's)."""
    global _OWNED_PID
    for fd in list(_OWNED):
        with contextlib.suppress(OSError):
            os.close(fd)
    _OWNED.clear()
    _OWNED_PID = os.getpid()


os.register_at_fork(after_in_child=_forget_owned_in_child)


def remove_owned_segments() -> list[str]:
    """Unlink every segment this process owns (mappings stay valid); returns their names.

    The SIGTERM/SIGINT hook calls this; an application that replaces hicache's handlers with
    its own can call it from them. The segments' memory stays mapped until closed; other
    processes can no longer attach to them.
    """
    removed: list[str] = []
    if os.getpid() != _OWNED_PID:
        return removed
    for path in list(_OWNED.values()):
        with contextlib.suppress(OSError):
            os.unlink(path)
            removed.append(path.name)
    return removed


def _on_signal(signum: int, frame: FrameType | None) -> None:
    previous = _previous_handlers.get(signum, signal.SIG_DFL)
    if previous is signal.SIG_IGN:
        return
    remove_owned_segments()
    if callable(previous):
        previous(signum, frame)
        return
    # SIG_DFL (or a handler not set from Python): take the default action, as without hicache.
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


def _hook_signals() -> None:
    """Chain SIGTERM and SIGINT to remove_owned_segments (main thread only; once per handler)."""
    if threading.current_thread() is not threading.main_thread():
        return  # signal.signal works only there; see docs/shm.md
    for signum in _HOOKED_SIGNALS:
        current = signal.getsignal(signum)
        if current is _on_signal:
            continue
        _previous_handlers[signum] = current
        signal.signal(signum, _on_signal)


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
        return  # the child closed its copy of ``fd`` right after the fork
    _OWNED.pop(fd, None)
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
        self.path = shm_dir() / name
        self.nbytes = len(mapping)
        self.owner = owner_fd is not None
        self.owner_pid = int(parse_segment_name(name) or 0)
        self._mmap: mmap.mmap | None = mapping
        self._tensor = view
        self._address = int(view.data_ptr())
        self._label = f"shared-memory region {name}"
        self._finalizer: weakref.finalize[Any, Any] | None = None
        if owner_fd is not None:
            _OWNED[owner_fd] = self.path
            self._finalizer = weakref.finalize(
                self, _release_owned, self.path, owner_fd, os.getpid()
            )

    @classmethod
    def create(cls, nbytes: int) -> ShmRegion:
        """A new segment of exactly ``nbytes`` (reserved and pre-faulted) owned by this process."""
        check_nbytes(nbytes)
        _gc_once()
        _hook_signals()
        name = f"{NAME_PREFIX}{os.getpid()}-{secrets.token_hex(8)}"
        path = shm_dir() / name
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW
        try:
            fd = os.open(path, flags, SEGMENT_MODE)
        except OSError as e:
            raise HostMemoryError(
                f"cannot create shared-memory segment {path}: {e.strerror} (errno {e.errno})"
            ) from e
        mapping: mmap.mmap | None = None
        lock_fd: int | None = None
        try:
            os.fchmod(fd, SEGMENT_MODE)  # exactly 0600 whatever the umask
            # The lock lives on an open file description of its own: mmap keeps a dup of the
            # mapping's descriptor, and a forked child would inherit that dup with the lock.
            lock_fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
            fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            _reserve(fd, path, nbytes)
            mapping = mmap.mmap(
                fd, nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE
            )
            view = torch.frombuffer(mapping, dtype=torch.uint8)
            prefault(mapping, view, write=True)
            region = cls(name=name, mapping=mapping, view=view, owner_fd=lock_fd)
        except BaseException as e:
            if mapping is not None:
                mapping.close()
            _unlink_quietly(path)
            if lock_fd is not None:
                os.close(lock_fd)
            os.close(fd)
            if isinstance(e, OSError) and not isinstance(e, HiCacheError):
                raise HostMemoryError(
                    f"cannot set up shared-memory segment {path} of {nbytes} B: "
                    f"{e.strerror} (errno {e.errno})"
                ) from e
            raise
        os.close(fd)  # the mapping keeps its own descriptor; the lock has ``lock_fd``
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
        path = shm_dir() / name
        try:
            fd = os.open(path, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
        except FileNotFoundError:
            raise HostMemoryError(
                f"no shared-memory segment {name!r} in {path.parent}: its owner closed it or died "
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
        """Unlink (owner) and give the pages back now, even if tensors still view them.

        The range becomes an inaccessible placeholder until the last view goes (release_range):
        RSS and, once every process has unmapped it, /dev/shm go down at close, not at garbage
        collection. Idempotent.
        """
        if self._finalizer is not None:
            self._finalizer()  # runs once: unlink and drop the lock
        if self._mmap is None:
            return
        release_range(self._address, self.nbytes)
        self._tensor = None
        self._mmap = None  # unmaps the placeholder once no view is left

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
