"""Adapter test helpers: no test may leave a /dev/shm/hicache-* segment behind.

- _no_leaked_segments (autouse): fails a test that leaves a segment owned by this process,
  after removing it.
- shm_cleanup: a list; names appended to it (segments made by subprocesses) are removed at
  teardown whatever happened.
- run_python: run a snippet in a fresh interpreter (sys.executable) and return the process.
- rss_bytes / resident_pages: the process's resident memory, read from /proc.
"""

from __future__ import annotations

import contextlib
import os
import struct
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

SHM_DIR = Path("/dev/shm")
PAGE = os.sysconf("SC_PAGE_SIZE")


def own_segments() -> set[str]:
    prefix = f"hicache-{os.getpid()}-"
    if not SHM_DIR.is_dir():
        return set()
    return {p.name for p in SHM_DIR.iterdir() if p.name.startswith(prefix)}


@pytest.fixture(autouse=True)
def _no_leaked_segments() -> Iterator[None]:
    before = own_segments()
    yield
    leaked = sorted(own_segments() - before)
    for name in leaked:
        with contextlib.suppress(FileNotFoundError):
            (SHM_DIR / name).unlink()
    if leaked:
        pytest.fail(f"the test left shared-memory segments behind: {leaked}")


@pytest.fixture
def shm_cleanup() -> Iterator[list[str]]:
    names: list[str] = []
    yield names
    for name in names:
        with contextlib.suppress(FileNotFoundError):
            (SHM_DIR / name).unlink()


def python_command(code: str) -> list[str]:
    return [sys.executable, "-c", textwrap.dedent(code)]


def run_python(code: str, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*python_command(code), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def rss_bytes(field: str = "RssAnon") -> int:
    """One of RssAnon, RssShmem, RssFile from /proc/self/status, in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no {field} in /proc/self/status")


def resident_pages(address: int, nbytes: int) -> tuple[int, int]:
    """(pages present in memory, pages in the range) for [address, address + nbytes)."""
    first = address // PAGE
    count = (address + nbytes + PAGE - 1) // PAGE - first
    with open("/proc/self/pagemap", "rb") as f:
        f.seek(first * 8)
        entries = struct.unpack(f"{count}Q", f.read(count * 8))
    return sum(e >> 63 for e in entries), count
