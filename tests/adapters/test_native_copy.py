"""The native batched memcpy: every byte of every piece lands where it should, whatever the mix.

The helper copies short pieces one by one, long ones several at a time in turns
(hicache.adapters.copy.native); these tests compare it with a plain Python reference on mixes
that exercise both paths in one call: sizes around each threshold, unaligned offsets, several
layers, and the chunked form.
"""

from __future__ import annotations

import numpy as np
import pytest

from hicache.adapters.copy.native import load_native

I64 = np.int64
# Around every threshold of the helper: streaming (256 B), turns (4 KiB), one turn (256 B).
SIZES = (0, 1, 63, 64, 255, 256, 257, 320, 4095, 4096, 4097, 5000, 16384, 65536 + 17)


def _disjoint_offsets(rng: np.random.Generator, sizes: list[int], span: int) -> list[int]:
    """Offsets in [0, span) of non-overlapping pieces with the given sizes, in random order."""
    order = rng.permutation(len(sizes))
    gaps = rng.integers(0, 97, size=len(sizes))
    offsets = [0] * len(sizes)
    at = int(rng.integers(0, 31))
    for k in order:
        offsets[k] = at
        at += sizes[k] + int(gaps[k])
    assert at <= span
    return offsets


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_pieces_of_every_size_land_exactly_across_layers(seed: int) -> None:
    rng = np.random.default_rng(seed)
    lib = load_native()
    sizes = [int(x) for x in rng.choice(SIZES, size=60)] + list(SIZES)
    span = sum(sizes) + 100 * len(sizes) + 64
    layers = 3
    src = [rng.integers(0, 256, size=span, dtype=np.uint8) for _ in range(layers)]
    dst = [np.zeros(span, dtype=np.uint8) for _ in range(layers)]
    soff = _disjoint_offsets(rng, sizes, span)
    doff = _disjoint_offsets(rng, sizes, span)
    copied = lib.copy(
        np.array([d.ctypes.data for d in dst], dtype=I64),
        np.array([s.ctypes.data for s in src], dtype=I64),
        np.array(doff, dtype=I64),
        np.array(soff, dtype=I64),
        np.array(sizes, dtype=I64),
    )
    assert copied == layers * sum(sizes)
    for layer in range(layers):
        want = np.zeros(span, dtype=np.uint8)
        for d, s, n in zip(doff, soff, sizes, strict=True):
            want[d : d + n] = src[layer][s : s + n]
        np.testing.assert_array_equal(dst[layer], want)


@pytest.mark.parametrize("chunk", [64, 1024, 4096, 8192 + 8])
def test_chunked_pieces_land_exactly(chunk: int) -> None:
    """The chunked form (a page whose chunks the layout scatters), long and short chunks."""
    rng = np.random.default_rng(chunk)
    lib = load_native()
    chunks = 5
    pages = 12
    page = chunks * chunk
    src = rng.integers(0, 256, size=2 * pages * page, dtype=np.uint8)
    dst = np.zeros(2 * pages * page + 8, dtype=np.uint8)
    # Source chunks in page order, destination chunks reversed and spaced out.
    schunk = np.arange(chunks, dtype=I64) * chunk
    dchunk = (chunks - 1 - np.arange(chunks, dtype=I64)) * 2 * chunk
    host_pages = rng.permutation(2 * pages)[:pages]
    dev_pages = rng.permutation(pages)
    soff = host_pages.astype(I64) * page
    doff = dev_pages.astype(I64) * 2 * page + 8  # 8: destinations not 16-byte aligned
    copied = lib.copy(
        np.array([dst.ctypes.data], dtype=I64),
        np.array([src.ctypes.data], dtype=I64),
        doff,
        soff,
        None,
        dchunk,
        schunk,
        chunk,
    )
    assert copied == pages * page
    want = np.zeros_like(dst)
    for d, s in zip(doff, soff, strict=True):
        for dc, sc in zip(dchunk, schunk, strict=True):
            want[d + dc : d + dc + chunk] = src[s + sc : s + sc + chunk]
    np.testing.assert_array_equal(dst, want)


def test_a_call_without_pieces_copies_nothing() -> None:
    lib = load_native()
    buf = np.zeros(8, dtype=np.uint8)
    empty = np.zeros(0, dtype=I64)
    addr = np.array([buf.ctypes.data], dtype=I64)
    assert lib.copy(addr, addr, empty, empty, empty) == 0
    assert lib.copy(np.zeros(0, dtype=I64), np.zeros(0, dtype=I64), empty, empty, empty) == 0
