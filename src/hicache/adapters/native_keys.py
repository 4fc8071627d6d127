"""Chained sha256 page keys in C: the same keys as hicache.domain.keys, at a long prompt's speed.

- KEYS_SOURCE: the C source (SHA-256 written from FIPS 180-4, with an SHA-NI path on x86-64
  CPUs that have it, chosen at run time by cpuid; a portable path elsewhere).
- NativeKeys: the loaded library; ``chain(packed, page_bytes, prior)`` returns the keys of every
  full page, ``blob(...)`` the same keys joined into one bytes object (what
  hicache.domain.keys.key_chain holds), the GIL released during the hashing; ``accelerated``
  says whether SHA-NI is used.
- load_native_keys: build (once per source, compiler and platform, in the same cache folder as
  the native memcpy helper: hicache.adapters.copy.native) and load; NativeBuildError says why not.
- install_native_keys: load it and hand it to hicache.domain.keys.set_chain_hasher, which checks
  it against the Python chain before using it; returns (installed, reason) and never raises for
  a missing compiler (the Python chain, which gives the same keys, stays in use).

Why: at page size 1 a 131,072-token prompt is 131,072 sha256 calls; through hashlib each costs
a Python call, two bytes objects and an OpenSSL context (about 1 us), which alone exceeded the
50 ms a long prompt's match may take (docs/benchmarks.md, ``hicache bench cache``).
"""

from __future__ import annotations

import ctypes
import struct
from pathlib import Path
from typing import cast

from hicache.adapters.copy.native import NativeBuildError, load_helper
from hicache.domain.keys import KEY_BYTES, set_chain_hasher

KEYS_ABI = 1

