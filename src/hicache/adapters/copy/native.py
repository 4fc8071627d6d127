"""A tiny native batched memcpy for CPU pools, compiled on first use and called through ctypes.

- NATIVE_SOURCE: the C source (kept here, so a wheel or a fresh clone needs nothing else).
- NativeLibrary: the loaded library; ``copy(...)`` runs one batch of copies with the GIL released.
- load_helper: build one native helper (this one, the page keys', the storage I/O's) into the
  cache folder once and load it; load_native: build (once per source, compiler and platform, into a cache folder) and load it;
  raises NativeBuildError, naming the compiler and its output, when that is impossible.
- native_status: (available, reason) without raising, for reports.
- MemcpyBackend ("memcpy"): the CPU backend on top of it.

Build: ``$CC`` (default ``cc``) ``-O2 -shared -fPIC`` into ``$HICACHE_NATIVE_DIR``, else
``$XDG_CACHE_HOME/hicache``, else ``~/.cache/hicache``, as ``hicache-memcpy-<hash>.so``; the hash
covers the source, the compiler name, its flags and the platform, and the file is written under a
temporary name and renamed, so concurrent processes never load a half-written library. A missing
or failing compiler is an error that names the portable alternative (backend "torch"); hicache
never switches backends on its own.

The copy loop uses non-temporal (streaming) stores on x86-64 for pieces of 256 B or more: a
scattered copy does not read the destination's cache lines first, which on the development
machine lifts 64 KiB page copies from 0.8x to about 1.1x of a contiguous torch copy_ (that copy_
does not stream). Pieces of 4 KiB or more (e.g. one page of one layer in page_first_direct or
layer_first once that page reaches 4 KiB) are copied eight at a time, 256 B of each in turn, so several source
streams are in flight instead of one that stalls at every piece start (docs/copy.md). Each batch
ends with a store fence, so the bytes are visible to any thread that synchronises with the
caller afterwards.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import os
import platform
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TypeVar, cast

from hicache.adapters.copy.base import Backend
from hicache.adapters.copy.pairs import I64, PageSet, PoolPair, layer_addresses
from hicache.domain import TransferError

ABI_VERSION = 2

NATIVE_SOURCE = r"""
/* hicache batched memcpy (ABI 2). Built by hicache.adapters.copy.native; plain C99. */
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#if defined(__SSE2__)
#include <emmintrin.h>
#define HC_STREAM 1
#endif

#define HC_STREAM_MIN 256
#define HC_AHEAD 4
#define HC_PREFETCH_MAX 4096
#ifndef HC_WAY_MIN
#define HC_WAY_MIN 4096
#endif
#ifndef HC_WAYS
#define HC_WAYS 8
#endif
#ifndef HC_GROUP
#define HC_GROUP 256
#endif

int64_t hc_abi_version(void) { return 2; }

/* Scattered sources start a new hardware prefetch stream (and often a TLB walk) per piece: a
   piece of at most 4 KiB that is HC_AHEAD pieces ahead is prefetched whole, every cache line;
   of a longer one only the first line. The prefetch is non-temporal (locality 0): the source is
   read once, and a temporal prefetch would fill the shared last-level cache with it, evicting
   the working set of the compute running beside. */
static inline void hc_prefetch(const char *p, int64_t n) {
    if (n > HC_PREFETCH_MAX) n = 1;
    for (int64_t k = 0; k < n; k += 64) __builtin_prefetch(p + k, 0, 0);
}

