"""Shared-memory segments are private to their user: mode 0600, names nobody can guess, and
another user can neither open, attach to nor remove them (checked as root with a child that
drops to the unprivileged "nobody" uid; skipped when the tests do not run as root)."""

from __future__ import annotations

import os
import re
import stat
from collections.abc import Callable, Iterator

import pytest

from hicache.adapters.host_memory import ShmRegion

NOBODY = 65534


@pytest.fixture
def owner() -> Iterator[ShmRegion]:
    region = ShmRegion.create(4096)
    try:
        yield region
    finally:
        region.close()


def test_segments_are_0600_and_named_with_64_random_bits(owner: ShmRegion) -> None:
    st = os.stat(owner.path)
    assert stat.S_IMODE(st.st_mode) == 0o600
    assert st.st_uid == os.getuid()
    others = [ShmRegion.create(4096) for _ in range(16)]
    try:
        suffixes = {r.name.rsplit("-", 1)[1] for r in [owner, *others]}
    finally:
        for r in others:
            r.close()
    assert len(suffixes) == 17  # no two alike: 16 hex digits from secrets.token_hex(8)
    assert all(re.fullmatch(r"[0-9a-f]{16}", s) for s in suffixes)


def _allowed(fn: Callable[[], object]) -> int:
    try:
        fn()
    except PermissionError:
        return 0
    return 1


def _as_nobody(path: str) -> list[str]:
    """Fork a child that drops to uid/gid nobody and tries to open and remove ``path``.

    The child only makes system calls and leaves with os._exit (no exec: the interpreter of the
    test environment need not be readable by nobody); the outcome travels in the exit status.
    """
    attempts = (
        ("open read-write", lambda: os.close(os.open(path, os.O_RDWR))),
        ("open read-only", lambda: os.close(os.open(path, os.O_RDONLY))),
        ("unlink", lambda: os.unlink(path)),
    )
    pid = os.fork()
    if pid == 0:  # pragma: no cover - runs in the child
        code = 0
        try:
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            for bit, (_, fn) in enumerate(attempts):
                code |= _allowed(fn) << bit
        except BaseException:
            code = 64
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    code = os.waitstatus_to_exitcode(status)
    assert code != 64, "the child could not drop to nobody"
    return [
        f"{what}: {'ALLOWED' if code >> bit & 1 else 'refused'}"
        for bit, (what, _) in enumerate(attempts)
    ]


needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to become another user")


@needs_root
def test_another_user_can_neither_open_nor_remove_a_segment(owner: ShmRegion) -> None:
    assert _as_nobody(str(owner.path)) == [
        "open read-write: refused",
        "open read-only: refused",
        "unlink: refused",
    ]
    assert owner.path.exists()


@needs_root
def test_the_broken_case_is_caught_a_world_readable_segment_is_opened(owner: ShmRegion) -> None:
    """The check above can fail: with the mode widened, another user could open the segment."""
    os.chmod(owner.path, 0o666)
    try:
        outcome = _as_nobody(str(owner.path))
    finally:
        os.chmod(owner.path, 0o600)
    assert outcome[:2] == ["open read-write: ALLOWED", "open read-only: ALLOWED"]
