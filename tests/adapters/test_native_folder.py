"""The native helpers' build folder when the process cannot use it (a service that drops its
privileges after start): a NativeBuildError naming the folder and HICACHE_NATIVE_DIR, never a
bare PermissionError."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from hicache.adapters.copy.native import NativeBuildError, load_helper

_NOBODY = 65534


def _build_in(folder: Path) -> str:
    """What load_helper says about ``folder``: "typed: <message>" or "<error type>: ..."."""
    try:
        load_helper(
            str,
            source="int hicache_probe;",
            stem="probe",
            abi=1,
            what="the probe helper",
            fallback="run without it",
            cache_dir=folder,
            memo=False,
        )
    except NativeBuildError as e:
        return f"typed: {e}"
    except Exception as e:  # what the test must not see
        return f"{type(e).__name__}: {e}"
    return "built"


def _as_unprivileged(folder: Path) -> str:
    """_build_in(folder) as a user the folder's mode shuts out: this process when it is not
    root, else a forked child that dropped to uid/gid 65534 (root ignores file modes)."""
    if os.geteuid() != 0:
        return _build_in(folder)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: drop privileges for good, answer through the pipe, exit
        code = 0
        try:
            os.setgroups([])
            os.setgid(_NOBODY)
            os.setuid(_NOBODY)
            os.write(write, _build_in(folder).encode()[:4000])
        except BaseException:
            code = 1
        finally:
            os._exit(code)
    os.close(write)
    with os.fdopen(read, "rb") as pipe:
        answer = pipe.read().decode()
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, answer
    return answer


@pytest.mark.parametrize("mode", [0o000, 0o500], ids=["unreadable", "read-only"])
def test_a_folder_the_process_cannot_use_is_a_typed_error_naming_it(
    tmp_path: Path, mode: int
) -> None:
    tmp_path.chmod(0o755)  # the child reaches the folder; the folder's own mode shuts it out
    folder = tmp_path / "native"
    folder.mkdir()
    folder.chmod(mode)
    try:
        answer = _as_unprivileged(folder)
    finally:
        folder.chmod(0o700)
    assert answer.startswith("typed: "), answer
    assert str(folder) in answer
    assert "HICACHE_NATIVE_DIR" in answer
