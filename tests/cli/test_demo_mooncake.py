"""`hicache demo --storage mooncake`: Mooncake's own log lines stay out of the progress output
(they go to --log-file), and show among it with --verbose."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.storage.mooncake_support import require_mooncake

require_mooncake()

pytestmark = [pytest.mark.mooncake, pytest.mark.slow, pytest.mark.timeout(300)]
SRC = Path(__file__).resolve().parents[2] / "src"
GLOG = re.compile(r"^[IWEF]\d{4} \d\d:\d\d:\d\d", re.M)
TINY = ["--prefix-tokens", "128", "--turns", "1", "--storage", "mooncake"]


def _demo(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "hicache", "demo", *TINY, *args],
        env={"PYTHONPATH": str(SRC), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=280,
        check=False,
    )


def test_mooncake_log_lines_go_to_the_log_file_not_the_progress(tmp_path: Path) -> None:
    log = tmp_path / "demo.log"
    done = _demo("--log-file", str(log))
    assert done.returncode == 0, done.stderr
    assert GLOG.search(done.stderr) is None, done.stderr
    assert all(line.startswith("hicache demo: ") for line in done.stderr.splitlines())
    assert f"went to {log}" in done.stderr
    assert GLOG.search(log.read_text()) is not None  # Mooncake's client did log: kept there


def test_verbose_shows_them_among_the_progress() -> None:
    done = _demo("--verbose")
    assert done.returncode == 0, done.stderr
    assert GLOG.search(done.stderr) is not None
    assert "went to" not in done.stderr
