"""scripts/setup is quiet unless a step fails: pip's output goes to $VENV/setup.log, and is
printed when pip fails. Run against a fake interpreter (no venv, no download): the fake pip
prints the warnings a torch install prints, and fails when told to."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
WARNING = "WARNING: Location '/wheels/x' is ignored: it is neither a file nor a directory."

# The fake venv's python: "import ..." fails (nothing installed), "-m pip" prints pip's warning
# nine times, and fails when $FAKE_PIP_FAIL names a word of its arguments.
FAKE_VENV_PYTHON = f"""#!/usr/bin/env bash
if [ "$1" = "-c" ]; then exit 1; fi
if [ "$1" = "-m" ] && [ "$2" = "pip" ]; then
  for i in 1 2 3 4 5 6 7 8 9; do echo "{WARNING}" >&2; done
  echo "Successfully installed things"
  if [ -n "${{FAKE_PIP_FAIL:-}}" ] && [[ " $* " == *"$FAKE_PIP_FAIL"* ]]; then
    echo "ERROR: No matching distribution found for $FAKE_PIP_FAIL" >&2
    exit 1
  fi
  exit 0
fi
exit 2
"""
FAKE_PYTHON = f"""#!/usr/bin/env bash
# python3 -m venv DIR
mkdir -p "$3/bin"
cat >"$3/bin/python" <<'INNER'
{FAKE_VENV_PYTHON}INNER
chmod +x "$3/bin/python"
"""


def _setup(tmp_path: Path, **env: str) -> subprocess.CompletedProcess[str]:
    fake = tmp_path / "python3"
    fake.write_text(FAKE_PYTHON)
    fake.chmod(0o755)
    full = {
        "PATH": "/usr/bin:/bin",
        "HOME": str(tmp_path),
        "PYTHON": str(fake),
        "HICACHE_VENV": str(tmp_path / "venv"),
        "HICACHE_MOONCAKE": "off",
        "HICACHE_ENGINES": "off",
        "HICACHE_TORCH": "torch==2.13.0",
        **env,
    }
    return subprocess.run(
        ["bash", str(ROOT / "scripts" / "setup")],
        env=full,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


@pytest.mark.skipif(os.name != "posix", reason="scripts/setup is a bash script")
def test_a_successful_setup_prints_only_its_own_progress(tmp_path: Path) -> None:
    done = _setup(tmp_path)
    assert done.returncode == 0, done.stderr
    lines = done.stderr.splitlines()
    assert lines, "setup says what it installs"
    assert all(line.startswith("setup: ") for line in lines), lines
    assert "is ignored" not in done.stderr + done.stdout
    log = (tmp_path / "venv" / "setup.log").read_text()
    assert log.count(WARNING) == 18  # torch and hicache: kept, out of sight
    assert (tmp_path / "venv" / ".hicache-setup").exists()


@pytest.mark.skipif(os.name != "posix", reason="scripts/setup is a bash script")
def test_a_failing_pip_step_prints_its_output_and_fails(tmp_path: Path) -> None:
    done = _setup(tmp_path, FAKE_PIP_FAIL="torch==2.13.0")
    assert done.returncode != 0
    assert "setup: failed: pip install -q torch==2.13.0" in done.stderr
    assert "ERROR: No matching distribution found for torch==2.13.0" in done.stderr
    assert not (tmp_path / "venv" / ".hicache-setup").exists()
