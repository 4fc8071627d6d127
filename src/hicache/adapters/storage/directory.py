"""DirectoryStore: the embedded default L3 store, one file per page object under a root.

- DirectorySettings: root, capacity cap, fsync, checksum, default timeout, stale temp age;
  ``from_config`` parses a storage extra config (unknown keys are a ConfigError).
- DirectoryStore: the Store port over a directory (thread-safe).
- object_name: the hex sha256 of ``str(key)``, the only part of a key that reaches a path.

An object lives at ``root/<h[:2]>/<h>.obj`` with h = sha256(str(key)) in hex, so no key text
ever becomes a path. A put writes ``<h>.<pid>.<random>.tmp`` (O_CREAT | O_EXCL) next to it,
optionally fsyncs it, and renames it over the object: a reader sees the old object, the new one
or none, never a torn one. A get reads the header (hicache.adapters.storage.format) and then the
payload straight into the caller's segments with os.preadv; a damaged object, or one that holds
another key, is a MISS and is removed. Puts of a key already held are skipped (objects are
content-addressed). A size cap evicts least recently used objects (order kept in memory,
rebuilt from mtimes at open).
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

import attrs

from hicache.adapters.storage.checksum import Checksum, Summer
from hicache.adapters.storage.format import (
    HEADER_SPAN,
    CorruptObject,
    check_key,
    decode_header,
    encode_header,
)
from hicache.domain import ConfigError, StoreError
from hicache.domain.storage import (
    PageBuffer,
    StoreHealth,
    StoreKey,
    StoreStatus,
    buffer_nbytes,
    check_batch,
)

SUFFIX = ".obj"
TMP_SUFFIX = ".tmp"
IOV_MAX = 512  # segments per pwritev call (Linux allows 1024)
CHUNK = 1 << 20  # puts and gets check and move this much at a time (one core's L2)
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG})
_KEYS = ("root", "capacity_bytes", "fsync", "checksum", "timeout_s", "stale_tmp_s")
# Keys of a storage extra config that other readers own (host memory, plug-in dispatch).
_OTHERS = frozenset({"allocator", "backend_name", "module_path", "class_name"})


def _optional_positive(_inst: object, attr: attrs.Attribute[Any], value: object) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
        raise ConfigError(f"directory store {attr.name} must be a positive number, got {value!r}")


def _non_negative(_inst: object, attr: attrs.Attribute[Any], value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
        raise ConfigError(f"directory store {attr.name} must be >= 0 seconds, got {value!r}")


def _bool(_inst: object, attr: attrs.Attribute[Any], value: object) -> None:
    if not isinstance(value, bool):
        raise ConfigError(f"directory store {attr.name} must be true or false, got {value!r}")


def _root(value: object) -> Path | None:
    if value is None or isinstance(value, Path):
        return value
    if not isinstance(value, str) or not value.strip():
        raise ConfigError(f"directory store root must be a non-empty path, got {value!r}")
    return Path(value)


def _checksum(value: object) -> Checksum:
    return Checksum.parse(value)


@attrs.frozen(kw_only=True)
class DirectorySettings:
    """How a DirectoryStore behaves. ``root=None``: a fresh temporary directory, removed on close."""

    root: Path | None = attrs.field(default=None, converter=_root)
    capacity_bytes: int | None = attrs.field(default=None, validator=_optional_positive)
    fsync: bool = attrs.field(default=False, validator=_bool)
    checksum: Checksum = attrs.field(default=Checksum.BLOCKSUM64, converter=_checksum)
    timeout_s: float | None = attrs.field(default=None, validator=_optional_positive)
    stale_tmp_s: float = attrs.field(default=600.0, validator=_non_negative)

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> DirectorySettings:
        unknown = sorted(set(config) - set(_KEYS) - _OTHERS)
        if unknown:
            raise ConfigError(
                f"directory store extra config has unknown keys {unknown}: expected some of "
                f"{', '.join(_KEYS)}"
            )
        return cls(**{k: config[k] for k in _KEYS if k in config})


def object_name(key: StoreKey) -> str:
    """The hex sha256 of ``str(key)``: the only thing of a key that reaches the file system."""
    return hashlib.sha256(str(key).encode("ascii")).hexdigest()


def _segments(buffer: PageBuffer) -> list[memoryview] | None:
    """The buffer's segments as flat byte views, or None if one is not contiguous."""
    out = []
    for seg in buffer:
        if not isinstance(seg, memoryview) or not seg.c_contiguous:
            return None
        out.append(seg if seg.format == "B" and seg.ndim == 1 else seg.cast("B"))
    return out


