"""`hicache shm list` and `hicache shm gc`: the JSON faces through a real subprocess.

Each test works in a private segment directory ($HICACHE_SHM_DIR, a fresh tmpfs directory under
/dev/shm): in the shared /dev/shm, any other process's first segment creation garbage-collects
dead owners' segments, the test's planted one included, at any moment.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from hicache.cli import main


@pytest.fixture(autouse=True)
def _private_shm_dir(shm_dir: Path) -> Path:
    """Every test here gets its own segment directory (tests/conftest.py's shm_dir)."""
    return shm_dir


def hicache(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "hicache", *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


@pytest.fixture
def segments(shm_dir: Path) -> Iterator[tuple[str, str]]:
    """(a live segment owned by this process, a segment whose owner is dead)."""
    from hicache.adapters.host_memory import ShmRegion

    live = ShmRegion.create(8192)
    assert live.path.parent == shm_dir
    dead = f"hicache-{dead_pid()}-{secrets.token_hex(8)}"
    fd = os.open(shm_dir / dead, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    os.ftruncate(fd, 12288)
    os.close(fd)
    try:
        yield live.name, dead
    finally:
        live.close()


def test_shm_list_json_shows_owner_liveness_and_size(segments: tuple[str, str]) -> None:
    live, dead = segments
    proc = hicache("shm", "list", "--json")
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert set(doc) == {"segments"}
    by_name = {s["name"]: s for s in doc["segments"]}
    assert by_name[live] == {"name": live, "owner_pid": os.getpid(), "alive": True, "size": 8192}
    assert by_name[dead]["alive"] is False
    assert by_name[dead]["size"] == 12288
    assert by_name[dead]["owner_pid"] == int(dead.split("-")[1])


def test_shm_gc_removes_dead_owners_segments_only(segments: tuple[str, str], shm_dir: Path) -> None:
    live, dead = segments
    proc = hicache("shm", "gc", "--json")
    assert proc.returncode == 0, proc.stderr
    removed = json.loads(proc.stdout)["removed"]
    assert dead in removed
    assert live not in removed
    assert not (shm_dir / dead).exists()
    assert (shm_dir / live).exists()


def test_shm_list_and_gc_print_a_readable_summary(
    segments: tuple[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    live, dead = segments
    assert main(["shm", "list"]) == 0
    out = capsys.readouterr().out
    live_line = next(line for line in out.splitlines() if line.startswith(live))
    dead_line = next(line for line in out.splitlines() if line.startswith(dead))
    assert f" {os.getpid()} " in live_line
    assert " alive " in live_line
    assert "8192" in live_line
    assert " dead " in dead_line
    assert "12288" in dead_line
    assert "hicache shm gc" in out
    assert main(["shm", "gc"]) == 0
    assert f"removed {dead}" in capsys.readouterr().out


def test_shm_without_a_subcommand_is_a_usage_error() -> None:
    proc = hicache("shm")
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr


def test_shm_dir_must_be_absolute(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HICACHE_SHM_DIR", "relative/dir")
    proc = hicache("shm", "list")
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "hicache: error: HICACHE_SHM_DIR must be an absolute path, got 'relative/dir'"
    ]
