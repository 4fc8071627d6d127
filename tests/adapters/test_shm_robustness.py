"""Shared memory under hostile conditions: forked children, planted files, stop signals."""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from hicache.adapters.host_memory import ShmRegion, gc_segments, list_segments
from tests.adapters.conftest import PAGE, SHM_DIR, python_command
from tests.child_process import dead_pid


def _start(code: str) -> tuple[subprocess.Popen[str], list[str]]:
    """Start ``code`` in a fresh interpreter; return it and the first line it prints, split."""
    proc = subprocess.Popen(
        python_command(code), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None
    line = proc.stdout.readline().split()
    if not line:
        proc.kill()
        _, err = proc.communicate()
        pytest.fail(f"the owner printed nothing: {err}")
    return proc, line


def _gc_in_a_subprocess(timeout: float = 20) -> list[str]:
    """gc_segments() in a fresh process, so a hang becomes a test failure, not a stuck suite."""
    code = "from hicache.adapters.host_memory import gc_segments; print(*gc_segments())"
    try:
        proc = subprocess.run(
            python_command(code), capture_output=True, text=True, timeout=timeout, check=False
        )
    except subprocess.TimeoutExpired:
        pytest.fail("gc_segments() hung")
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.split()


# --- forked children ----------------------------------------------------------------------------

FORK_THEN_SLEEP = """
import os, time
from hicache.adapters.host_memory import ShmRegion
region = ShmRegion.create(8192)
child = os.fork()
if child == 0:
    time.sleep(60)  # an unrelated worker, forked after the segment was made
    os._exit(0)
print(region.name, child, flush=True)
time.sleep(60)
"""


def test_gc_removes_a_killed_owners_segment_while_a_forked_child_lives(
    shm_cleanup: list[str],
) -> None:
    proc, (name, child) = _start(FORK_THEN_SLEEP)
    shm_cleanup.append(name)
    try:
        proc.kill()
        proc.wait()
        assert Path(f"/proc/{child}").exists()  # the child outlives its parent
        assert name in gc_segments()
        assert not (SHM_DIR / name).exists()
    finally:
        os.kill(int(child), signal.SIGKILL)


# --- planted files ------------------------------------------------------------------------------


def test_gc_never_opens_a_fifo_named_like_a_segment(shm_cleanup: list[str]) -> None:
    name = f"hicache-{dead_pid()}-{secrets.token_hex(8)}"
    shm_cleanup.append(name)
    os.mkfifo(SHM_DIR / name, 0o600)
    assert name not in {s.name for s in list_segments()}
    assert name not in _gc_in_a_subprocess()
    assert (SHM_DIR / name).exists()


def test_a_fifo_named_like_a_segment_does_not_block_segment_creation(
    shm_cleanup: list[str],
) -> None:
    name = f"hicache-{dead_pid()}-{secrets.token_hex(8)}"
    shm_cleanup.append(name)
    os.mkfifo(SHM_DIR / name, 0o600)
    code = "from hicache.adapters.host_memory import ShmRegion; ShmRegion.create(4096).close()"
    try:
        proc = subprocess.run(
            python_command(code), capture_output=True, text=True, timeout=20, check=False
        )
    except subprocess.TimeoutExpired:
        pytest.fail("creating a segment hung on a planted FIFO")
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize("digits", [8, 15, 17, 32])
def test_names_that_only_look_like_segments_are_never_removed(
    digits: int, shm_cleanup: list[str]
) -> None:
    name = f"hicache-{dead_pid()}-{secrets.token_hex(32)[:digits]}"
    shm_cleanup.append(name)
    fd = os.open(SHM_DIR / name, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    os.close(fd)
    assert name not in {s.name for s in list_segments()}
    assert name not in gc_segments()
    assert (SHM_DIR / name).exists()


def test_a_symlink_named_like_a_segment_is_neither_listed_nor_followed(
    shm_cleanup: list[str], tmp_path: Path
) -> None:
    target = tmp_path / "precious"
    target.write_bytes(b"x" * 10)
    name = f"hicache-{dead_pid()}-{secrets.token_hex(8)}"
    shm_cleanup.append(name)
    os.symlink(target, SHM_DIR / name)
    assert name not in {s.name for s in list_segments()}
    assert name not in gc_segments()
    assert target.read_bytes() == b"x" * 10


# --- stop signals -------------------------------------------------------------------------------

OWNER = """
import signal, sys, time
from hicache.adapters.host_memory import ShmRegion
{before}
region = ShmRegion.create(8192)
print(region.name, flush=True)
for _ in range(600):
    time.sleep(0.1)
print("still running", flush=True)
"""


def _signal_owner(before: str, signum: int, shm_cleanup: list[str]) -> tuple[str, int, str]:
    proc, (name,) = _start(OWNER.format(before=before))
    shm_cleanup.append(name)
    assert (SHM_DIR / name).exists()
    proc.send_signal(signum)
    try:
        out, err = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
    return name, proc.returncode, out + err


def test_an_owner_stopped_with_sigterm_removes_its_segments(shm_cleanup: list[str]) -> None:
    name, rc, _ = _signal_owner("", signal.SIGTERM, shm_cleanup)
    assert rc == -signal.SIGTERM  # the default action still ends the process
    assert not (SHM_DIR / name).exists()


def test_an_owner_interrupted_with_sigint_removes_its_segments(shm_cleanup: list[str]) -> None:
    name, rc, out = _signal_owner("", signal.SIGINT, shm_cleanup)
    assert "KeyboardInterrupt" in out  # Python's own SIGINT behaviour is kept
    assert rc != 0
    assert not (SHM_DIR / name).exists()


def test_the_applications_own_sigterm_handler_still_runs(shm_cleanup: list[str]) -> None:
    before = (
        "def handler(signum, frame):\n"
        "    print('app handler', signum, flush=True)\n"
        "    sys.exit(3)\n"
        "signal.signal(signal.SIGTERM, handler)"
    )
    name, rc, out = _signal_owner(before, signal.SIGTERM, shm_cleanup)
    assert f"app handler {int(signal.SIGTERM)}" in out
    assert rc == 3
    assert not (SHM_DIR / name).exists()


def test_segments_are_gone_while_the_applications_handler_runs(shm_cleanup: list[str]) -> None:
    # A handler that keeps the process running (a graceful drain): the segment is unlinked as
    # soon as the signal arrives, before the process decides when to exit.
    before = (
        "import os\n"
        "def handler(signum, frame):\n"
        "    print('exists', os.path.exists('/dev/shm/' + region.name), flush=True)\n"
        "    sys.exit(0)\n"
        "signal.signal(signal.SIGTERM, handler)"
    )
    _, rc, out = _signal_owner(before, signal.SIGTERM, shm_cleanup)
    assert "exists False" in out
    assert rc == 0


def test_an_ignored_sigterm_removes_nothing(shm_cleanup: list[str]) -> None:
    proc, (name,) = _start(OWNER.format(before="signal.signal(signal.SIGTERM, signal.SIG_IGN)"))
    shm_cleanup.append(name)
    try:
        proc.send_signal(signal.SIGTERM)
        with pytest.raises(subprocess.TimeoutExpired):
            proc.wait(timeout=1)
        assert (SHM_DIR / name).exists()
    finally:
        proc.kill()
        proc.communicate()


def test_signal_hooks_are_installed_once_and_chain_to_what_was_there() -> None:
    if sys.platform != "linux":  # pragma: no cover
        pytest.skip("Linux only")
    region = ShmRegion.create(PAGE)
    try:
        first = signal.getsignal(signal.SIGTERM)
        ShmRegion.create(PAGE).close()
        assert signal.getsignal(signal.SIGTERM) is first
    finally:
        region.close()
