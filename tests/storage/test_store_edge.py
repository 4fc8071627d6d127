"""The store port's edge: wrong types and invalid numbers are ConfigErrors naming the argument,
and a store object that is not a regular file never blocks a reader.

- A FIFO (or another non-regular file) where an object file should be is a miss at once: the
  reader opens it non-blocking and checks it with fstat before reading (before: it blocked
  forever in open()).
- Store-port calls with keys that are not StoreKeys, buffers that are not sequences of
  memoryviews, non-finite or non-number deadlines: ConfigError naming the argument.
- DirectorySettings: a root with a NUL byte, fractional or NaN capacities, NaN time-outs.
"""

from __future__ import annotations

import math
import os
import threading
from pathlib import Path

import pytest

from hicache.adapters.storage import DirectorySettings, DirectoryStore, object_name
from hicache.domain import ConfigError
from hicache.domain.storage import StoreStatus
from tests.storage.conftest import empty, key, page


def _within(seconds: float, func: object) -> object:
    """``func()`` in a daemon thread; the test fails (instead of hanging) past ``seconds``."""
    out: dict[str, object] = {}
    thread = threading.Thread(target=lambda: out.setdefault("r", func()), daemon=True)  # type: ignore[operator]
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), "the store call blocked"
    return out["r"]


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs here")
def test_a_fifo_in_place_of_an_object_file_is_a_miss_not_a_hang(tmp_path: Path) -> None:
    store = DirectoryStore(DirectorySettings(root=tmp_path))
    k, other = key(1), key(2)
    assert store.put([k], [page(4096)]) == [StoreStatus.OK]
    name = object_name(k)
    path = tmp_path / name[:2] / f"{name}.obj"
    path.unlink()
    os.mkfifo(path)  # another process put a FIFO where the object was
    got = _within(10, lambda: store.get([k], [empty(4096)]))
    assert got == [StoreStatus.MISS]
    oname = object_name(other)
    (tmp_path / oname[:2]).mkdir(exist_ok=True)
    os.mkfifo(tmp_path / oname[:2] / f"{oname}.obj")  # a name the store never wrote
    assert _within(10, lambda: store.get([other], [empty(4096)])) == [StoreStatus.MISS]
    store.close()
    reopened = DirectoryStore(DirectorySettings(root=tmp_path))  # the scan skips FIFOs
    assert _within(10, lambda: reopened.get([other], [empty(4096)])) == [StoreStatus.MISS]
    reopened.close()


BAD_CALLS = [
    ("get keys None", lambda s: s.get(None, [page(8)]), "store keys must be a sequence"),
    ("get key text", lambda s: s.get(["k"], [page(8)]), r"store keys\[0\] must be a StoreKey"),
    ("get buffer bytes", lambda s: s.get([key(1)], [b"abc"]), r"store buffers\[0\] must be"),
    ("get buffer None", lambda s: s.get([key(1)], [None]), r"store buffers\[0\] must be"),
    ("get segment int", lambda s: s.get([key(1)], [[5]]), r"store buffers\[0\] holds int"),
    ("get buffers None", lambda s: s.get([key(1)], None), "store buffers must be"),
    ("put key text", lambda s: s.put(["k"], [page(8)]), r"store keys\[0\] must be a StoreKey"),
    ("put buffer int", lambda s: s.put([key(1)], [5]), r"store buffers\[0\] must be"),
    ("exists None", lambda s: s.exists(None), "store keys must be a sequence"),
    ("exists text", lambda s: s.exists("key"), "store keys must be a sequence"),
    ("remove text keys", lambda s: s.remove(["k"]), r"store keys\[0\] must be a StoreKey"),
    ("deadline NaN", lambda s: s.get([key(1)], [page(8)], deadline=math.nan), "deadline"),
    ("deadline text", lambda s: s.exists([key(1)], deadline="soon"), "deadline"),
    ("deadline inf", lambda s: s.put([key(1)], [page(8)], deadline=math.inf), "deadline"),
]


@pytest.mark.parametrize(("name", "call", "match"), BAD_CALLS, ids=[c[0] for c in BAD_CALLS])
def test_store_port_calls_with_wrong_types_are_config_errors(
    tmp_path: Path, name: str, call: object, match: str
) -> None:
    store = DirectoryStore(DirectorySettings(root=tmp_path))
    with pytest.raises(ConfigError, match=match):
        call(store)  # type: ignore[operator]
    assert len(store) == 0
    store.close()


@pytest.mark.parametrize(
    ("field", "value", "match"),
    [
        ("root", "/tmp/a\x00b", "NUL byte"),
        ("capacity_bytes", 1.5, "whole number of bytes"),
        ("capacity_bytes", math.nan, "whole number of bytes"),
        ("capacity_bytes", True, "whole number of bytes"),
        ("capacity_bytes", 2**70, "whole number of bytes"),
        ("timeout_s", math.nan, "timeout_s must be a finite number of seconds > 0"),
        ("timeout_s", math.inf, "timeout_s must be a finite number of seconds > 0"),
        ("timeout_s", 1e308, r"at most 1e\+06, got 1e\+308"),
        ("timeout_s", 10**400, "at most 1e\\+06, got an integer of about 401 digits"),
        ("timeout_s", 0, "timeout_s must be a number of seconds > 0, got 0"),
        ("stale_tmp_s", math.nan, "finite number of seconds >= 0"),
        ("stale_tmp_s", 1e6 + 1, r"at most 1e\+06"),
        ("stale_tmp_s", -1, "stale_tmp_s must be a number of seconds >= 0, got -1"),
        ("read_threads", 0, r"read_threads must be a whole number in \[1, 64\], got 0"),
        ("read_threads", 65, "whole number in"),
        ("write_threads", 2.0, "write_threads must be a whole number in"),
        ("write_threads", True, "whole number in"),
    ],
)
def test_directory_settings_refuse_invalid_numbers_and_paths(
    field: str, value: object, match: str
) -> None:
    with pytest.raises(ConfigError, match=match):
        DirectorySettings(**{field: value})  # type: ignore[arg-type]
