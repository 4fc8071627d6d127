"""Payload checksums of stored pages, computed over a page's segments as one byte stream.

- Checksum: the algorithms a DirectoryStore file may name in its header (by number).
- Summer: a running checksum fed piece by piece (a get checks each piece while it is in cache).
- checksum_of: the checksum of a page buffer's bytes, however they are segmented.

xxh3 (the default): xxHash's XXH3, 64 bits, from the ``xxhash`` package (the xxHash library's
own C code; it releases the GIL while it hashes), fed piece by piece. A non-cryptographic hash
in which every input bit affects every output bit: it catches reordered words and changes that
cancel inside a block, which blocksum64 cannot (a sum does not see order, and +1 on one word with
-1 on the next leaves it unchanged). It runs at several GB/s on one core.

blocksum64 (the default before xxh3; objects written with it are still read and checked by it):
each 4 KiB block of the stream (the last one zero-padded) is summed as
512 little-endian uint64 words modulo 2**64 in numpy, and the block sums are fed to zlib.crc32 in
order. It catches a single changed word and a changed, zeroed, truncated or misplaced block,
but NOT changes that cancel within a block (two words swapped, +1 and -1 on two words, a bit
moved between words). crc32: zlib.crc32 of
every byte (stronger against patterns of bit flips within one block, ~3 GB/s on this machine's
CPU, which halves a warm-cache read: see docs/storage.md).
"""

from __future__ import annotations

import enum
import zlib
from collections.abc import Sequence
from typing import Any

import numpy as np

from hicache.domain import ConfigError
from hicache.domain.errors import shown

BLOCK = 4096
_WORDS = BLOCK // 8
_LE_U64 = np.dtype("<u8")


class Checksum(enum.Enum):
    CRC32 = 1
    BLOCKSUM64 = 2
    XXH3 = 3

    @property
    def digest_bits(self) -> int:
        """32 for CRC32 and BLOCKSUM64, 64 for XXH3."""
        return 64 if self is Checksum.XXH3 else 32

    @classmethod
    def parse(cls, value: object) -> Checksum:
        if isinstance(value, Checksum):
            return value
        names = {m.name.lower(): m for m in cls}
        if not isinstance(value, str) or value.strip().lower() not in names:
            raise ConfigError(
                f"unknown checksum {shown(value)}: expected one of {', '.join(names)}"
            )
        return names[value.strip().lower()]


class Summer:
    """A running checksum of a byte stream fed in pieces of any size (``update``, ``digest``)."""

    def __init__(self, algorithm: Checksum) -> None:
        self.algorithm = algorithm
        self._crc = 0
        self._carry = bytearray()  # blocksum64: the bytes of a block not yet complete
        self._xxh = _xxh3() if algorithm is Checksum.XXH3 else None

    def update(self, seg: memoryview) -> None:
        view = seg if seg.format == "B" and seg.ndim == 1 else seg.cast("B")
        if self._xxh is not None:
            self._xxh.update(view)
            return
        if self.algorithm is Checksum.CRC32:
            self._crc = zlib.crc32(view, self._crc)
            return
        start = 0
        if self._carry:
            start = min(BLOCK - len(self._carry), view.nbytes)
            self._carry += view[:start]
            if len(self._carry) < BLOCK:
                return
            self._block(self._carry)
            self._carry = bytearray()
        whole = (view.nbytes - start) // BLOCK * BLOCK
        if whole:
            words = np.frombuffer(view[start : start + whole], dtype=_LE_U64)
            sums = np.add.reduce(words.reshape(-1, _WORDS), axis=1, dtype=np.uint64)
            self._crc = zlib.crc32(sums.astype(_LE_U64, copy=False).data, self._crc)
        self._carry += view[start + whole :]

    def _block(self, block: bytearray) -> None:
        total = np.frombuffer(block, dtype=_LE_U64).sum(dtype=np.uint64)
        self._crc = zlib.crc32(np.array([total], dtype=_LE_U64).data, self._crc)

    def digest(self) -> int:
        """The checksum of everything fed so far: 64 bits for XXH3, else 32 (blocksum64: a final
        partial block is zero-padded)."""
        if self._xxh is not None:
            return int(self._xxh.intdigest())
        crc = self._crc
        if self._carry:
            block = self._carry + bytes(BLOCK - len(self._carry))
            total = np.frombuffer(block, dtype=_LE_U64).sum(dtype=np.uint64)
            crc = zlib.crc32(np.array([total], dtype=_LE_U64).data, crc)
        return crc & 0xFFFFFFFF


def _xxh3() -> Any:
    """A fresh XXH3-64 hasher of the ``xxhash`` package (a dependency of hicache)."""
    try:
        import xxhash
    except ImportError as e:
        raise ConfigError(
            "checksum 'xxh3' needs the xxhash package (a dependency of hicache: pip install "
            "xxhash), or set the directory store's checksum to 'blocksum64'"
        ) from e
    return xxhash.xxh3_64()


def checksum_of(algorithm: Checksum, segments: Sequence[memoryview]) -> int:
    """The checksum of the concatenated bytes of ``segments`` (``algorithm.digest_bits``)."""
    summer = Summer(algorithm)
    for seg in segments:
        summer.update(seg)
    return summer.digest()
