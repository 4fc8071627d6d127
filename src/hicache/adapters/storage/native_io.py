"""DirectoryStore payload I/O in C: read and check (or check and write) a chunk at a time.

- IO_SOURCE: the C source: ``hs_read`` fills segments from a file with preadv, a chunk at a time,
  and sums each chunk's 4 KiB blocks right after it arrives (still in the core's L2);
  ``hs_write`` sums a chunk (4 MiB) and then writes it with pwritev (the write copies bytes
  the sum has just brought into cache). Both run the whole object in one call, the GIL released.
- NativeIo: the loaded library; ``read(fd, offset, segments)`` and ``write(fd, offset,
  segments)`` return (bytes moved, blocksum64 digest); an I/O error raises OSError.
- load_native_io: build (with the native memcpy helper's compiler and cache folder:
  hicache.adapters.copy.native) and load; NativeBuildError says why not.
- native_io: the process's NativeIo, or None (with the reason) when it cannot be built.

- read_xxh3 / write_xxh3: the same moves with the XXH3 64-bit digest: the helper hands each
  chunk to xxHash's own ``XXH3_64bits_update`` (reached with ctypes in the ``xxhash``
  package's extension module: xxh3_functions), so the hash is the library's code, run without
  the GIL while the chunk is in cache.

The blocksum digest is exactly hicache.adapters.storage.checksum's BLOCKSUM64 (each 4 KiB block of the
stream, the last zero-padded, summed as little-endian uint64 words mod 2**64; zlib.crc32 of the
sums in order): files written either way read either way, so the format version is unchanged.
The Python path (numpy sums per 1 MiB batch) stays for CRC32 objects and where no compiler is.
"""

from __future__ import annotations

import ctypes
import importlib
import os
import threading
import zlib
from pathlib import Path

import numpy as np

from hicache.adapters.copy.native import NativeBuildError, load_helper

IO_ABI = 2
BLOCK = 4096
IO_CHUNK = 256 << 10  # bytes read and summed per step: fits the L2 of one core
# Bytes summed then written per step. Larger than a read's: a write that extends a file pays
# per call (page cache pages allocated, the inode updated), and on the development VM 256 KiB
# writes ran at 0.5-0.7x of one 4 MiB write while 4 MiB steps ran at 0.9-1.0x; the sum leaves
# the step in L3 for the write's copy.
IO_WRITE_CHUNK = 4 << 20

