"""DirectoryStore: atomic writes under SIGKILL, corruption as misses, hashed names, the LRU cap."""

from __future__ import annotations

import errno
import os
import random
import time
from pathlib import Path

import pytest

from hicache.adapters.storage import (
    Checksum,
    DirectorySettings,
    DirectoryStore,
    object_file,
    object_name,
)
from hicache.adapters.storage.format import HEADER_SPAN
from hicache.domain import ConfigError, StoreError
from hicache.domain.storage import StoreKey, StoreStatus
from tests.child_process import kill_after_first_line
from tests.storage.conftest import empty, joined, key, page

OK, MISS, CORRUPT = StoreStatus.OK, StoreStatus.MISS, StoreStatus.CORRUPT
OBJ = HEADER_SPAN + 4096  # the file size of a 4 KiB page


def open_store(root: Path, **kw: object) -> DirectoryStore:
    return DirectoryStore(DirectorySettings(root=root, **kw))  # type: ignore[arg-type]


def object_files(root: Path) -> list[Path]:
    return sorted(root.glob("*/*.obj"))


def tmp_files(root: Path) -> list[Path]:
    return sorted(root.glob("*/*.tmp"))


# -- atomicity under SIGKILL --------------------------------------------------------------------

WRITER = """
import os, sys, time
from hicache.adapters.storage import DirectorySettings, DirectoryStore
from tests.storage.conftest import key
root, nbytes, fill, mode = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
store = DirectoryStore(DirectorySettings(root=root))

def say_and_hang(*_args, **_kwargs):
    sys.stdout.write("mid-write\\n")
    sys.stdout.flush()
    time.sleep(60)

if mode == "mid":  # write half of the first piece asked for, then wait to be killed
    from hicache.adapters.storage import object_file
    object_file.use_native_io(False)  # the Python path's os.pwritev is what is intercepted
    real_pwritev = os.pwritev
    def half_then_hang(fd, views, offset):
        real_pwritev(fd, [views[0][: max(1, views[0].nbytes // 2)]], offset)
        say_and_hang()
    os.pwritev = half_then_hang
elif mode == "before-rename":  # the temp file is whole, the rename never comes
    os.rename = say_and_hang
elif mode == "loop":  # rewrite the key over and over until killed
    sys.stdout.write("mid-write\\n")
    sys.stdout.flush()
    n = 0
    while True:
        n += 1
        size = nbytes + 4096 * (n % 2)  # another size each time, so no put is skipped
        store.put([key(1)], [[memoryview(bytes([n % 251]) * size)]])
store.put([key(1)], [[memoryview(bytes([fill]) * nbytes)]])
"""


def kill_writer(root: Path, nbytes: int, fill: int, mode: str, delay: float = 0.0) -> None:
    """Run a writer in a fresh process and SIGKILL it once it says it is mid-write."""
    args = [str(root), str(nbytes), str(fill), mode]
    assert kill_after_first_line(WRITER, args, "mid-write", delay) == []


NBYTES = 1 << 20


@pytest.mark.parametrize("mode", ["mid", "before-rename"])
def test_a_writer_killed_mid_put_leaves_the_old_object_whole(tmp_path: Path, mode: str) -> None:
    store = open_store(tmp_path)
    assert store.put([key(1)], [[memoryview(bytes([7]) * NBYTES)]]) == [OK]
    # The writer puts a page of another size under the same key (so it is not skipped).
    kill_writer(tmp_path, NBYTES + 4096, 9, mode)
    (tmp,) = tmp_files(tmp_path)  # caught mid-write
    if mode == "mid":
        assert tmp.stat().st_size < HEADER_SPAN + NBYTES
    dst = empty(NBYTES)
    assert store.get([key(1)], [dst]) == [OK]
    assert set(joined(dst)) == {7}
    assert store.get([key(1)], [empty(NBYTES + 4096)]) == [StoreStatus.INVALID]


