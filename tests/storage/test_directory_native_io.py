"""DirectoryStore's C read-and-check path: the same digest and files as the Python path, every
flipped payload byte caught whichever chunk it falls in, other format versions refused."""

from __future__ import annotations

import os
import random
import struct
import zlib
from collections.abc import Iterator
from pathlib import Path

import pytest

from hicache.adapters.storage import Checksum, DirectorySettings, DirectoryStore, object_file
from hicache.adapters.storage.checksum import checksum_of
from hicache.adapters.storage.format import HEADER_SPAN, VERSION, CorruptObject
from hicache.adapters.storage.native_io import IO_CHUNK, NativeIo, load_native_io
from hicache.domain.storage import StoreStatus
from tests.storage.conftest import empty, joined, key, page

OK, CORRUPT = StoreStatus.OK, StoreStatus.CORRUPT


@pytest.fixture(params=["vector", "portable"])
def native(request: pytest.FixtureRequest) -> Iterator[NativeIo]:
    try:
        lib = load_native_io()
    except Exception as e:  # no C compiler here: nothing native to check
        pytest.skip(f"native storage I/O unavailable: {e}")
    lib.portable(request.param == "portable")
    yield lib
    lib.portable(False)


def segmented(rng: random.Random) -> list[bytearray]:
    sizes = [rng.choice([0, 1, 7, 8, 4095, 4096, 4097, 10_000, 70_001]) for _ in range(5)]
    return [bytearray(rng.randbytes(n)) for n in sizes]


def test_native_digest_equals_the_python_checksum_for_any_segmentation_and_chunk(
    tmp_path: Path, native: NativeIo
) -> None:
    rng = random.Random(3)
    path = tmp_path / "f"
    for _ in range(40):
        data = segmented(rng)
        want = checksum_of(Checksum.BLOCKSUM64, [memoryview(b) for b in data])
        chunk = rng.choice([1, 4096, 5000, IO_CHUNK])
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC)
        try:
            wrote, digest = native.write(fd, 100, [memoryview(b) for b in data], chunk=chunk)
            assert (wrote, digest) == (sum(map(len, data)), want)
            back = [bytearray(len(b)) for b in data]
            assert native.read(fd, 100, [memoryview(b) for b in back], chunk=chunk) == (wrote, want)
            assert back == data
        finally:
            os.close(fd)


def test_native_xxh3_digest_equals_the_xxhash_library_for_any_segmentation_and_chunk(
    tmp_path: Path, native: NativeIo
) -> None:
    rng = random.Random(4)
    path = tmp_path / "f"
    for _ in range(40):
        data = segmented(rng)
        want = checksum_of(Checksum.XXH3, [memoryview(b) for b in data])
        chunk = rng.choice([1, 4096, 5000, IO_CHUNK])
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC)
        try:
            moved = native.write_xxh3(fd, 100, [memoryview(b) for b in data], chunk=chunk)
            assert moved == (sum(map(len, data)), want)
            back = [bytearray(len(b)) for b in data]
            assert native.read_xxh3(fd, 100, [memoryview(b) for b in back], chunk=chunk) == moved
            assert back == data
        finally:
            os.close(fd)


@pytest.mark.parametrize("checksum", [Checksum.XXH3, Checksum.BLOCKSUM64])
def test_both_paths_write_the_same_file_and_read_each_others(
    tmp_path: Path, native: NativeIo, monkeypatch: pytest.MonkeyPatch, checksum: Checksum
) -> None:
    src = page(3 * IO_CHUNK + 12_345, 9)
    files = {}
    for mode in (True, False):
        monkeypatch.setattr(object_file, "_use_native", [mode])
        store = DirectoryStore(DirectorySettings(root=tmp_path / str(mode), checksum=checksum))
        assert store.put([key(1)], [src]) == [OK]
        (obj,) = (tmp_path / str(mode)).glob("*/*.obj")
        files[mode] = obj.read_bytes()
        store.close()
    assert files[True] == files[False]  # the format did not change: old files read as before
    for reader in (True, False):
        for writer in (True, False):
            monkeypatch.setattr(object_file, "_use_native", [reader])
            store = DirectoryStore(
                DirectorySettings(root=tmp_path / str(writer), checksum=checksum)
            )
            dst = empty(3 * IO_CHUNK + 12_345)
            assert store.get([key(1)], [dst]) == [OK]
            assert joined(dst) == joined(src)
            store.close()


SIZE = 3 * IO_CHUNK + 5000
# The first and last byte of every read chunk, and bytes beside 4 KiB block edges inside them.
POSITIONS = sorted(
    {p for c in range(4) for p in (c * IO_CHUNK, c * IO_CHUNK + 4095, c * IO_CHUNK + 4096)}
    | {c * IO_CHUNK - 1 for c in range(1, 4)}
    | {SIZE - 1}
)


@pytest.mark.parametrize("checksum", [Checksum.XXH3, Checksum.BLOCKSUM64])
@pytest.mark.parametrize("position", POSITIONS)
def test_a_flipped_byte_in_any_chunk_is_caught(
    tmp_path: Path, native: NativeIo, position: int, checksum: Checksum
) -> None:
    store = DirectoryStore(DirectorySettings(root=tmp_path, checksum=checksum))
    assert store.put([key(1)], [page(SIZE, 4)]) == [OK]
    (obj,) = tmp_path.glob("*/*.obj")
    with open(obj, "r+b") as f:
        f.seek(HEADER_SPAN + position)
        byte = f.read(1)[0]
        f.seek(HEADER_SPAN + position)
        f.write(bytes([byte ^ 0x01]))
    assert store.get([key(1)], [empty(SIZE)]) == [CORRUPT]
    assert not obj.exists()


@pytest.mark.parametrize("version", [0, VERSION + 1])
def test_an_object_of_another_format_version_is_refused_not_misread(
    tmp_path: Path, version: int
) -> None:
    store = DirectoryStore(DirectorySettings(root=tmp_path))
    assert store.put([key(1)], [page(10_000, 2)]) == [OK]
    (obj,) = tmp_path.glob("*/*.obj")
    data = bytearray(obj.read_bytes())
    struct.pack_into("<H", data, 8, version)  # the version field, after the 8-byte magic
    struct.pack_into("<I", data, HEADER_SPAN - 4, zlib.crc32(data[: HEADER_SPAN - 4]))
    obj.write_bytes(bytes(data))  # a header whole in every other way
    fd = os.open(obj, os.O_RDONLY)
    try:
        with pytest.raises(CorruptObject, match=f"format version {version}"):
            object_file.read_object(fd, key(1), empty(10_000))
    finally:
        os.close(fd)
    assert store.get([key(1)], [empty(10_000)]) == [CORRUPT]
