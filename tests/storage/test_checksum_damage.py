"""The directory store's default checksum catches damage that cancels within a block.

Three damages leave every 4 KiB block's word sum unchanged, so blocksum64 (the default before
xxh3) passed them as valid pages: +1 on one 64-bit word and -1 on the next, two adjacent words
swapped, and one bit moved from one word to another. Each is built on a stored object here; with
the default checksum (xxh3) each is a miss, in the store that wrote it and after a restart, and
objects written with the older checksums are still read and checked by their own algorithm.
"""

from __future__ import annotations

import os
import struct
import zlib
from collections.abc import Callable
from pathlib import Path

import pytest

from hicache.adapters.storage import Checksum, DirectorySettings, DirectoryStore, object_file
from hicache.adapters.storage.format import HEADER_SPAN, CorruptObject, decode_header
from hicache.domain.storage import StoreStatus
from tests.storage.conftest import empty, key, page

OK, MISS, CORRUPT = StoreStatus.OK, StoreStatus.MISS, StoreStatus.CORRUPT
SIZE = 3 * 4096 + 100
WORD = 8 * 700  # a word well inside the second 4 KiB block of the payload


def _words(data: bytearray, at: int) -> tuple[int, int]:
    a, b = struct.unpack_from("<QQ", data, HEADER_SPAN + at)
    return a, b


def _put_words(data: bytearray, at: int, a: int, b: int) -> None:
    struct.pack_into("<QQ", data, HEADER_SPAN + at, a % (1 << 64), b % (1 << 64))


def compensating(data: bytearray) -> None:
    """+1 on one word, -1 on the next: the block's sum is unchanged."""
    a, b = _words(data, WORD)
    _put_words(data, WORD, a + 1, b - 1)


def swapped(data: bytearray) -> None:
    """Two adjacent words exchanged (they differ): the block's sum is unchanged."""
    a, b = _words(data, WORD)
    assert a != b
    _put_words(data, WORD, b, a)


def bit_moved(data: bytearray) -> None:
    """Bit 3 moved from one word to the next (set in the first, clear in the second): the
    block's sum is unchanged."""
    for at in range(WORD, WORD + 8 * 64, 8):
        a, b = _words(data, at)
        if a & 8 and not b & 8:
            _put_words(data, at, a & ~8, b | 8)
            return
    raise AssertionError("no pair of words with bit 3 set in one and clear in the next")


DAMAGES: dict[str, Callable[[bytearray], None]] = {
    "compensating": compensating,
    "swapped": swapped,
    "bit_moved": bit_moved,
}


def _store(root: Path, checksum: Checksum | None = None) -> DirectoryStore:
    settings = (
        DirectorySettings(root=root)
        if checksum is None
        else DirectorySettings(root=root, checksum=checksum)
    )
    return DirectoryStore(settings)


def _damage(root: Path, how: Callable[[bytearray], None]) -> Path:
    (obj,) = root.glob("*/*.obj")
    data = bytearray(obj.read_bytes())
    before = bytes(data)
    how(data)
    assert bytes(data) != before  # the damage really changed the payload
    obj.write_bytes(bytes(data))
    return obj


def _block_sums_equal(a: bytes, b: bytes) -> bool:
    """Whether every 4 KiB block of two payloads has the same uint64 word sum (blocksum64)."""
    for lo in range(0, len(a), 4096):
        pa, pb = a[lo : lo + 4096].ljust(4096, b"\0"), b[lo : lo + 4096].ljust(4096, b"\0")
        sa = sum(struct.unpack(f"<{4096 // 8}Q", pa)) % (1 << 64)
        sb = sum(struct.unpack(f"<{4096 // 8}Q", pb)) % (1 << 64)
        if sa != sb:
            return False
    return True


@pytest.mark.parametrize("damage", sorted(DAMAGES))
def test_damage_that_cancels_within_a_block_is_corrupt_with_the_default_checksum(
    tmp_path: Path, damage: str
) -> None:
    store = _store(tmp_path)
    assert store.settings.checksum is Checksum.XXH3
    assert store.put([key(1)], [page(SIZE, 5)]) == [OK]
    obj = _damage(tmp_path, DAMAGES[damage])
    assert store.get([key(1)], [empty(SIZE)]) == [CORRUPT]
    assert not obj.exists()


