"""Native libraries' stderr lines (Mooncake's glog) go to a log file, apart from the progress
(hicache.cli._logs.NativeStderrToFile); Python's own stderr stays on the terminal."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from hicache.cli import main
from hicache.cli._logs import NativeStderrToFile
from hicache.domain import ConfigError

SRC = Path(__file__).resolve().parents[2] / "src"

CHILD = """
import os, sys
from pathlib import Path
from hicache.cli._logs import NativeStderrToFile
sys.stderr.write("before\\n")
with NativeStderrToFile(Path(sys.argv[1])) as native:
    os.write(2, b"E1203 16:00:00.1 1 transfer_metadata.cpp:1098] Local segment descriptor not found\\n")
    sys.stderr.write("progress\\n")
    sys.stderr.flush()
print("written" if native.lines_written() else "nothing")
os.write(2, b"after\\n")
"""


def _run(tmp_path: Path) -> tuple[subprocess.CompletedProcess[str], Path]:
    log = tmp_path / "native.log"
    done = subprocess.run(
        [sys.executable, "-c", CHILD, str(log)],
        env={"PYTHONPATH": str(SRC), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return done, log


def test_native_lines_go_to_the_file_and_progress_stays_on_stderr(tmp_path: Path) -> None:
    done, log = _run(tmp_path)
    assert done.stderr.splitlines() == ["before", "progress", "after"]
    assert "Local segment descriptor not found" in log.read_text()
    assert done.stdout.strip() == "written"


def test_the_file_is_appended_and_only_new_lines_count(tmp_path: Path) -> None:
    log = tmp_path / "native.log"
    log.write_text("old run\n")
    _run(tmp_path)
    text = log.read_text()
    assert text.startswith("old run\n")
    assert text.count("Local segment descriptor not found") == 1


def test_a_log_file_that_cannot_be_written_is_a_one_line_usage_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "no-such-folder" / "demo.log"
    with pytest.raises(ConfigError, match="cannot write the log file"):
        NativeStderrToFile(bad).__enter__()
    assert main(["demo", "--storage", "none", "--log-file", str(bad)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert "cannot write the log file" in err
