"""Closing is bounded and a process exits: child processes open a backend, use it, close it
(or leave it open) and exit, some with a store call hanging in flight; each must exit."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integrations.sglang.support import require_sglang

require_sglang()

pytestmark = pytest.mark.sglang

ROOT = Path(__file__).resolve().parents[3]
MODES = ["clean", "hang-close", "hang-exit"] * 2  # 6 children, run at once
# Per child: its imports (torch, SGLang) plus deadline + grace (0.4 s) for a hung call; the
# bound is loose for a loaded machine, a hang would wait forever.
CHILD_BOUND_S = 45.0


def test_children_that_open_use_and_close_a_backend_all_exit(tmp_path: Path) -> None:
    env = dict(os.environ, PYTHONPATH=f"{ROOT / 'src'}{os.pathsep}{ROOT}")
    children = []
    for i, mode in enumerate(MODES):
        cmd = [
            sys.executable,
            "-m",
            "tests.integrations.sglang.exit_child",
            str(tmp_path / str(i)),
            mode,
        ]
        children.append(
            (
                mode,
                subprocess.Popen(
                    cmd,
                    cwd=ROOT,
                    env=env,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    text=True,
                ),
            )
        )
    hung = []
    for mode, child in children:
        try:
            out, err = child.communicate(timeout=CHILD_BOUND_S)
        except subprocess.TimeoutExpired:
            child.kill()
            child.communicate()
            hung.append(mode)
            continue
        assert child.returncode == 0, (mode, err[-2000:])
        assert "done" in out
    assert not hung, f"children that did not exit within {CHILD_BOUND_S} s: {hung}"
