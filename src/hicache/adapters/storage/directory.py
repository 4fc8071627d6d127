"""DirectoryStore: the embedded default L3 store, one file per page object under a root.

- DirectoryStore: the Store port over a directory (thread-safe), with an LRU size cap.
- object_name: the hex sha256 of ``str(key)``, the only part of a key that reaches a path.
- SUFFIX / TMP_SUFFIX: the endings of object files and of temporary files being written.
- DirectorySettings (directory_settings), CHUNK / IOV_MAX (object_file): re-exported here.

An object lives at ``root/<h[:2]>/<h>.obj`` with h = sha256(str(key)) in hex, so no key text
ever becomes a path. A put writes ``<h>.<pid>.<random>.tmp`` next to it (the file itself:
hicache.adapters.storage.object_file) and renames it over the object: a reader sees the old
object, the new one or none, never a torn one. A get reads the object straight into the
caller's segments; a damaged object, or one that holds another key, is CORRUPT (a miss the
caller can count apart) and is removed.
Puts of a key already held are skipped (objects are content-addressed). A size cap evicts least
recently used objects (order kept in memory, rebuilt from mtimes at open).

No path below the root is ever followed through a link: the root is opened once, and every
operation (read, write, rename, removal, scan) opens the fan-out folder relative to it with
O_NOFOLLOW and the file relative to that folder, also with O_NOFOLLOW. A fan-out folder replaced
by a symbolic link after the store opened is refused at use: a get is a MISS, a put FATAL, a
removal and a scan leave it alone, and nothing is read or written outside the root.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import secrets
import shutil
import tempfile
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from hicache.adapters.storage.directory_settings import DirectorySettings
from hicache.adapters.storage.format import HEADER_SPAN, CorruptObject
from hicache.adapters.storage.object_file import (
    CHUNK,
    IOV_MAX,
    failed_status,
    flat_segments,
    open_dir,
    open_object,
    read_object,
    write_object,
)
from hicache.adapters.storage.spread import Spreader
from hicache.domain import StoreError
from hicache.domain.storage import (
    PageBuffer,
    StoreHealth,
    StoreKey,
    StoreStatus,
    buffer_nbytes,
    check_batch,
    check_deadline,
    check_keys,
)

SUFFIX = ".obj"
TMP_SUFFIX = ".tmp"
# What opening a fan-out folder without following links raises when the name is a link or
# another non-directory: never followed, refused.
_NOT_A_DIR = frozenset({errno.ELOOP, errno.ENOTDIR})


class _Escape(Exception):
    """A fan-out folder that is a symbolic link (or not a directory): refused, never followed."""


def object_name(key: StoreKey) -> str:
    """The hex sha256 of ``str(key)``: the only thing of a key that reaches the file system."""
    return hashlib.sha256(str(key).encode("ascii")).hexdigest()


class DirectoryStore:
    """The Store port over one directory: atomic puts, checked gets, an LRU size cap."""

    def __init__(self, settings: DirectorySettings | None = None) -> None:
        self.settings = settings or DirectorySettings()
        self._owns_root = self.settings.root is None
        root = self.settings.root or Path(tempfile.mkdtemp(prefix="hicache-store-"))
        try:
            root.mkdir(mode=0o700, parents=True, exist_ok=True)
        except OSError as e:
            raise StoreError(f"directory store root {str(root)!r}: cannot create it: {e}") from e
        if not root.is_dir():
            raise StoreError(f"directory store root {str(root)!r} is not a directory")
        self.root = root
        self._root = str(root)
        try:  # the root itself is the operator's: a link to it is followed, once, here
            self._root_fd = open_dir(self._root, follow=True)
        except OSError as e:
            raise StoreError(f"directory store root {str(root)!r}: cannot open it: {e}") from e
        self._lock = threading.Lock()
        self._index: OrderedDict[str, int] = OrderedDict()  # name -> file bytes, LRU first
        self._used = 0
        self._pending = 0
        self._closed = False
        self._readers = Spreader(self.settings.read_threads, name="hicache-directory-get")
        self._writers = Spreader(self.settings.write_threads, name="hicache-directory-put")
        try:
            self._scan()
        except BaseException:
            os.close(self._root_fd)
            raise

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> DirectoryStore:
        return cls(DirectorySettings.from_config(config))

    @property
    def name(self) -> str:
        return "directory"

    # -- index --------------------------------------------------------------------------------

    @contextlib.contextmanager
    def _fan(self, name: str, *, create: bool = False) -> Any:
        """The open fan-out folder of object ``name`` (made first when ``create``); _Escape
        when it is a link; FileNotFoundError when it does not exist."""
        try:
            fd = open_dir(name[:2], dir_fd=self._root_fd)
        except FileNotFoundError:
            if not create:
                raise
            with contextlib.suppress(FileExistsError):
                os.mkdir(name[:2], 0o700, dir_fd=self._root_fd)
            fd = self._open_fan(name)
        except OSError as e:
            if e.errno in _NOT_A_DIR:
                raise _Escape(name[:2]) from e
            raise
        try:
            yield fd
        finally:
            os.close(fd)

    def _open_fan(self, name: str) -> int:
        try:
            return open_dir(name[:2], dir_fd=self._root_fd)
        except OSError as e:
            if e.errno in _NOT_A_DIR:
                raise _Escape(name[:2]) from e
            raise

    def _scan(self) -> None:
        """Rebuild the LRU order from mtimes; drop temp files older than stale_tmp_s."""
        found: list[tuple[int, str, int]] = []
        now = time.time()
        with os.scandir(self._root_fd) as fans:
            names = [f.name for f in fans if len(f.name) == 2]
        for fan in sorted(names):
            try:
                with self._fan(fan) as fd, os.scandir(fd) as entries:
                    for entry in entries:
                        if not entry.is_file(follow_symlinks=False):
                            continue
                        try:
                            st = entry.stat(follow_symlinks=False)
                        except FileNotFoundError:  # removed by another process sharing the root
                            continue
                        if entry.name.endswith(SUFFIX):
                            found.append((st.st_mtime_ns, entry.name[: -len(SUFFIX)], st.st_size))
                        elif entry.name.endswith(TMP_SUFFIX) and now - st.st_mtime >= (
                            self.settings.stale_tmp_s
                        ):
                            with contextlib.suppress(FileNotFoundError):
                                os.unlink(entry.name, dir_fd=fd)
            except _Escape:  # objects must never be read or written through a link
                raise StoreError(
                    f"directory store root {self._root!r}: {fan!r} is a symbolic link; "
                    "remove it (the root must be private to hicache)"
                ) from None
            except FileNotFoundError:  # removed by another process sharing the root
                continue
        found.sort()
        for _, name, size in found:
            self._index[name] = size
            self._used += size
        with self._lock:
            self._evict_locked(0, keep=None)

    # Every change of an object file (rename, unlink) and its index entry happen together under
    # the lock, so the index always matches the files this process sees; the payload writes
    # and reads, the slow part, run outside it.

    def _evict_locked(self, need: int, keep: str | None) -> bool:
        """Evict LRU objects (never ``keep``) until ``need`` more bytes fit; whether they do."""
        cap = self.settings.capacity_bytes
        if cap is None:
            return True
        for name in list(self._index):
            if self._used + self._pending + need <= cap:
                break
            if name != keep:
                self._unlink_locked(name)
        return self._used + self._pending + need <= cap

    def _unlink_locked(self, name: str) -> None:
        size = self._index.pop(name, None)
        if size is not None:
            self._used -= size
        with contextlib.suppress(FileNotFoundError, _Escape), self._fan(name) as fd:
            os.unlink(name + SUFFIX, dir_fd=fd)

    def _sync_locked(self, name: str) -> int | None:
        """Make ``name``'s entry match its file (most recently used if present); its size."""
        old = self._index.pop(name, None)
        self._used -= old or 0
        try:
            with self._fan(name) as fd:
                size = os.stat(name + SUFFIX, dir_fd=fd, follow_symlinks=False).st_size
        except (OSError, _Escape):
            return None
        self._index[name] = size
        self._used += size
        return size

    def _touch(self, name: str) -> None:
        with self._lock:
            if name in self._index:
                self._index.move_to_end(name)
            else:
                self._sync_locked(name)

    @property
    def used_bytes(self) -> int:
        with self._lock:
            return self._used

    def __len__(self) -> int:
        with self._lock:
            return len(self._index)

    # -- the port -----------------------------------------------------------------------------

    def register(self, regions: Sequence[memoryview]) -> None:
        """Nothing to register: files are read and written with ordinary system calls."""

    def _deadline(self, deadline: float | None) -> float | None:
        deadline = check_deadline(deadline)
        if deadline is None and self.settings.timeout_s is not None:
            return time.monotonic() + self.settings.timeout_s
        return deadline

    def exists(self, keys: Sequence[StoreKey], *, deadline: float | None = None) -> list[bool]:
        check_keys(keys)
        deadline = self._deadline(deadline)
        out = [False] * len(keys)
        if self._closed:
            return out
        for i, key in enumerate(keys):
            if deadline is not None and time.monotonic() >= deadline:
                break
            name = object_name(key)
            with self._lock:
                # Not indexed: another process sharing the root may have written it.
                out[i] = name in self._index or self._sync_locked(name) is not None
        return out

    def get(
        self,
        keys: Sequence[StoreKey],
        buffers: Sequence[PageBuffer],
        *,
        deadline: float | None = None,
    ) -> list[StoreStatus]:
        return self._batch(keys, buffers, deadline, self._get_one, self._readers)

    def _batch(
        self,
        keys: Sequence[StoreKey],
        buffers: Sequence[PageBuffer],
        deadline: float | None,
        one: Callable[[StoreKey, str, PageBuffer], StoreStatus],
        spreader: Spreader,
    ) -> list[StoreStatus]:
        """``one`` per page, spread over the ``spreader``'s threads; FATAL once closed, TRANSIENT
        once the deadline has passed. Afterwards the pages that answered OK are the most
        recently used, in the batch's order (as if they had run one after another)."""
        check_batch(keys, buffers)
        deadline = self._deadline(deadline)

        names: list[str | None] = [None] * len(keys)

        def page(i: int) -> StoreStatus:
            if self._closed:
                return StoreStatus.FATAL
            if deadline is not None and time.monotonic() >= deadline:
                return StoreStatus.TRANSIENT
            name = names[i] = object_name(keys[i])
            return one(keys[i], name, buffers[i])

        out = spreader.run(len(keys), page)
        if len(keys) > 1:
            with self._lock:
                for name, status in zip(names, out, strict=True):
                    if status is StoreStatus.OK and name is not None and name in self._index:
                        self._index.move_to_end(name)
        return out

    def _get_one(self, key: StoreKey, name: str, buffer: PageBuffer) -> StoreStatus:
        segments = flat_segments(buffer)
        if segments is None:
            return StoreStatus.INVALID
        try:
            with self._fan(name) as fan:
                fd = open_object(name + SUFFIX, dir_fd=fan)
        except FileNotFoundError:
            with self._lock:
                self._sync_locked(name)
            return StoreStatus.MISS
        except _Escape:  # a link where the fan-out folder was: never read through it
            return StoreStatus.MISS
        except OSError:
            return StoreStatus.TRANSIENT
        try:
            status = read_object(fd, key, segments)
        except CorruptObject:
            self._remove_corrupt(name, fd)
            return StoreStatus.CORRUPT
        except OSError:
            return StoreStatus.TRANSIENT
        finally:
            os.close(fd)
        if status.ok:  # INVALID: the object is fine, the request is the wrong size
            self._touch(name)
        return status

    def _remove_corrupt(self, name: str, fd: int) -> None:
        """Unlink the damaged file unless a put has already replaced it with a new one."""
        with self._lock, contextlib.suppress(OSError, _Escape):
            with self._fan(name) as fan:
                now = os.stat(name + SUFFIX, dir_fd=fan, follow_symlinks=False).st_ino
            if now == os.fstat(fd).st_ino:
                self._unlink_locked(name)
            else:
                self._sync_locked(name)

    def put(
        self,
        keys: Sequence[StoreKey],
        buffers: Sequence[PageBuffer],
        *,
        deadline: float | None = None,
    ) -> list[StoreStatus]:
        return self._batch(keys, buffers, deadline, self._put_one, self._writers)

    def _put_one(self, key: StoreKey, name: str, buffer: PageBuffer) -> StoreStatus:
        segments = flat_segments(buffer)
        if segments is None:
            return StoreStatus.INVALID
        size = HEADER_SPAN + buffer_nbytes(segments)
        cap = self.settings.capacity_bytes
        if cap is not None and size > cap:
            return StoreStatus.FULL
        with self._lock:
            if self._sync_locked(name) == size:
                return StoreStatus.OK  # content-addressed: the same key holds the same bytes
            if not self._evict_locked(size, keep=name):
                return StoreStatus.FULL
            self._pending += size
        status, tmp = StoreStatus.TRANSIENT, None
        try:
            with self._fan(name, create=True) as fan:
                try:
                    status, tmp = self._write_tmp(key, name, segments, fan)
                finally:
                    with self._lock:
                        self._pending -= size
                        size = 0
                        if tmp is not None:
                            try:
                                os.rename(tmp, name + SUFFIX, src_dir_fd=fan, dst_dir_fd=fan)
                            except OSError as e:
                                status = failed_status(e)
                                with contextlib.suppress(OSError):
                                    os.unlink(tmp, dir_fd=fan)
                            self._sync_locked(name)
                if status.ok and self.settings.fsync:
                    os.fsync(fan)
        except _Escape:  # a link where the fan-out folder was: never written through
            status = StoreStatus.FATAL
        except OSError as e:
            status = failed_status(e)
        finally:
            if size:  # the folder could not be opened: nothing was written
                with self._lock:
                    self._pending -= size
        return status

    def _write_tmp(
        self, key: StoreKey, name: str, segments: list[memoryview], fan: int
    ) -> tuple[StoreStatus, str | None]:
        """Write the object to a fresh temporary file in its open fan-out folder ``fan``; its
        name and OK, or a status."""
        tmp = f"{name}.{os.getpid()}.{secrets.token_hex(4)}{TMP_SUFFIX}"
        write = self.settings.checksum, self.settings.fsync
        try:
            write_object(tmp, key, segments, write[0], fsync=write[1], dir_fd=fan)
        except OSError as e:
            return failed_status(e), None
        return StoreStatus.OK, tmp

    def remove(self, keys: Sequence[StoreKey]) -> list[StoreStatus]:
        check_keys(keys)
        out = []
        for key in keys:
            if self._closed:
                out.append(StoreStatus.FATAL)
                continue
            try:
                with self._lock:
                    self._unlink_locked(object_name(key))
            except OSError:
                out.append(StoreStatus.TRANSIENT)
                continue
            out.append(StoreStatus.OK)
        return out

    def health(self) -> StoreHealth:
        if self._closed:
            return StoreHealth(False, "closed")
        if not self.root.is_dir():
            return StoreHealth(False, f"root {str(self.root)!r} is gone")
        if not os.access(self.root, os.W_OK | os.X_OK):
            return StoreHealth(False, f"root {str(self.root)!r} is not writable")
        cap = self.settings.capacity_bytes
        with self._lock:
            detail = f"{len(self._index)} objects, {self._used} B" + (
                f" of {cap} B" if cap is not None else ""
            )
        return StoreHealth(True, detail)

    def close(self) -> None:
        """Later calls answer FATAL. A temporary root this store made is removed."""
        if self._closed:
            return
        self._closed = True
        self._readers.close()  # pages in flight on helper threads finish first
        self._writers.close()
        os.close(self._root_fd)
        if self._owns_root:
            shutil.rmtree(self.root, ignore_errors=True)

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"{len(self)} objects, {self.used_bytes} B"
        return f"<DirectoryStore {str(self.root)!r}: {state}>"


# DirectorySettings, CHUNK and IOV_MAX live in directory_settings / object_file; re-exported here.
__all__ = [
    "CHUNK",
    "IOV_MAX",
    "SUFFIX",
    "TMP_SUFFIX",
    "DirectorySettings",
    "DirectoryStore",
    "object_name",
]