def _advance(pending: list[memoryview], done: int) -> None:
    """Drop the first ``done`` bytes of ``pending`` (after a partial vectored read or write)."""
    while done and pending:
        if done >= pending[0].nbytes:
            done -= pending.pop(0).nbytes
        else:
            pending[0] = pending[0][done:]
            done = 0


def _write_all(fd: int, views: list[memoryview], offset: int) -> int:
    """Write ``views`` in order from ``offset``; the offset after them."""
    pending = [v for v in views if v.nbytes]
    while pending:
        done = os.pwritev(fd, pending[:IOV_MAX], offset)
        offset += done
        _advance(pending, done)
    return offset


def _read_all(fd: int, views: list[memoryview], offset: int) -> int:
    """Fill ``views`` in order from ``offset``; the bytes read (fewer only at end of file)."""
    pending = [v for v in views if v.nbytes]
    total = 0
    while pending:
        got = os.preadv(fd, pending[:IOV_MAX], offset + total)
        if got == 0:
            break
        total += got
        _advance(pending, got)
    return total


def _batches(views: list[memoryview]) -> list[list[memoryview]]:
    """``views`` cut into pieces of at most CHUNK bytes, grouped into batches of at most CHUNK
    bytes (many small segments of a layer-first page travel in one system call)."""
    batches: list[list[memoryview]] = []
    batch: list[memoryview] = []
    size = 0
    for view in views:
        for start in range(0, view.nbytes, CHUNK):
            piece = view[start : start + CHUNK]
            if batch and (size + piece.nbytes > CHUNK or len(batch) >= IOV_MAX):
                batches.append(batch)
                batch, size = [], 0
            batch.append(piece)
            size += piece.nbytes
    if batch:
        batches.append(batch)
    return batches


def _write_checked(fd: int, views: list[memoryview], offset: int, summer: Summer) -> None:
    """Write ``views`` from ``offset`` a batch at a time, each fed to ``summer`` just before it
    is written, so the write copies bytes the checksum has just brought into the CPU cache."""
    for batch in _batches(views):
        for piece in batch:
            summer.update(piece)
        offset = _write_all(fd, batch, offset)


def _read_checked(fd: int, views: list[memoryview], offset: int, summer: Summer) -> int:
    """Fill ``views`` from ``offset`` a batch at a time, feeding each batch to ``summer`` while
    it is still in the CPU cache; the bytes read (fewer only at end of file)."""
    total = 0
    for batch in _batches(views):
        want = sum(piece.nbytes for piece in batch)
        got = _read_all(fd, batch, offset + total)
        total += got
        if got < want:
            return total
        for piece in batch:
            summer.update(piece)
    return total


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
        self._lock = threading.Lock()
        self._index: OrderedDict[str, int] = OrderedDict()  # name -> file bytes, LRU first
        self._used = 0
        self._pending = 0
        self._closed = False
        self._scan()

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> DirectoryStore:
        return cls(DirectorySettings.from_config(config))

    @property
    def name(self) -> str:
        return "directory"

    # -- index --------------------------------------------------------------------------------

    def _dir(self, name: str) -> str:
        return f"{self._root}/{name[:2]}"

    def _path(self, name: str) -> str:
        # Plain strings: pathlib costs a few microseconds per call on the get path.
        return f"{self._root}/{name[:2]}/{name}{SUFFIX}"

    def _scan(self) -> None:
        """Rebuild the LRU order from mtimes; drop temp files older than stale_tmp_s."""
        found: list[tuple[int, str, int]] = []
        now = time.time()
        for fan in os.scandir(self.root):
            if len(fan.name) != 2:
                continue
            if fan.is_symlink():  # objects must never be written through a link out of the root
                raise StoreError(
                    f"directory store root {self._root!r}: {fan.name!r} is a symbolic link; "
                    "remove it (the root must be private to hicache)"
                )
            if not fan.is_dir(follow_symlinks=False):
                continue
            for entry in os.scandir(fan.path):
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
                        os.unlink(entry.path)
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
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._path(name))

    def _sync_locked(self, name: str) -> int | None:
        """Make ``name``'s entry match its file (most recently used if present); its size."""
        old = self._index.pop(name, None)
        self._used -= old or 0
        try:
            size = os.stat(self._path(name), follow_symlinks=False).st_size
        except OSError:
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
        if deadline is None and self.settings.timeout_s is not None:
            return time.monotonic() + self.settings.timeout_s
        return deadline

    def exists(self, keys: Sequence[StoreKey], *, deadline: float | None = None) -> list[bool]:
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
        return self._batch(keys, buffers, deadline, self._get_one)

    def _batch(
        self,
        keys: Sequence[StoreKey],
        buffers: Sequence[PageBuffer],
        deadline: float | None,
        one: Callable[[StoreKey, PageBuffer], StoreStatus],
    ) -> list[StoreStatus]:
        """``one`` per page in order; FATAL once closed, TRANSIENT once the deadline has passed."""
        check_batch(keys, buffers)
        deadline = self._deadline(deadline)
        out = []
        for key, buffer in zip(keys, buffers, strict=True):
            if self._closed:
                out.append(StoreStatus.FATAL)
            elif deadline is not None and time.monotonic() >= deadline:
                out.append(StoreStatus.TRANSIENT)
            else:
                out.append(one(key, buffer))
        return out

    def _get_one(self, key: StoreKey, buffer: PageBuffer) -> StoreStatus:
        segments = _segments(buffer)
        if segments is None:
            return StoreStatus.INVALID
        name = object_name(key)
        path = self._path(name)
        try:
            fd = os.open(path, os.O_RDONLY | _NOFOLLOW | _CLOEXEC)
        except FileNotFoundError:
            with self._lock:
                self._sync_locked(name)
            return StoreStatus.MISS
        except OSError:
            return StoreStatus.TRANSIENT
        try:
            st = os.fstat(fd)
            header = decode_header(os.pread(fd, HEADER_SPAN, 0))
            check_key(header, key)
            if st.st_size != HEADER_SPAN + header.payload_len:
                raise CorruptObject(f"file of {st.st_size} B, header says {header.payload_len}")
            if header.payload_len != sum(s.nbytes for s in segments):
                return StoreStatus.INVALID  # the object is fine; the request is the wrong size
            summer = Summer(header.checksum)
            if _read_checked(fd, segments, HEADER_SPAN, summer) != header.payload_len:
                raise CorruptObject("short read")
            if summer.digest() != header.payload_crc:
                raise CorruptObject("payload checksum mismatch")
        except CorruptObject:
            self._remove_corrupt(name, path, fd)
            return StoreStatus.MISS
        except OSError:
            return StoreStatus.TRANSIENT
        finally:
            os.close(fd)
        self._touch(name)
        return StoreStatus.OK

    def _remove_corrupt(self, name: str, path: str, fd: int) -> None:
        """Unlink the damaged file unless a put has already replaced it with a new one."""
        with self._lock, contextlib.suppress(OSError):
            if os.stat(path, follow_symlinks=False).st_ino == os.fstat(fd).st_ino:
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
        return self._batch(keys, buffers, deadline, self._put_one)

    def _put_one(self, key: StoreKey, buffer: PageBuffer) -> StoreStatus:
        segments = _segments(buffer)
        if segments is None:
            return StoreStatus.INVALID
        name = object_name(key)
        path = self._path(name)
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
            status, tmp = self._write_tmp(key, name, path, segments)
        finally:
            with self._lock:
                self._pending -= size
                if tmp is not None:
                    try:
                        os.rename(tmp, path)
                    except OSError as e:
                        status = _failed(e)
                        with contextlib.suppress(OSError):
                            os.unlink(tmp)
                    self._sync_locked(name)
        if status.ok and self.settings.fsync:
            try:
                _fsync_dir(self._dir(name))
            except OSError as e:
                return _failed(e)
        return status

    def _write_tmp(
        self, key: StoreKey, name: str, path: str, segments: list[memoryview]
    ) -> tuple[StoreStatus, str | None]:
        """Write the object to a fresh temporary file next to ``path``; it and OK, or a status."""
        folder = self._dir(name)
        tmp = f"{folder}/{name}.{os.getpid()}.{secrets.token_hex(4)}{TMP_SUFFIX}"
        fd = -1
        try:
            os.makedirs(folder, mode=0o700, exist_ok=True)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW | _CLOEXEC, 0o600)
            summer = Summer(self.settings.checksum)
            _write_checked(fd, segments, HEADER_SPAN, summer)
            header = encode_header(
                key, buffer_nbytes(segments), self.settings.checksum, summer.digest()
            )
            _write_all(fd, [memoryview(header)], 0)
            if self.settings.fsync:
                os.fsync(fd)
            os.close(fd)
            fd = -1
        except BaseException as e:
            if fd >= 0:
                os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            if isinstance(e, OSError):
                return _failed(e), None
            raise
        return StoreStatus.OK, tmp

    def remove(self, keys: Sequence[StoreKey]) -> list[StoreStatus]:
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
        if self._owns_root:
            shutil.rmtree(self.root, ignore_errors=True)

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"{len(self)} objects, {self.used_bytes} B"
        return f"<DirectoryStore {str(self.root)!r}: {state}>"


def _failed(e: OSError) -> StoreStatus:
    """FULL when the disk or quota is full, else TRANSIENT (the call may succeed later)."""
    return StoreStatus.FULL if e.errno in _FULL_ERRNOS else StoreStatus.TRANSIENT


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | _CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