IO_SOURCE = r"""
/* hicache DirectoryStore payload I/O (ABI 2). Built by hicache.adapters.storage.native_io. */
#define _GNU_SOURCE
#include <errno.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include <sys/types.h>
#include <sys/uio.h>
#include <unistd.h>

#define HS_BLOCK 4096
#define HS_IOV 512

int64_t hs_abi_version(void) { return 2; }

static inline uint64_t hs_word(const uint8_t *p) {
    uint64_t w;
    memcpy(&w, p, 8);
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
    w = __builtin_bswap64(w);
#endif
    return w;
}

/* The sum mod 2**64 of one block's 512 little-endian words: four independent chains. */
static uint64_t hs_block_sum(const uint8_t *p) {
    uint64_t a = 0, b = 0, c = 0, d = 0;
    for (int i = 0; i < HS_BLOCK; i += 32) {
        a += hs_word(p + i);
        b += hs_word(p + i + 8);
        c += hs_word(p + i + 16);
        d += hs_word(p + i + 24);
    }
    return a + b + c + d;
}

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
/* AVX2: four 64-bit lanes per add, two loads per cycle: the sum of a block in L2 costs a tenth
   of the copy that brought it there (the scalar loop costs about a third). */
__attribute__((target("avx2"))) static uint64_t hs_block_sum_avx2(const uint8_t *p) {
    __m256i a = _mm256_setzero_si256(), b = a, c = a, d = a;
    for (int i = 0; i < HS_BLOCK; i += 128) {
        a = _mm256_add_epi64(a, _mm256_loadu_si256((const __m256i *)(p + i)));
        b = _mm256_add_epi64(b, _mm256_loadu_si256((const __m256i *)(p + i + 32)));
        c = _mm256_add_epi64(c, _mm256_loadu_si256((const __m256i *)(p + i + 64)));
        d = _mm256_add_epi64(d, _mm256_loadu_si256((const __m256i *)(p + i + 96)));
    }
    a = _mm256_add_epi64(_mm256_add_epi64(a, b), _mm256_add_epi64(c, d));
    uint64_t t[4];
    _mm256_storeu_si256((__m256i *)t, a);
    return t[0] + t[1] + t[2] + t[3];
}
#define HS_HAVE_AVX2 1
#endif

typedef uint64_t (*hs_sum_fn)(const uint8_t *);
static hs_sum_fn hs_sum = 0;

static hs_sum_fn hs_pick(int64_t portable) {
#if defined(HS_HAVE_AVX2)
    if (!portable && __builtin_cpu_supports("avx2")) return hs_block_sum_avx2;
#endif
    (void)portable;
    return hs_block_sum;
}

/* 1 when the AVX2 sum is used, else 0; portable != 0 forces the portable sum from now on. */
int64_t hs_select(int64_t portable) {
    hs_sum = hs_pick(portable);
    return hs_sum != hs_block_sum;
}

typedef struct {
    uint8_t carry[HS_BLOCK];
    size_t fill;
    uint64_t *sums;
    int64_t nsums;
} hs_acc;

static void hs_feed(hs_acc *s, const uint8_t *p, size_t n) {
    if (s->fill) {
        size_t take = HS_BLOCK - s->fill < n ? HS_BLOCK - s->fill : n;
        memcpy(s->carry + s->fill, p, take);
        s->fill += take;
        p += take;
        n -= take;
        if (s->fill < HS_BLOCK) return;
        s->sums[s->nsums++] = hs_sum(s->carry);
        s->fill = 0;
    }
    for (; n >= HS_BLOCK; n -= HS_BLOCK, p += HS_BLOCK) s->sums[s->nsums++] = hs_sum(p);
    if (n) {
        memcpy(s->carry, p, n);
        s->fill = n;
    }
}

static void hs_finish(hs_acc *s) {
    if (s->fill) {
        memset(s->carry + s->fill, 0, HS_BLOCK - s->fill);
        s->sums[s->nsums++] = hs_sum(s->carry);
        s->fill = 0;
    }
}

/* The next chunk of at most `chunk` bytes from segment `*seg` at `*at`, as iovecs. */
static int hs_next(int64_t nseg, uint8_t *const *addrs, const int64_t *lens, int64_t chunk,
                   int64_t *seg, int64_t *at, struct iovec *iov, int64_t *bytes) {
    int n = 0;
    int64_t size = 0;
    while (*seg < nseg && size < chunk && n < HS_IOV) {
        int64_t left = lens[*seg] - *at;
        if (left <= 0) { (*seg)++; *at = 0; continue; }
        int64_t take = chunk - size < left ? chunk - size : left;
        iov[n].iov_base = addrs[*seg] + *at;
        iov[n].iov_len = (size_t)take;
        n++;
        size += take;
        *at += take;
        if (*at == lens[*seg]) { (*seg)++; *at = 0; }
    }
    *bytes = size;
    return n;
}

/* Advance iovecs past `done` bytes; returns the new first index. */
static int hs_skip(struct iovec *iov, int first, int n, size_t done) {
    while (done && first < n) {
        if (done >= iov[first].iov_len) { done -= iov[first].iov_len; first++; }
        else {
            iov[first].iov_base = (uint8_t *)iov[first].iov_base + done;
            iov[first].iov_len -= done;
            done = 0;
        }
    }
    return first;
}

/* A streaming hash of another library, fed each chunk right after it moved (hicache passes
   xxHash's XXH3_64bits_update and its state); NULL: the chunk's blocks are summed instead. */
typedef int (*hs_update_fn)(void *state, const void *p, size_t n);

static void hs_take(hs_acc *acc, hs_update_fn update, void *state, const struct iovec *iov,
                    int n) {
    for (int k = 0; k < n; k++) {
        if (update) update(state, iov[k].iov_base, iov[k].iov_len);
        else hs_feed(acc, iov[k].iov_base, iov[k].iov_len);
    }
}

/* Fill the segments from fd at offset, a chunk at a time, checking each chunk right after it
   is read. Returns the bytes read (fewer at end of file: the check is then incomplete), or
   -errno. */
static int64_t hs_read_any(int fd, int64_t offset, int64_t nseg, uint8_t *const *addrs,
                           const int64_t *lens, int64_t chunk, hs_acc *acc,
                           hs_update_fn update, void *state) {
    struct iovec iov[HS_IOV], keep[HS_IOV];
    int64_t seg = 0, at = 0, total = 0, want;
    for (;;) {
        int n = hs_next(nseg, addrs, lens, chunk, &seg, &at, iov, &want);
        if (n == 0) break;
        memcpy(keep, iov, sizeof(struct iovec) * (size_t)n);
        int first = 0;
        int64_t got = 0;
        while (got < want) {
            ssize_t r = preadv(fd, iov + first, n - first, (off_t)(offset + total + got));
            if (r < 0) {
                if (errno == EINTR) continue;
                return -errno;
            }
            if (r == 0) return total + got;
            got += r;
            first = hs_skip(iov, first, n, (size_t)r);
        }
        hs_take(acc, update, state, keep, n);
        total += got;
    }
    return total;
}

/* Check then write the segments to fd at offset, a chunk at a time. Returns bytes written or
   -errno. */
static int64_t hs_write_any(int fd, int64_t offset, int64_t nseg, uint8_t *const *addrs,
                            const int64_t *lens, int64_t chunk, hs_acc *acc,
                            hs_update_fn update, void *state) {
    struct iovec iov[HS_IOV];
    int64_t seg = 0, at = 0, total = 0, want;
    for (;;) {
        int n = hs_next(nseg, addrs, lens, chunk, &seg, &at, iov, &want);
        if (n == 0) break;
        hs_take(acc, update, state, iov, n);
        int first = 0;
        int64_t put = 0;
        while (put < want) {
            ssize_t r = pwritev(fd, iov + first, n - first, (off_t)(offset + total + put));
            if (r < 0) {
                if (errno == EINTR) continue;
                return -errno;
            }
            put += r;
            first = hs_skip(iov, first, n, (size_t)r);
        }
        total += put;
    }
    return total;
}

/* blocksum64: sums: room for ceil(total / 4096) values; *nsums gets the count. */
static int64_t hs_summed(int write, int fd, int64_t offset, int64_t nseg, uint8_t *const *addrs,
                         const int64_t *lens, int64_t chunk, uint64_t *sums, int64_t *nsums) {
    hs_acc acc;
    if (!hs_sum) hs_sum = hs_pick(0);
    acc.fill = 0; acc.sums = sums; acc.nsums = 0;
    int64_t moved = write
        ? hs_write_any(fd, offset, nseg, addrs, lens, chunk, &acc, 0, 0)
        : hs_read_any(fd, offset, nseg, addrs, lens, chunk, &acc, 0, 0);
    if (moved >= 0) hs_finish(&acc);
    *nsums = acc.nsums;
    return moved;
}

int64_t hs_read(int fd, int64_t offset, int64_t nseg, uint8_t *const *addrs,
                const int64_t *lens, int64_t chunk, uint64_t *sums, int64_t *nsums) {
    return hs_summed(0, fd, offset, nseg, addrs, lens, chunk, sums, nsums);
}

int64_t hs_write(int fd, int64_t offset, int64_t nseg, uint8_t *const *addrs,
                 const int64_t *lens, int64_t chunk, uint64_t *sums, int64_t *nsums) {
    return hs_summed(1, fd, offset, nseg, addrs, lens, chunk, sums, nsums);
}

/* The same moves, each chunk handed to update(state, ...) instead of being summed. */
int64_t hs_read_fn(int fd, int64_t offset, int64_t nseg, uint8_t *const *addrs,
                   const int64_t *lens, int64_t chunk, hs_update_fn update, void *state) {
    return hs_read_any(fd, offset, nseg, addrs, lens, chunk, 0, update, state);
}

int64_t hs_write_fn(int fd, int64_t offset, int64_t nseg, uint8_t *const *addrs,
                    const int64_t *lens, int64_t chunk, hs_update_fn update, void *state) {
    return hs_write_any(fd, offset, nseg, addrs, lens, chunk, 0, update, state);
}
"""