def test_a_writer_killed_mid_first_put_leaves_a_miss_and_a_stale_temp_file(
    tmp_path: Path,
) -> None:
    kill_writer(tmp_path, NBYTES, 9, "mid")
    (tmp,) = tmp_files(tmp_path)
    assert 0 < tmp.stat().st_size < HEADER_SPAN + NBYTES  # really torn
    store = open_store(tmp_path)
    assert store.exists([key(1)]) == [False]
    assert store.get([key(1)], [empty(NBYTES)]) == [MISS]
    assert tmp_files(tmp_path) == [tmp]  # younger than stale_tmp_s: maybe another writer's
    open_store(tmp_path, stale_tmp_s=0)
    assert tmp_files(tmp_path) == []


def test_writers_killed_at_random_moments_never_leave_mixed_bytes(tmp_path: Path) -> None:
    rng = random.Random(5)
    for _ in range(4):
        kill_writer(tmp_path, NBYTES, 0, "loop", delay=rng.uniform(0.05, 0.4))
        store = open_store(tmp_path, stale_tmp_s=0)
        assert tmp_files(tmp_path) == []
        dst = empty(NBYTES)
        status = store.get([key(1)], [dst])
        if status == [StoreStatus.INVALID]:  # the last whole put had the other size
            dst = empty(NBYTES + 4096)
            status = store.get([key(1)], [dst])
        assert status in ([OK], [MISS])
        if status == [OK]:
            assert len(set(joined(dst))) == 1, "a reader saw bytes of two different puts"


# -- corruption --------------------------------------------------------------------------------


def flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x40
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("checksum", list(Checksum))
@pytest.mark.parametrize(
    "offset",
    [
        0,
        9,
        20,
        60,
        100,
        HEADER_SPAN - 1,
        HEADER_SPAN,
        HEADER_SPAN + 4095,
        HEADER_SPAN + 5000,
        HEADER_SPAN + 9999,
    ],
)
def test_a_flipped_byte_is_corrupt_and_the_file_is_removed(
    tmp_path: Path, checksum: Checksum, offset: int
) -> None:
    store = open_store(tmp_path, checksum=checksum)
    assert store.put([key(1)], [page(10000)]) == [OK]
    (obj,) = object_files(tmp_path)
    flip(obj, offset)
    assert store.get([key(1)], [empty(10000)]) == [CORRUPT]
    assert not obj.exists()
    assert store.exists([key(1)]) == [False]
    assert store.put([key(1)], [page(10000)]) == [OK]  # a later put repairs it
    assert store.get([key(1)], [empty(10000)]) == [OK]


def test_an_unflipped_file_passes_so_the_flip_is_what_is_caught(tmp_path: Path) -> None:
    store = open_store(tmp_path)
    store.put([key(1)], [page(10000)])
    (obj,) = object_files(tmp_path)
    flip(obj, HEADER_SPAN + 5000)
    flip(obj, HEADER_SPAN + 5000)  # flipped back
    assert store.get([key(1)], [empty(10000)]) == [OK]


@pytest.mark.parametrize("size", [0, 10, HEADER_SPAN, HEADER_SPAN + 4095, HEADER_SPAN + 4097])
def test_a_truncated_or_extended_file_is_corrupt(tmp_path: Path, size: int) -> None:
    store = open_store(tmp_path)
    store.put([key(1)], [page(4096)])
    (obj,) = object_files(tmp_path)
    data = obj.read_bytes()
    obj.write_bytes((data + bytes(1))[:size])
    assert store.get([key(1)], [empty(4096)]) == [CORRUPT]
    assert not obj.exists()


def test_a_file_of_another_key_is_corrupt_and_removed(tmp_path: Path) -> None:
    store = open_store(tmp_path)
    store.put([key(1), key(2)], [page(4096, 1), page(4096, 2)])
    one, two = (tmp_path / object_name(k)[:2] / f"{object_name(k)}.obj" for k in (key(1), key(2)))
    os.replace(two, one)  # key 1's name now holds key 2's object
    assert store.get([key(1)], [empty(4096)]) == [CORRUPT]
    assert not one.exists()