KEYS_SOURCE = r"""
/* hicache chained sha256 page keys (ABI 1). Built by hicache.adapters.native_keys; C99. */
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <cpuid.h>
#include <immintrin.h>
#define HK_X86 1
#endif

int64_t hk_abi_version(void) { return 1; }

static const uint32_t HK_K[64] = {
    0x428a2f98u, 0x71374491u, 0xb5c0fbcfu, 0xe9b5dba5u, 0x3956c25bu, 0x59f111f1u, 0x923f82a4u,
    0xab1c5ed5u, 0xd807aa98u, 0x12835b01u, 0x243185beu, 0x550c7dc3u, 0x72be5d74u, 0x80deb1feu,
    0x9bdc06a7u, 0xc19bf174u, 0xe49b69c1u, 0xefbe4786u, 0x0fc19dc6u, 0x240ca1ccu, 0x2de92c6fu,
    0x4a7484aau, 0x5cb0a9dcu, 0x76f988dau, 0x983e5152u, 0xa831c66du, 0xb00327c8u, 0xbf597fc7u,
    0xc6e00bf3u, 0xd5a79147u, 0x06ca6351u, 0x14292967u, 0x27b70a85u, 0x2e1b2138u, 0x4d2c6dfcu,
    0x53380d13u, 0x650a7354u, 0x766a0abbu, 0x81c2c92eu, 0x92722c85u, 0xa2bfe8a1u, 0xa81a664bu,
    0xc24b8b70u, 0xc76c51a3u, 0xd192e819u, 0xd6990624u, 0xf40e3585u, 0x106aa070u, 0x19a4c116u,
    0x1e376c08u, 0x2748774cu, 0x34b0bcb5u, 0x391c0cb3u, 0x4ed8aa4au, 0x5b9cca4fu, 0x682e6ff3u,
    0x748f82eeu, 0x78a5636fu, 0x84c87814u, 0x8cc70208u, 0x90befffau, 0xa4506cebu, 0xbef9a3f7u,
    0xc67178f2u};

static const uint32_t HK_IV[8] = {0x6a09e667u, 0xbb67ae85u, 0x3c6ef372u, 0xa54ff53au,
                                  0x510e527fu, 0x9b05688cu, 0x1f83d9abu, 0x5be0cd19u};

static inline uint32_t hk_ror(uint32_t x, int n) { return (x >> n) | (x << (32 - n)); }

static void hk_blocks_portable(uint32_t s[8], const uint8_t *p, size_t blocks) {
    for (; blocks; blocks--, p += 64) {
        uint32_t w[64];
        for (int i = 0; i < 16; i++)
            w[i] = (uint32_t)p[4 * i] << 24 | (uint32_t)p[4 * i + 1] << 16 |
                   (uint32_t)p[4 * i + 2] << 8 | (uint32_t)p[4 * i + 3];
        for (int i = 16; i < 64; i++) {
            uint32_t s0 = hk_ror(w[i - 15], 7) ^ hk_ror(w[i - 15], 18) ^ (w[i - 15] >> 3);
            uint32_t s1 = hk_ror(w[i - 2], 17) ^ hk_ror(w[i - 2], 19) ^ (w[i - 2] >> 10);
            w[i] = w[i - 16] + s0 + w[i - 7] + s1;
        }
        uint32_t a = s[0], b = s[1], c = s[2], d = s[3], e = s[4], f = s[5], g = s[6], h = s[7];
        for (int i = 0; i < 64; i++) {
            uint32_t t1 = h + (hk_ror(e, 6) ^ hk_ror(e, 11) ^ hk_ror(e, 25)) + ((e & f) ^ (~e & g)) +
                          HK_K[i] + w[i];
            uint32_t t2 = (hk_ror(a, 2) ^ hk_ror(a, 13) ^ hk_ror(a, 22)) + ((a & b) ^ (a & c) ^ (b & c));
            h = g; g = f; f = e; e = d + t1; d = c; c = b; b = a; a = t1 + t2;
        }
        s[0] += a; s[1] += b; s[2] += c; s[3] += d; s[4] += e; s[5] += f; s[6] += g; s[7] += h;
    }
}

#if defined(HK_X86)
/* The SHA extensions keep the state as ABEF / CDGH halves and run two rounds per instruction;
   the message schedule of each group of four words is msg1, an add of words t-7..t-4, msg2. */
__attribute__((target("sha,sse4.1,ssse3")))
static void hk_blocks_shani(uint32_t s[8], const uint8_t *p, size_t blocks) {
    const __m128i order = _mm_set_epi64x(0x0c0d0e0f08090a0bLL, 0x0405060700010203LL);
    __m128i t = _mm_shuffle_epi32(_mm_loadu_si128((const __m128i *)&s[0]), 0xB1); /* CDAB */
    __m128i st1 = _mm_shuffle_epi32(_mm_loadu_si128((const __m128i *)&s[4]), 0x1B); /* EFGH */
    __m128i st0 = _mm_alignr_epi8(t, st1, 8);     /* ABEF */
    st1 = _mm_blend_epi16(st1, t, 0xF0);          /* CDGH */
    for (; blocks; blocks--, p += 64) {
        __m128i save0 = st0, save1 = st1, w[4], m;
#pragma GCC unroll 16 /* the four-word groups in registers: about a third faster */
        for (int i = 0; i < 16; i++) {
            __m128i cur;
            if (i < 4) {
                cur = _mm_shuffle_epi8(_mm_loadu_si128((const __m128i *)(p + 16 * i)), order);
            } else {
                __m128i w4 = w[i & 3], w3 = w[(i + 1) & 3], w2 = w[(i + 2) & 3],
                        w1 = w[(i + 3) & 3];
                cur = _mm_sha256msg1_epu32(w4, w3);
                cur = _mm_add_epi32(cur, _mm_alignr_epi8(w1, w2, 4));
                cur = _mm_sha256msg2_epu32(cur, w1);
            }
            w[i & 3] = cur;
            m = _mm_add_epi32(cur, _mm_loadu_si128((const __m128i *)&HK_K[4 * i]));
            st1 = _mm_sha256rnds2_epu32(st1, st0, m);
            st0 = _mm_sha256rnds2_epu32(st0, st1, _mm_shuffle_epi32(m, 0x0E));
        }
        st0 = _mm_add_epi32(st0, save0);
        st1 = _mm_add_epi32(st1, save1);
    }
    t = _mm_shuffle_epi32(st0, 0x1B);             /* FEBA */
    st1 = _mm_shuffle_epi32(st1, 0xB1);           /* DCHG */
    st0 = _mm_blend_epi16(t, st1, 0xF0);          /* DCBA */
    st1 = _mm_alignr_epi8(st1, t, 8);             /* HGFE */
    _mm_storeu_si128((__m128i *)&s[0], st0);
    _mm_storeu_si128((__m128i *)&s[4], st1);
}

static int hk_has_shani(void) {
    unsigned a, b, c, d;
    if (!__get_cpuid(1, &a, &b, &c, &d)) return 0;
    if (!(c & (1u << 19)) || !(c & (1u << 9))) return 0; /* SSE4.1, SSSE3 */
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return 0;
    return (int)((b >> 29) & 1u); /* SHA */
}
#endif

typedef void (*hk_fn)(uint32_t *, const uint8_t *, size_t);

/* SHA-256 padding after a message of len bytes at s: 0x80, zeros, the bit length big-endian.
   Returns the padded length (a multiple of 64). */
static size_t hk_pad(uint8_t *s, size_t len) {
    size_t padded = (len + 9 + 63) / 64 * 64;
    uint64_t bits = (uint64_t)len * 8u;
    s[len] = 0x80;
    memset(s + len + 1, 0, padded - len - 9);
    for (int k = 0; k < 8; k++) s[padded - 1 - k] = (uint8_t)(bits >> (8 * k));
    return padded;
}

/* 1 when SHA-NI is available (and used unless forced portable), else 0. */
int64_t hk_accelerated(void) {
#if defined(HK_X86)
    return hk_has_shani();
#else
    return 0;
#endif
}

/* Key i = sha256(key i-1 || the page_bytes of page i); key -1 = prior (NULL: nothing before
   page 0). Writes n keys of 32 bytes to out. scratch: page_bytes + 128 bytes.
   portable != 0 forces the portable path (tests compare both). Returns n. */
int64_t hk_chain(const uint8_t *prior, const uint8_t *data, int64_t n, int64_t page_bytes,
                 uint8_t *out, uint8_t *scratch, int64_t portable) {
    hk_fn blocks = hk_blocks_portable;
#if defined(HK_X86)
    if (!portable && hk_has_shani()) blocks = hk_blocks_shani;
#endif
    /* Every page after the first has a prior key: its message is 32 + page_bytes long, so its
       padding is the same each time and is written once; only the bytes before it change. */
    const uint8_t *prev = prior;
    size_t plen = (size_t)page_bytes + 32;
    size_t ppadded = prev ? hk_pad(scratch, plen) : 0;
    for (int64_t i = 0; i < n; i++) {
        uint8_t *key = out + 32 * i;
        uint32_t st[8];
        memcpy(st, HK_IV, sizeof st);
        if (prev) {
            memcpy(scratch, prev, 32);
            memcpy(scratch + 32, data + i * page_bytes, (size_t)page_bytes);
            blocks(st, scratch, ppadded / 64);
        } else {
            memcpy(scratch, data + i * page_bytes, (size_t)page_bytes);
            blocks(st, scratch, hk_pad(scratch, (size_t)page_bytes) / 64);
            ppadded = hk_pad(scratch, plen);
        }
        for (int k = 0; k < 8; k++) { /* big-endian words, one 4-byte store each */
            uint32_t v = st[k];
            v = (v >> 24) | ((v >> 8) & 0xff00u) | ((v << 8) & 0xff0000u) | (v << 24);
            memcpy(key + 4 * k, &v, 4);
        }
        prev = key;
    }
    return n;
}
"""