_P = ctypes.c_void_p
_I = ctypes.c_int64


class NativeIo:
    """The loaded I/O helper; each call moves one object's payload with the GIL released."""

    def __init__(self, path: Path) -> None:
        self.path = path
        lib = ctypes.CDLL(str(path), use_errno=True)
        lib.hs_abi_version.restype = _I
        lib.hs_abi_version.argtypes = []
        if lib.hs_abi_version() != IO_ABI:
            raise NativeBuildError(
                f"native storage I/O helper {path} has ABI {lib.hs_abi_version()}, expected "
                f"{IO_ABI}; remove it to rebuild"
            )
        for fn in (lib.hs_read, lib.hs_write):
            fn.restype = _I
            fn.argtypes = [
                ctypes.c_int,
                _I,
                _I,
                ctypes.POINTER(ctypes.c_void_p),
                ctypes.POINTER(ctypes.c_int64),
                _I,
                ctypes.POINTER(ctypes.c_uint64),
                ctypes.POINTER(ctypes.c_int64),
            ]
        for fn in (lib.hs_read_fn, lib.hs_write_fn):
            fn.restype = _I
            fn.argtypes = [
                ctypes.c_int,
                _I,
                _I,
                ctypes.POINTER(ctypes.c_void_p),
                ctypes.POINTER(ctypes.c_int64),
                _I,
                ctypes.c_void_p,
                ctypes.c_void_p,
            ]
        self._read = lib.hs_read
        self._write = lib.hs_write
        self._read_fn = lib.hs_read_fn
        self._write_fn = lib.hs_write_fn
        lib.hs_select.restype = _I
        lib.hs_select.argtypes = [_I]
        self._select = lib.hs_select
        self.vector = bool(self._select(0))
        self._local = threading.local()

    def portable(self, enabled: bool) -> None:
        """Sum with the portable loop (True) or the CPU's vector unit where it has one (the
        same digest; tests compare both)."""
        self.vector = bool(self._select(int(enabled)))

    def read(
        self, fd: int, offset: int, segments: list[memoryview], *, chunk: int = IO_CHUNK
    ) -> tuple[int, int]:
        """Fill ``segments`` from ``fd`` at ``offset``: (bytes read, blocksum64 digest of
        them; the digest is only meaningful when every byte was read)."""
        return self._run(self._read, fd, offset, segments, chunk)

    def write(
        self, fd: int, offset: int, segments: list[memoryview], *, chunk: int = IO_WRITE_CHUNK
    ) -> tuple[int, int]:
        """Write ``segments`` to ``fd`` at ``offset``: (bytes written, blocksum64 digest)."""
        return self._run(self._write, fd, offset, segments, chunk)

    def read_xxh3(
        self, fd: int, offset: int, segments: list[memoryview], *, chunk: int = IO_CHUNK
    ) -> tuple[int, int] | None:
        """As ``read``, with the XXH3 64-bit digest (xxHash's own code, called from C on each
        chunk); None where the xxhash library's functions cannot be reached (use the Python
        path: the same digest)."""
        return self._run_fn(self._read_fn, fd, offset, segments, chunk)

    def write_xxh3(
        self, fd: int, offset: int, segments: list[memoryview], *, chunk: int = IO_WRITE_CHUNK
    ) -> tuple[int, int] | None:
        """As ``write``, with the XXH3 64-bit digest; None as for ``read_xxh3``."""
        return self._run_fn(self._write_fn, fd, offset, segments, chunk)

    def _run_fn(
        self, fn: ctypes._NamedFuncPointer, fd: int, offset: int, segs: list[memoryview], chunk: int
    ) -> tuple[int, int] | None:
        xxh = xxh3_functions()
        if xxh is None:
            return None
        state = getattr(self._local, "xxh3", None)
        if state is None:
            state = self._local.xxh3 = _Xxh3State(xxh)
        xxh.reset(state.ptr)
        n, addrs, lens, _keep, _total = _segments(segs)
        moved = fn(fd, offset, n, addrs, lens, chunk, xxh.update_address, state.ptr)
        if moved < 0:
            raise OSError(-moved, os.strerror(-moved))
        return int(moved), int(xxh.digest(state.ptr))

    def _run(
        self, fn: ctypes._NamedFuncPointer, fd: int, offset: int, segs: list[memoryview], chunk: int
    ) -> tuple[int, int]:
        n, addrs, lens, _keep, total = _segments(segs)
        sums = self._sums(-(-total // BLOCK) + 1)
        count = ctypes.c_int64(0)
        moved = fn(fd, offset, n, addrs, lens, chunk, sums, ctypes.byref(count))
        if moved < 0:
            raise OSError(-moved, os.strerror(-moved))
        return int(moved), zlib.crc32(memoryview(sums).cast("B")[: 8 * count.value]) & 0xFFFFFFFF

    def _sums(self, n: int) -> ctypes.Array[ctypes.c_uint64]:
        """This thread's array for ``n`` block sums (kept between calls: no allocation per page)."""
        have: ctypes.Array[ctypes.c_uint64] | None = getattr(self._local, "sums", None)
        if have is None or len(have) < n:
            have = self._local.sums = (ctypes.c_uint64 * max(n, 1025))()
        return have


def _segments(
    segs: list[memoryview],
) -> tuple[int, ctypes.Array[ctypes.c_void_p], ctypes.Array[ctypes.c_int64], list[object], int]:
    """(count, addresses, lengths, what keeps the addresses valid, total bytes) of ``segs``."""
    n = len(segs)
    addrs = (ctypes.c_void_p * n)()
    lens = (ctypes.c_int64 * n)()
    keep: list[object] = []  # what holds each address valid until the call returns
    total = 0
    for i, seg in enumerate(segs):
        addrs[i], owner = _address(seg)
        keep.append(owner)
        lens[i] = seg.nbytes
        total += seg.nbytes
    return n, addrs, lens, keep, total


class Xxh3Functions:
    """xxHash's streaming XXH3-64 functions, from the ``xxhash`` package's own extension
    module (the library's C code, linked into it): what the C helper calls on each chunk."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self.create = lib.XXH3_createState
        self.create.restype = ctypes.c_void_p
        self.create.argtypes = []
        self.free = lib.XXH3_freeState
        self.free.restype = ctypes.c_int
        self.free.argtypes = [ctypes.c_void_p]
        self.reset = lib.XXH3_64bits_reset
        self.reset.restype = ctypes.c_int
        self.reset.argtypes = [ctypes.c_void_p]
        self.digest = lib.XXH3_64bits_digest
        self.digest.restype = ctypes.c_uint64
        self.digest.argtypes = [ctypes.c_void_p]
        address = ctypes.cast(lib.XXH3_64bits_update, ctypes.c_void_p).value
        if not address:
            raise AttributeError("XXH3_64bits_update has no address")
        self.update_address: int = address


class _Xxh3State:
    """One thread's XXH3 state (reset for each object)."""

    def __init__(self, fns: Xxh3Functions) -> None:
        self._fns = fns
        ptr = fns.create()
        if not ptr:
            raise MemoryError("XXH3_createState returned NULL")
        self.ptr: int = ptr

    def __del__(self) -> None:
        self._fns.free(self.ptr)


_xxh3: list[Xxh3Functions | None] = []


def xxh3_functions() -> Xxh3Functions | None:
    """The xxhash package's XXH3 functions, or None where its extension does not export them
    (another build of the package): then XXH3 objects take the Python path."""
    with _lock:
        if not _xxh3:
            try:
                ext = importlib.import_module("xxhash._xxhash")  # the library's C code
                _xxh3.append(Xxh3Functions(ctypes.CDLL(str(ext.__file__))))
            except (ImportError, OSError, AttributeError):
                _xxh3.append(None)
        return _xxh3[0]


def _address(seg: memoryview) -> tuple[int | None, object]:
    """The address of a flat byte view's first byte, and the object that keeps it valid."""
    if not seg.nbytes:
        return None, None
    if not seg.readonly:
        ref = ctypes.c_char.from_buffer(seg)  # no copy: a pointer into the buffer
        return ctypes.addressof(ref), ref
    arr = np.frombuffer(seg, dtype=np.uint8)  # read-only (a put from immutable bytes)
    return arr.ctypes.data, arr


_lock = threading.Lock()
_state: list[NativeIo | str] = []


def load_native_io(*, compiler: str | None = None, cache_dir: str | Path | None = None) -> NativeIo:
    """The native storage I/O helper, built if needed; NativeBuildError says why not."""
    return load_helper(
        NativeIo,
        source=IO_SOURCE,
        stem="storageio",
        abi=IO_ABI,
        what="the native storage I/O helper",
        fallback="DirectoryStore keeps its Python I/O path (the same files, slower)",
        compiler=compiler,
        cache_dir=cache_dir,
        memo=False,  # native_io() keeps the process's one
    )


def native_io() -> tuple[NativeIo | None, str]:
    """The process's helper (built once) and "native", or None and why it is unavailable."""
    with _lock:
        if not _state:
            try:
                _state.append(load_native_io())
            except NativeBuildError as e:
                _state.append(str(e))
        got = _state[0]
    return (got, "native") if isinstance(got, NativeIo) else (None, got)


__all__ = [
    "IO_CHUNK",
    "IO_SOURCE",
    "IO_WRITE_CHUNK",
    "NativeIo",
    "Xxh3Functions",
    "load_native_io",
    "native_io",
    "xxh3_functions",
]