def test_a_namespace_mismatch_is_corrupt(tmp_path: Path) -> None:
    store = open_store(tmp_path)
    a, b = key(1, namespace="model-a"), key(1, namespace="model-b")
    store.put([a], [page(4096)])
    path_a = tmp_path / object_name(a)[:2] / f"{object_name(a)}.obj"
    path_b = tmp_path / object_name(b)[:2] / f"{object_name(b)}.obj"
    path_b.parent.mkdir(exist_ok=True)
    os.replace(path_a, path_b)
    assert store.get([b], [empty(4096)]) == [CORRUPT]


def test_segmentation_does_not_change_the_object(tmp_path: Path) -> None:
    store = open_store(tmp_path)
    src = page(3 * 4096 + 100, 3)
    store.put([key(1)], [src])
    whole = bytearray(3 * 4096 + 100)
    view = memoryview(whole)
    parts = [view[:5], view[5:4100], view[4100:9000], view[9000:]]
    assert store.get([key(1)], [parts]) == [OK]
    assert bytes(whole) == joined(src)


# -- names -------------------------------------------------------------------------------------


def test_file_names_are_hashes_and_stay_under_the_root(tmp_path: Path) -> None:
    root = tmp_path / "root"
    store = open_store(root)
    sneaky = StoreKey("..", "..", "0" * 64)
    store.put([sneaky, key(1, namespace="..-..")], [page(64), page(64)])
    files = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert files
    assert all(p.is_relative_to(root) for p in files)
    for p in files:
        assert p.parent.parent == root
        assert len(p.stem) == 64
        assert set(p.stem) <= set("0123456789abcdef")
        assert p.parent.name == p.stem[:2]
    assert store.get([sneaky], [empty(64)]) == [OK]


def test_key_text_that_is_no_token_cannot_be_built() -> None:
    with pytest.raises(ConfigError, match=r"namespace '\.\./x'"):
        StoreKey("../x", "kv", "0" * 64)


# -- the size cap --------------------------------------------------------------------------------


def test_the_cap_evicts_the_least_recently_used(tmp_path: Path) -> None:
    store = open_store(tmp_path, capacity_bytes=3 * OBJ)
    store.put([key(1), key(2), key(3)], [page(4096)] * 3)
    assert store.get([key(1)], [empty(4096)]) == [OK]  # 2 is now the least recently used
    assert store.put([key(4)], [page(4096)]) == [OK]
    assert store.exists([key(1), key(2), key(3), key(4)]) == [True, False, True, True]
    assert len(object_files(tmp_path)) == 3
    assert store.used_bytes == 3 * OBJ


def test_without_eviction_the_cap_would_be_exceeded(tmp_path: Path) -> None:
    store = open_store(tmp_path)  # no cap: the same puts keep every object
    store.put([key(i) for i in range(1, 5)], [page(4096)] * 4)
    assert len(object_files(tmp_path)) == 4


def test_an_object_larger_than_the_cap_is_full(tmp_path: Path) -> None:
    store = open_store(tmp_path, capacity_bytes=OBJ - 1)
    assert store.put([key(1)], [page(4096)]) == [StoreStatus.FULL]
    assert object_files(tmp_path) == []


def test_reopening_rebuilds_the_lru_order_from_mtimes_and_applies_the_cap(tmp_path: Path) -> None:
    store = open_store(tmp_path)
    store.put([key(1), key(2), key(3)], [page(4096)] * 3)
    for i, k in enumerate([key(2), key(3), key(1)]):  # 2 oldest, 1 newest
        p = tmp_path / object_name(k)[:2] / f"{object_name(k)}.obj"
        os.utime(p, ns=(10**18 + i, 10**18 + i))
    reopened = open_store(tmp_path, capacity_bytes=2 * OBJ)
    assert len(reopened) == 2
    assert reopened.exists([key(1), key(2), key(3)]) == [True, False, True]


def test_a_put_of_a_held_key_is_skipped(tmp_path: Path) -> None:
    store = open_store(tmp_path)
    store.put([key(1)], [page(4096, 1)])
    (obj,) = object_files(tmp_path)
    inode = obj.stat().st_ino
    assert store.put([key(1)], [page(4096, 1)]) == [OK]
    assert obj.stat().st_ino == inode


