"""Run Python code in a fresh process and SIGKILL it mid-work (crash-consistency tests).

- kill_after_first_line(code, args, ready, delay, stderr=None): start ``python -c code args``
  with this process's import path, wait for its first stdout line (whose first word must be
  ``ready``), sleep ``delay``, SIGKILL it, reap it, and return that line's words after ``ready``;
  the child must not write to stdout after that line.
- dead_pid(): the pid of a process that has exited and been reaped.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

REPO = Path(__file__).parents[1]


def kill_after_first_line(
    code: str, args: list[str], ready: str, delay: float, *, stderr: int | None = None
) -> list[str]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    proc = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(code), *args],
        stdout=subprocess.PIPE,
        stderr=stderr,
        text=True,
        env=env,
        cwd=REPO,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline().split()
        assert line[:1] == [ready], line
        time.sleep(delay)
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()
    assert proc.returncode == -signal.SIGKILL
    return line[1:]


def dead_pid() -> int:
    """The pid of a process that has exited and been reaped."""
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid
