"""One DirectoryStore object file: written whole into a fresh file, read back checked.

- flat_segments: a PageBuffer's segments as flat byte views, or None if one is not contiguous.
- write_object: create a new file (O_EXCL, 0600) and write a key's header and payload into it.
- open_object: open an object file for reading (never through a symbolic link, never a FIFO,
  device or socket: those are refused before anything reads, a reader never blocks on them).
- read_object: check an open object against a key and read its payload into segments.
- failed_status: the StoreStatus of a failed file operation (FULL for a full disk or quota).
- open_dir: open a directory without following a link (the store's fan-out folders).
- CHUNK / IOV_MAX: the bytes checked and moved per system call, and the segments per call.
- use_native_io: switch the C path for XXH3 and BLOCKSUM64 objects off or on (the same files
  either way).

The file is a header (hicache.adapters.storage.format) then the payload, the page's segments
concatenated. Payload bytes move with os.pwritev / os.preadv in batches of at most CHUNK bytes
(a layer-first page's many small segments travel in one call), each batch fed to the checksum
while it is still in the CPU cache (a get reads READ_CHUNK at a time: one core's L2). XXH3 (the
default) and BLOCKSUM64 objects move through the C helper
of hicache.adapters.storage.native_io instead: one call per object, 256 KiB chunks (an L2's
worth), no GIL, no numpy temporaries (for XXH3 the helper calls xxHash's own update function,
from the xxhash package, on each chunk); the digest is the same, so files written by one path
read by the other. Where the file lives, and the rename that publishes it, are the store's
(hicache.adapters.storage.directory).
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat

from hicache.adapters.storage.checksum import Checksum, Summer
from hicache.adapters.storage.format import (
    HEADER_SPAN,
    CorruptObject,
    check_key,
    decode_header,
    encode_header,
)
from hicache.adapters.storage.native_io import NativeIo, native_io
from hicache.domain.storage import PageBuffer, StoreKey, StoreStatus, buffer_nbytes

IOV_MAX = 512  # segments per pwritev call (Linux allows 1024)
CHUNK = 1 << 20  # puts check and write this much at a time
# gets read and check this much at a time: a piece is hashed right after it arrives, while it
# is still in one core's L2 (as the C path's 256 KiB chunks)
READ_CHUNK = 256 << 10
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_NONBLOCK = getattr(os, "O_NONBLOCK", 0)
_FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG})


def flat_segments(buffer: PageBuffer) -> list[memoryview] | None:
    """The buffer's segments as flat byte views, or None if one is not contiguous."""
    out = []
    for seg in buffer:
        if not isinstance(seg, memoryview) or not seg.c_contiguous:
            return None
        out.append(seg if seg.format == "B" and seg.ndim == 1 else seg.cast("B"))
    return out


def write_object(
    path: str,
    key: StoreKey,
    segments: list[memoryview],
    checksum: Checksum,
    *,
    fsync: bool,
    dir_fd: int | None = None,
) -> None:
    """Create ``path`` (it must not exist; relative to the directory open at ``dir_fd`` when
    given) holding ``key``'s header and the payload ``segments``, fsynced if asked. On any
    failure, or interruption, ``path`` is removed and the error raised."""
    fd = -1
    try:
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW | _CLOEXEC
        fd = os.open(path, flags, 0o600, dir_fd=dir_fd)
        native = _native(checksum)
        moved = None if native is None else _native_write(native, checksum, fd, segments)
        if moved is not None:
            digest = moved[1]
        else:
            summer = Summer(checksum)
            _write_checked(fd, segments, HEADER_SPAN, summer)
            digest = summer.digest()
        header = encode_header(key, buffer_nbytes(segments), checksum, digest)
        _write_all(fd, [memoryview(header)], 0)
        if fsync:
            os.fsync(fd)
        os.close(fd)
        fd = -1
    except BaseException:
        if fd >= 0:
            os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(path, dir_fd=dir_fd)
        raise


def open_object(path: str, *, dir_fd: int | None = None) -> int:
    """A read-only descriptor of the object file ``path`` (relative to ``dir_fd`` when given;
    OSError if absent or a link).

    Opened non-blocking and checked with fstat before anything reads it: a FIFO, device or
    socket at an object's name (never a file the store wrote) is FileNotFoundError (a miss),
    so a reader never waits on it forever.
    """
    fd = os.open(path, os.O_RDONLY | _NOFOLLOW | _CLOEXEC | _NONBLOCK, dir_fd=dir_fd)
    try:
        mode = os.fstat(fd).st_mode
    except BaseException:
        os.close(fd)
        raise
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise FileNotFoundError(
            errno.ENOENT, "not a regular file (a FIFO, device or socket): no object here", path
        )
    return fd


def read_object(fd: int, key: StoreKey, segments: list[memoryview]) -> StoreStatus:
    """Read the object open at ``fd`` into ``segments``: OK once its header names ``key`` and
    its payload matches the header's checksum; INVALID (nothing read) when the payload is
    another size than the segments. CorruptObject when the file cannot be trusted; OSError
    passes through."""
    st = os.fstat(fd)
    header = decode_header(os.pread(fd, HEADER_SPAN, 0))
    check_key(header, key)
    if st.st_size != HEADER_SPAN + header.payload_len:
        raise CorruptObject(f"file of {st.st_size} B, header says {header.payload_len}")
    if header.payload_len != sum(s.nbytes for s in segments):
        return StoreStatus.INVALID  # the object is fine; the request is the wrong size
    native = _native(header.checksum)
    moved = None if native is None else _native_read(native, header.checksum, fd, segments)
    if moved is not None:
        got, digest = moved
    else:
        summer = Summer(header.checksum)
        got = _read_checked(fd, segments, HEADER_SPAN, summer)
        digest = summer.digest()
    if got != header.payload_len:
        raise CorruptObject("short read")
    if digest != header.payload_crc:
        raise CorruptObject("payload checksum mismatch")
    return StoreStatus.OK


def _native_read(
    native: NativeIo, checksum: Checksum, fd: int, segments: list[memoryview]
) -> tuple[int, int] | None:
    if checksum is Checksum.XXH3:
        return native.read_xxh3(fd, HEADER_SPAN, segments)
    return native.read(fd, HEADER_SPAN, segments)


def _native_write(
    native: NativeIo, checksum: Checksum, fd: int, segments: list[memoryview]
) -> tuple[int, int] | None:
    if checksum is Checksum.XXH3:
        return native.write_xxh3(fd, HEADER_SPAN, segments)
    return native.write(fd, HEADER_SPAN, segments)


def _native(checksum: Checksum) -> NativeIo | None:
    """The C read-and-check path for XXH3 and BLOCKSUM64 (the same digests as the Python path),
    unless it is switched off (``use_native_io(False)``) or cannot be built here."""
    if checksum is Checksum.CRC32 or not _use_native[0]:
        return None
    if not _loaded:
        _loaded.append(native_io()[0])  # built (or found unavailable) once per process
    return _loaded[0]


_loaded: list[NativeIo | None] = []


_use_native = [True]


def use_native_io(enabled: bool) -> None:
    """Whether XXH3 and BLOCKSUM64 objects move through the native helper (default True); the Python
    path writes and reads the same files (tests and `bench storage --python-io` use it)."""
    _use_native[0] = bool(enabled)


def failed_status(e: OSError) -> StoreStatus:
    """FULL when the disk or quota is full, else TRANSIENT (the call may succeed later)."""
    return StoreStatus.FULL if e.errno in _FULL_ERRNOS else StoreStatus.TRANSIENT


def open_dir(path: str, *, dir_fd: int | None = None, follow: bool = False) -> int:
    """A descriptor of the directory ``path`` (relative to ``dir_fd`` when given); a symbolic
    link there is an OSError (ELOOP or ENOTDIR) unless ``follow``."""
    flags = os.O_RDONLY | os.O_DIRECTORY | _CLOEXEC | (0 if follow else _NOFOLLOW)
    return os.open(path, flags, dir_fd=dir_fd)


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


def _batches(views: list[memoryview], chunk: int = CHUNK) -> list[list[memoryview]]:
    """``views`` cut into pieces of at most ``chunk`` bytes, grouped into batches of at most
    ``chunk`` bytes (many small segments of a layer-first page travel in one system call)."""
    batches: list[list[memoryview]] = []
    batch: list[memoryview] = []
    size = 0
    for view in views:
        for start in range(0, view.nbytes, chunk):
            piece = view[start : start + chunk]
            if batch and (size + piece.nbytes > chunk or len(batch) >= IOV_MAX):
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
    for batch in _batches(views, READ_CHUNK):
        want = sum(piece.nbytes for piece in batch)
        got = _read_all(fd, batch, offset + total)
        total += got
        if got < want:
            return total
        for piece in batch:
            summer.update(piece)
    return total