def test_disk_full_is_full_and_leaves_no_temp_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = open_store(tmp_path, capacity_bytes=10 * OBJ)

    def no_space(fd: int, views: object, offset: int) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "pwritev", no_space)
    assert store.put([key(1)], [page(4096)]) == [StoreStatus.FULL]
    assert tmp_files(tmp_path) == []
    assert object_files(tmp_path) == []
    assert store.used_bytes == 0
    assert len(store) == 0
    monkeypatch.undo()
    assert store.put([key(1)], [page(4096)]) == [OK]


# -- deadlines, health, settings ---------------------------------------------------------------


def test_a_deadline_that_passes_mid_batch_answers_transient_for_the_rest(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = open_store(tmp_path)
    store.put([key(i) for i in range(3)], [page(64)] * 3)
    now = [100.0]

    def clock() -> float:
        now[0] += 1
        return now[0]

    monkeypatch.setattr(time, "monotonic", clock)
    got = store.get([key(i) for i in range(3)], [empty(64)] * 3, deadline=102.5)
    assert got == [OK, OK, StoreStatus.TRANSIENT]


def test_health_reports_a_vanished_root(tmp_path: Path) -> None:
    store = open_store(tmp_path / "r", capacity_bytes=OBJ)
    assert store.health().healthy
    assert f"of {OBJ} B" in store.health().detail
    (tmp_path / "r").rmdir()
    assert not store.health().healthy


def test_a_default_store_uses_a_temporary_root_it_removes_on_close() -> None:
    store = DirectoryStore()
    root = store.root
    store.put([key(1)], [page(64)])
    assert root.is_dir()
    store.close()
    assert not root.exists()


def test_a_configured_root_is_kept_on_close(tmp_path: Path) -> None:
    store = open_store(tmp_path)
    store.put([key(1)], [page(64)])
    store.close()
    assert len(object_files(tmp_path)) == 1
    assert open_store(tmp_path).get([key(1)], [empty(64)]) == [OK]


@pytest.mark.parametrize(
    ("config", "match"),
    [
        (
            {"capacity_bytes": 0},
            r"capacity_bytes must be a whole number of bytes in \[1, .*\], got 0",
        ),
        ({"fsync": "yes"}, "fsync must be true or false, got 'yes'"),
        ({"checksum": "md5"}, "unknown checksum 'md5'"),
        ({"root": ""}, "root must be a non-empty path"),
        ({"rot": "/x"}, r"unknown keys \['rot'\]"),
    ],
)
def test_bad_settings_are_config_errors_naming_the_value(
    config: dict[str, object], match: str
) -> None:
    with pytest.raises(ConfigError, match=match):
        DirectorySettings.from_config(config)


def test_a_root_that_is_a_file_is_a_store_error(tmp_path: Path) -> None:
    (tmp_path / "f").write_text("x")
    with pytest.raises(StoreError, match=r"'.*/f'"):
        open_store(tmp_path / "f")


def test_fsync_on_writes_and_reads_back(tmp_path: Path) -> None:
    store = open_store(tmp_path, fsync=True)
    src = page(8192, 4)
    assert store.put([key(1)], [src]) == [OK]
    dst = empty(8192)
    assert store.get([key(1)], [dst]) == [OK]
    assert joined(dst) == joined(src)


def test_concurrent_puts_gets_and_removes_keep_the_index_equal_to_the_files(
    tmp_path: Path,
) -> None:
    import threading

    store = open_store(tmp_path, capacity_bytes=6 * OBJ)
    errors: list[BaseException] = []

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        try:
            for _ in range(60):
                i = rng.randrange(12)
                op = rng.choice(("put", "get", "remove"))
                if op == "put":
                    store.put([key(i)], [page(4096, i)])
                elif op == "get":
                    dst = empty(4096)
                    if store.get([key(i)], [dst]) == [OK]:
                        assert joined(dst) == joined(page(4096, i))
                else:
                    store.remove([key(i)])
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    files = object_files(tmp_path)
    assert store.used_bytes == sum(p.stat().st_size for p in files)
    assert len(store) == len(files)
    assert store.used_bytes <= 6 * OBJ
    assert tmp_files(tmp_path) == []


def test_partial_reads_and_writes_are_resumed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_preadv, real_pwritev = os.preadv, os.pwritev

    def trickle(views: list[memoryview], limit: int = 1000) -> list[memoryview]:
        out, left = [], limit
        for v in views:
            if left <= 0:
                break
            out.append(v[:left])
            left -= out[-1].nbytes
        return out

    monkeypatch.setattr(object_file, "_use_native", [False])  # the C path resumes on its own
    monkeypatch.setattr(os, "preadv", lambda fd, vs, off: real_preadv(fd, trickle(vs), off))
    monkeypatch.setattr(os, "pwritev", lambda fd, vs, off: real_pwritev(fd, trickle(vs), off))
    store = open_store(tmp_path)
    src = [
        memoryview(bytearray(random.Random(i).randbytes(n))) for i, n in enumerate([700, 5000, 3])
    ]
    assert store.put([key(1)], [src]) == [OK]
    dst = [memoryview(bytearray(n)) for n in (3000, 2703)]
    assert store.get([key(1)], [dst]) == [OK]
    assert joined(dst) == joined(src)


def test_no_storage_module_deserialises_with_pickle() -> None:
    import re

    import hicache.adapters.storage as pkg

    unsafe = re.compile(r"\bimport pickle\b|\bfrom pickle\b|torch\.load|np\.load|\bmarshal\b")
    sources = list(Path(pkg.__file__).parent.glob("*.py"))
    assert len(sources) >= 5
    assert [p.name for p in sources if unsafe.search(p.read_text())] == []


def test_a_fan_out_directory_that_is_a_link_out_of_the_root_is_refused(tmp_path: Path) -> None:
    root, outside = tmp_path / "root", tmp_path / "outside"
    root.mkdir()
    outside.mkdir()
    (root / "ab").symlink_to(outside)
    with pytest.raises(StoreError, match="'ab' is a symbolic link"):
        open_store(root)


def _swap_fan_for_link(root: Path, outside: Path) -> str:
    """Move the (only) fan-out folder out of the root and leave a link to it in its place."""
    (fan,) = [p for p in root.iterdir() if len(p.name) == 2]
    fan.rename(outside / fan.name)
    fan.symlink_to(outside / fan.name)
    return fan.name


def test_a_fan_out_folder_replaced_by_a_link_after_open_is_never_read_through(
    tmp_path: Path,
) -> None:
    root, outside = tmp_path / "root", tmp_path / "outside"
    outside.mkdir()
    store = open_store(root)
    assert store.put([key(1)], [page(10000, 3)]) == [OK]
    _swap_fan_for_link(root, outside)
    # The object's bytes are intact outside the root, one link away: still a miss.
    assert store.get([key(1)], [empty(10000)]) == [MISS]
    assert len(list(outside.glob("*/*.obj"))) == 1  # and nothing there was removed either


def test_a_fan_out_folder_replaced_by_a_link_after_open_is_never_written_through(
    tmp_path: Path,
) -> None:
    root, outside = tmp_path / "root", tmp_path / "outside"
    outside.mkdir()
    store = open_store(root)
    assert store.put([key(1)], [page(10000, 3)]) == [OK]
    fan = _swap_fan_for_link(root, outside)
    # Another key of the same fan-out folder: the put is refused, nothing lands outside.
    same_fan = next(i for i in range(2, 5000) if object_name(key(i))[:2] == fan)
    before = sorted(p.name for p in (outside / fan).iterdir())
    assert store.put([key(same_fan)], [page(10000, 4)]) == [StoreStatus.FATAL]
    assert sorted(p.name for p in (outside / fan).iterdir()) == before
    # A removal of the first key does not follow the link either.
    store.remove([key(1)])
    assert sorted(p.name for p in (outside / fan).iterdir()) == before


def test_without_the_no_follow_open_the_link_would_reach_outside(tmp_path: Path) -> None:
    # The broken case the store guards against: an ordinary path open follows the link.
    root, outside = tmp_path / "root", tmp_path / "outside"
    outside.mkdir()
    store = open_store(root)
    assert store.put([key(1)], [page(10000, 3)]) == [OK]
    fan = _swap_fan_for_link(root, outside)
    name = object_name(key(1))
    assert (root / fan / f"{name}.obj").read_bytes()  # a plain open reads outside the root