@pytest.mark.parametrize("damage", sorted(DAMAGES))
def test_damage_that_cancels_within_a_block_is_corrupt_after_a_restart(
    tmp_path: Path, damage: str
) -> None:
    first = _store(tmp_path)
    assert first.put([key(1)], [page(SIZE, 6)]) == [OK]
    first.close()
    _damage(tmp_path, DAMAGES[damage])
    again = _store(tmp_path)
    assert again.get([key(1)], [empty(SIZE)]) == [CORRUPT]


@pytest.mark.parametrize("damage", sorted(DAMAGES))
def test_each_damage_leaves_blocksum64_unchanged_which_is_why_it_is_no_longer_the_default(
    tmp_path: Path, damage: str
) -> None:
    # The broken case: the old default passes these damages as a valid page.
    store = _store(tmp_path, Checksum.BLOCKSUM64)
    original = page(SIZE, 7)
    assert store.put([key(1)], [original]) == [OK]
    obj = _damage(tmp_path, DAMAGES[damage])
    payload = obj.read_bytes()[HEADER_SPAN:]
    assert _block_sums_equal(payload, b"".join(bytes(s) for s in original))
    out = empty(SIZE)
    assert store.get([key(1)], [out]) == [OK]
    assert b"".join(bytes(s) for s in out) == payload  # damaged bytes answered as a hit


@pytest.mark.parametrize("checksum", [Checksum.BLOCKSUM64, Checksum.CRC32])
def test_objects_of_the_older_checksums_are_read_and_checked_by_their_own(
    tmp_path: Path, checksum: Checksum
) -> None:
    _store(tmp_path, checksum).put([key(1)], [page(SIZE, 8)])
    (obj,) = tmp_path.glob("*/*.obj")
    header = decode_header(obj.read_bytes()[:HEADER_SPAN])
    assert header.checksum is checksum
    assert obj.read_bytes()[8:10] == struct.pack("<H", 1)  # the format those files always had
    reader = _store(tmp_path)  # a store of today's default reads them
    out = empty(SIZE)
    assert reader.get([key(1)], [out]) == [OK]
    assert b"".join(bytes(s) for s in out) == b"".join(bytes(s) for s in page(SIZE, 8))
    data = bytearray(obj.read_bytes())
    data[HEADER_SPAN + 10] ^= 0x10
    obj.write_bytes(bytes(data))
    assert reader.get([key(1)], [empty(SIZE)]) == [CORRUPT]  # and checked by their algorithm


def test_a_64_bit_checksum_in_a_version_1_header_is_refused_not_misread(tmp_path: Path) -> None:
    _store(tmp_path).put([key(1)], [page(SIZE, 9)])
    (obj,) = tmp_path.glob("*/*.obj")
    data = bytearray(obj.read_bytes())
    assert data[8:10] == struct.pack("<H", 2)
    struct.pack_into("<H", data, 8, 1)  # claims the 32-bit format
    struct.pack_into("<I", data, HEADER_SPAN - 4, zlib.crc32(data[: HEADER_SPAN - 4]))
    obj.write_bytes(bytes(data))
    fd = os.open(obj, os.O_RDONLY)
    try:
        with pytest.raises(CorruptObject, match="xxh3 in a version 1 header"):
            object_file.read_object(fd, key(1), empty(SIZE))
    finally:
        os.close(fd)


def test_the_full_64_bit_digest_is_checked(tmp_path: Path) -> None:
    _store(tmp_path).put([key(1)], [page(SIZE, 10)])
    (obj,) = tmp_path.glob("*/*.obj")
    data = bytearray(obj.read_bytes())
    header = decode_header(bytes(data[:HEADER_SPAN]))
    assert header.payload_crc >> 32  # the upper half is really stored (here: not zero)
    digest_at = 8 + 2 + 2 + 4 + 8  # magic, version, algorithm, header length, payload length
    high = struct.unpack_from("<I", data, digest_at + 4)[0]
    struct.pack_into("<I", data, digest_at + 4, high ^ 1)  # only the upper half differs
    struct.pack_into("<I", data, HEADER_SPAN - 4, zlib.crc32(data[: HEADER_SPAN - 4]))
    obj.write_bytes(bytes(data))
    assert _store(tmp_path).get([key(1)], [empty(SIZE)]) == [CORRUPT]