#if defined(HC_STREAM)
/* Copy `n` (a multiple of 64) bytes with streaming stores; d is 16-byte aligned. */
static inline void hc_lines(char *d, const char *s, size_t n) {
    for (size_t i = 0; i < n; i += 64) {
        __m128i a = _mm_loadu_si128((const __m128i *)(s + i));
        __m128i b = _mm_loadu_si128((const __m128i *)(s + i + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(s + i + 32));
        __m128i e = _mm_loadu_si128((const __m128i *)(s + i + 48));
        _mm_stream_si128((__m128i *)(d + i), a);
        _mm_stream_si128((__m128i *)(d + i + 16), b);
        _mm_stream_si128((__m128i *)(d + i + 32), c);
        _mm_stream_si128((__m128i *)(d + i + 48), e);
    }
}

static inline size_t hc_head(const char *d) { return (size_t)((16 - ((uintptr_t)d & 15)) & 15); }
#endif

/* One piece, whole: plain memcpy under HC_STREAM_MIN bytes, else streaming stores. */
static inline void hc_copy_one(char *d, const char *s, size_t n) {
#if defined(HC_STREAM)
    if (n >= HC_STREAM_MIN) {
        size_t head = hc_head(d);
        memcpy(d, s, head);
        d += head; s += head; n -= head;
        size_t whole = n & ~(size_t)63;
        hc_lines(d, s, whole);
        memcpy(d + whole, s + whole, n - whole);
        return;
    }
#endif
    memcpy(d, s, n);
}

/* Long pieces (HC_WAY_MIN bytes or more), HC_WAYS at a time, HC_GROUP bytes of each in turn.
   Read one after another, scattered long pieces wait on memory at every piece start: each is a
   new stream that the hardware prefetcher has to discover and ramp up (it does not cross 4 KiB
   pages). Copied in turns, several streams are in flight at once. */
typedef struct {
    char *d;
    const char *s;
    size_t n;
} hc_piece;

typedef struct {
    hc_piece way[HC_WAYS];
    int active;
} hc_ways;

/* Run turns until a way is free (until_free) or every way is done. */
static void hc_turns(hc_ways *w, int until_free) {
    while (w->active > 0) {
        for (int k = 0; k < w->active;) {
            hc_piece *q = &w->way[k];
#if defined(HC_STREAM)
            size_t step = q->n < HC_GROUP ? (q->n & ~(size_t)63) : HC_GROUP;
            if (step == 0) {
                memcpy(q->d, q->s, q->n);
                step = q->n;
            } else {
                hc_lines(q->d, q->s, step);
            }
#else
            size_t step = q->n < HC_GROUP ? q->n : HC_GROUP;
            memcpy(q->d, q->s, step);
#endif
            q->d += step; q->s += step; q->n -= step;
            if (q->n == 0) w->way[k] = w->way[--w->active]; else k++;
        }
        if (until_free && w->active < HC_WAYS) return;
    }
}

static inline void hc_way_add(hc_ways *w, char *d, const char *s, size_t n) {
    if (w->active == HC_WAYS) hc_turns(w, 1);
#if defined(HC_STREAM)
    size_t head = hc_head(d);
    memcpy(d, s, head);
    d += head; s += head; n -= head;
#endif
    hc_piece p = {d, s, n};
    w->way[w->active++] = p;
}

/* For each of nl layers and each of n pieces: when m == 0, copy len[i] bytes from
   src_layer[l] + soff[i] to dst_layer[l] + doff[i]; else copy the m chunks of `chunk` bytes at
   schunk[j] / dchunk[j] past those piece offsets. Returns the number of bytes copied. Pieces may
   be copied out of order (long ones in turns), so destinations must not overlap (the transfer
   refuses a page map whose written pages repeat). A store fence ends the call, so the bytes are
   visible to any thread that synchronises with the caller afterwards. */
int64_t hc_copy(int64_t nl, const int64_t *dst_layer, const int64_t *src_layer,
                int64_t n, const int64_t *doff, const int64_t *soff, const int64_t *len,
                int64_t m, const int64_t *dchunk, const int64_t *schunk, int64_t chunk) {
    int64_t total = 0;
    hc_ways w;
    w.active = 0;
    for (int64_t l = 0; l < nl; l++) {
        char *dl = (char *)(intptr_t)dst_layer[l];
        const char *sl = (const char *)(intptr_t)src_layer[l];
        for (int64_t i = 0; i < n; i++) {
            char *d = dl + doff[i];
            const char *s = sl + soff[i];
            if (m == 0) {
                if (len[i] >= HC_WAY_MIN) {
                    hc_way_add(&w, d, s, (size_t)len[i]);
                } else {
                    if (i + HC_AHEAD < n) hc_prefetch(sl + soff[i + HC_AHEAD], len[i + HC_AHEAD]);
                    hc_copy_one(d, s, (size_t)len[i]);
                }
                total += len[i];
            } else if (chunk >= HC_WAY_MIN) {
                for (int64_t j = 0; j < m; j++) hc_way_add(&w, d + dchunk[j], s + schunk[j], (size_t)chunk);
                total += m * chunk;
            } else {
                if (i + 1 < n) hc_prefetch(sl + soff[i + 1] + schunk[0], chunk);
                for (int64_t j = 0; j < m; j++) {
                    if (j + HC_AHEAD < m) hc_prefetch(s + schunk[j + HC_AHEAD], chunk);
                    hc_copy_one(d + dchunk[j], s + schunk[j], (size_t)chunk);
                }
                total += m * chunk;
            }
        }
    }
    hc_turns(&w, 0);
#if defined(HC_STREAM)
    _mm_sfence();
#endif
    return total;
}
"""

_FLAGS = ("-O2", "-shared", "-fPIC", "-std=c99")
_P = ctypes.c_void_p
_I = ctypes.c_int64


class NativeBuildError(TransferError):
    """The native memcpy helper could not be compiled or loaded."""


def _cache_dir() -> Path:
    explicit = os.environ.get("HICACHE_NATIVE_DIR")
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "hicache"


def _compiler() -> str:
    return os.environ.get("CC") or "cc"


class NativeLibrary:
    """The loaded helper. ``copy`` passes int64 arrays; ctypes releases the GIL for the call."""

    def __init__(self, path: Path) -> None:
        self.path = path
        lib = ctypes.CDLL(str(path))
        lib.hc_abi_version.restype = ctypes.c_int64
        lib.hc_abi_version.argtypes = []
        if lib.hc_abi_version() != ABI_VERSION:
            raise NativeBuildError(
                f"native memcpy helper {path} has ABI {lib.hc_abi_version()}, expected "
                f"{ABI_VERSION}; remove it to rebuild"
            )
        fn = lib.hc_copy
        fn.restype = ctypes.c_int64
        fn.argtypes = [_I, _P, _P, _I, _P, _P, _P, _I, _P, _P, _I]
        self._fn = fn

    def copy(
        self,
        dst_layers: I64,
        src_layers: I64,
        dst_off: I64,
        src_off: I64,
        lengths: I64 | None,
        dst_chunks: I64 | None = None,
        src_chunks: I64 | None = None,
        chunk: int = 0,
    ) -> int:
        """One batch: see the C comment of hc_copy. Every array must be contiguous int64."""
        if lengths is None:
            if dst_chunks is None or src_chunks is None:
                raise TransferError("a chunked native copy needs both chunk offset arrays")
            m = len(dst_chunks)
            dc, sc = dst_chunks.ctypes.data, src_chunks.ctypes.data
            ln = None
        else:
            m, dc, sc, ln = 0, None, None, lengths.ctypes.data
        return int(
            self._fn(
                len(dst_layers),
                dst_layers.ctypes.data,
                src_layers.ctypes.data,
                len(dst_off),
                dst_off.ctypes.data,
                src_off.ctypes.data,
                ln,
                m,
                dc,
                sc,
                chunk,
            )
        )


def _library_name(
    compiler: str, source: str = NATIVE_SOURCE, stem: str = "memcpy", abi: int = ABI_VERSION
) -> str:
    digest = hashlib.sha256(
        "\0".join((source, compiler, *_FLAGS, sys.platform, platform.machine(), str(abi))).encode()
    ).hexdigest()[:16]
    return f"hicache-{stem}-{digest}.so"


def _build(
    compiler: str,
    directory: Path,
    *,
    source: str = NATIVE_SOURCE,
    stem: str = "memcpy",
    abi: int = ABI_VERSION,
    what: str = "the native memcpy helper",
    fallback: str = "choose the portable backend 'torch' explicitly",
) -> Path:
    """Compile ``source`` (once per source, compiler and platform) into ``directory``."""
    target = directory / _library_name(compiler, source, stem, abi)

    def unusable(e: OSError, doing: str) -> NativeBuildError:
        return NativeBuildError(
            f"cannot {doing} the native build folder {str(directory)!r}: "
            f"{e.strerror or e}; set HICACHE_NATIVE_DIR (or cache_dir=) to a folder this "
            f"process can read and write, or {fallback}"
        )

    try:
        if target.exists():
            return target
    except OSError as e:  # a folder the process cannot search (privileges dropped after start)
        raise unusable(e, "read") from e
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise unusable(e, "create") from e
    try:
        fd, tmp_name = tempfile.mkstemp(prefix=".build-", suffix=".so", dir=directory)
    except OSError as e:
        raise unusable(e, "write into") from e
    os.close(fd)
    tmp = Path(tmp_name)
    src = tmp.with_suffix(".c")
    try:
        try:
            src.write_text(source, encoding="utf-8")
        except OSError as e:
            raise unusable(e, "write into") from e
        try:
            done = subprocess.run(
                [compiler, *_FLAGS, "-o", str(tmp), str(src)],
                capture_output=True,
                text=True,
                timeout=120,
                check=False,
            )
        except FileNotFoundError as e:
            raise NativeBuildError(
                f"cannot build {what}: C compiler {compiler!r} not found "
                f"(set CC to a C compiler, or {fallback})"
            ) from e
        except (OSError, subprocess.TimeoutExpired) as e:
            raise NativeBuildError(
                f"cannot build {what} with {compiler!r}: {e} ({fallback} to run without it)"
            ) from e
        if done.returncode != 0:
            output = (done.stderr or done.stdout).strip().splitlines()[-5:]
            raise NativeBuildError(
                f"cannot build {what}: {compiler!r} exited with "
                f"{done.returncode}: {' | '.join(output)} ({fallback} to run without it)"
            )
        try:
            os.replace(tmp, target)
        except OSError as e:
            raise unusable(e, "write into") from e
    finally:
        with contextlib.suppress(OSError):
            src.unlink()
        with contextlib.suppress(OSError):
            tmp.unlink()
    return target


_lock = threading.Lock()
_loaded: dict[tuple[str, str, str], object] = {}

T = TypeVar("T")


def load_helper(
    wrap: Callable[[Path], T],
    *,
    source: str,
    stem: str,
    abi: int,
    what: str,
    fallback: str,
    compiler: str | None = None,
    cache_dir: str | Path | None = None,
    memo: bool = True,
) -> T:
    """Build one native helper (once per source, compiler and platform, into the cache folder:
    $HICACHE_NATIVE_DIR, else the XDG cache) and ``wrap`` the library's path; loaded once per
    (helper, compiler, folder) unless ``memo`` is off. NativeBuildError says why not, ending
    with ``fallback`` (what the caller does without it)."""
    cc = compiler or _compiler()
    directory = Path(cache_dir).expanduser() if cache_dir is not None else _cache_dir()
    key = (stem, cc, str(directory))
    with _lock:
        if memo and key in _loaded:
            return cast(T, _loaded[key])
        path = _build(
            cc, directory, source=source, stem=stem, abi=abi, what=what, fallback=fallback
        )
        try:
            lib = wrap(path)
        except OSError as e:
            raise NativeBuildError(
                f"cannot load {what} {str(path)!r}: {e} (remove it to rebuild, or {fallback})"
            ) from e
        if memo:
            _loaded[key] = lib
        return lib


def load_native(
    *, compiler: str | None = None, cache_dir: str | Path | None = None
) -> NativeLibrary:
    """The native helper, built if needed; raises NativeBuildError saying why not."""
    return load_helper(
        NativeLibrary,
        source=NATIVE_SOURCE,
        stem="memcpy",
        abi=ABI_VERSION,
        what="the native memcpy helper",
        fallback="choose the portable backend 'torch' explicitly",
        compiler=compiler,
        cache_dir=cache_dir,
    )


def native_status() -> tuple[bool, str]:
    """(available, why) for the current CC and cache folder, building if needed."""
    try:
        lib = load_native()
    except NativeBuildError as e:
        return False, str(e)
    return True, f"built at {lib.path}"


class MemcpyBackend(Backend):
    """CPU: every page (or coalesced run) of every buffer in one native call per buffer."""

    name = "memcpy"

    def __init__(self, pair: PoolPair, library: NativeLibrary | None = None) -> None:
        super().__init__(pair)
        for bp in pair.buffers:
            if not bp.on_cpu:
                raise TransferError(
                    f"backend 'memcpy' copies CPU memory only; pool {pair.name.value!r} is on "
                    f"{pair.device_pool.device}"
                )
        self.library = library if library is not None else load_native()

    def _run(self, layers: Sequence[int] | None, pages: PageSet, *, load: bool) -> None:
        if pages.count == 0:
            return
        lib = self.library
        for bp in self.pair.buffers:
            h_off, d_off, lengths = pages.offsets(bp)
            h_layers, d_layers = layer_addresses(bp, layers)
            if load:
                lib.copy(
                    d_layers, h_layers, d_off, h_off, lengths,
                    bp.device_chunks, bp.host_chunks, bp.chunk_bytes,
                )  # fmt: skip
            else:
                lib.copy(
                    h_layers, d_layers, h_off, d_off, lengths,
                    bp.host_chunks, bp.device_chunks, bp.chunk_bytes,
                )  # fmt: skip

    def load(self, layer: int, pages: PageSet) -> None:
        self._run((layer,), pages, load=True)

    def backup(self, layers: Sequence[int] | None, pages: PageSet) -> None:
        self._run(layers, pages, load=False)


__all__ = [
    "ABI_VERSION",
    "NATIVE_SOURCE",
    "MemcpyBackend",
    "NativeBuildError",
    "NativeLibrary",
    "load_native",
    "native_status",
]