_KEY_FMT = f"{KEY_BYTES}s"
_new_bytes = ctypes.pythonapi.PyBytes_FromStringAndSize
_new_bytes.restype = ctypes.py_object
_new_bytes.argtypes = [ctypes.c_void_p, ctypes.c_ssize_t]
_bytes_at = ctypes.pythonapi.PyBytes_AsString
_bytes_at.restype = ctypes.c_void_p
_bytes_at.argtypes = [ctypes.py_object]
_P = ctypes.c_void_p
_I = ctypes.c_int64


class NativeKeys:
    """The loaded key library; ctypes releases the GIL for each call."""

    def __init__(self, path: Path) -> None:
        self.path = path
        lib = ctypes.CDLL(str(path))
        lib.hk_abi_version.restype = _I
        lib.hk_abi_version.argtypes = []
        if lib.hk_abi_version() != KEYS_ABI:
            raise NativeBuildError(
                f"native key helper {path} has ABI {lib.hk_abi_version()}, expected "
                f"{KEYS_ABI}; remove it to rebuild"
            )
        lib.hk_accelerated.restype = _I
        lib.hk_accelerated.argtypes = []
        fn = lib.hk_chain
        fn.restype = _I
        fn.argtypes = [ctypes.c_char_p, ctypes.c_char_p, _I, _I, _P, _P, _I]
        self._fn = fn
        self.accelerated = bool(lib.hk_accelerated())

    def chain(
        self, packed: bytes, page_bytes: int, prior: bytes | None, *, portable: bool = False
    ) -> list[bytes]:
        """The keys of every full page of ``packed`` (``page_bytes`` each) after ``prior``."""
        n = len(packed) // page_bytes
        if n == 0:
            return []
        # One C-level split into n bytes objects (a Python slice loop costs about twice as much).
        return list(
            struct.unpack(_KEY_FMT * n, self.blob(packed, page_bytes, prior, portable=portable))
        )

    def blob(
        self, packed: bytes, page_bytes: int, prior: bytes | None, *, portable: bool = False
    ) -> bytes:
        """The same keys joined into one bytes object (no bytes object per key)."""
        n = len(packed) // page_bytes
        if n == 0:
            return b""
        # A new bytes object the C chain fills before anything else sees it (the C API's own
        # way to build one: PyBytes_FromStringAndSize(NULL, size)); no buffer copied after.
        out = _new_bytes(None, n * KEY_BYTES)
        scratch = ctypes.create_string_buffer(page_bytes + 128)
        self._fn(prior, packed, n, page_bytes, _bytes_at(out), scratch, int(portable))
        return cast("bytes", out)

    def __call__(self, packed: bytes, page_bytes: int, prior: bytes | None) -> list[bytes]:
        return self.chain(packed, page_bytes, prior)

    @property
    def name(self) -> str:
        return "native-sha-ni" if self.accelerated else "native-portable"


def load_native_keys(
    *, compiler: str | None = None, cache_dir: str | Path | None = None
) -> NativeKeys:
    """The native key helper, built if needed; NativeBuildError says why not."""
    return load_helper(
        NativeKeys,
        source=KEYS_SOURCE,
        stem="keys",
        abi=KEYS_ABI,
        what="the native page-key helper",
        fallback="keep the Python page keys (same keys, slower at small page sizes)",
        compiler=compiler,
        cache_dir=cache_dir,
    )


def install_native_keys() -> tuple[bool, str]:
    """Use the native chain for page keys from now on; (installed, which or why not)."""
    try:
        lib = load_native_keys()
    except NativeBuildError as e:
        return False, str(e)
    set_chain_hasher(lib, name=lib.name)
    return True, lib.name


__all__ = [
    "KEYS_ABI",
    "KEYS_SOURCE",
    "NativeKeys",
    "install_native_keys",
    "load_native_keys",
]
