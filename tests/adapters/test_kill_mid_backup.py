"""SIGKILL of a process in the middle of a backup into shared host memory.

A child process opens a real runtime (CPU device, the real copy backend, host pools in shm
segments) and backs up its device pages over and over; its copy announces itself on stdout each
time it starts. The parent kills the child with SIGKILL as soon as a copy has started. Then the
child's segments are listed as dead, `hicache shm gc` removes every one of them, and nothing is
left in the segment directory: nothing leaks, even though the owner died mid-copy. The test runs
in a private segment directory ($HICACHE_SHM_DIR) so no other process's gc interferes.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(120)

CHILD = textwrap.dedent(
    """
    import sys, anyio
    from hicache.bootstrap import load_model_spec
    from hicache.bootstrap.runtime import open_runtime
    from hicache.domain import PlanSettings, plan_stack

    async def main():
        spec = load_model_spec("llama-3.1-8b-instruct")
        plan = plan_stack(spec, PlanSettings(device_tokens=2048, storage="shm", pinned="off"))
        async with open_runtime(plan, device="cpu", name="victim") as rt:
            real = rt.transfer.backup

            def announced(maps):
                print("COPYING", flush=True)
                for _ in range(200):  # a long copy, so the kill lands inside it
                    real(maps)
                return real(maps)

            rt.transfer.backup = announced
            pages = rt.device_slots.allocate({"kv": rt.device_slots.allocator("kv").pages})
            while True:
                handle = await rt.engine.backup(pages.pages)
                await handle.wait()
                rt.engine.free_host(handle.host_pages)

    anyio.run(main)
    """
)


def _hicache(*args: str) -> dict:
    proc = subprocess.run(
        [sys.executable, "-m", "hicache", *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def test_sigkill_mid_backup_leaves_only_dead_segments_that_gc_removes(shm_dir: Path) -> None:
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout is not None
        seen = []
        for line in child.stdout:
            seen.append(line)
            if line.startswith("COPYING"):
                break
        else:
            pytest.fail(f"the child never started a copy: {seen} {child.stderr.read()[-2000:]}")
        child.send_signal(signal.SIGKILL)
        assert child.wait(timeout=30) == -signal.SIGKILL
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    segments = _hicache("shm", "list", "--json")["segments"]
    assert segments, "the killed owner's segments should outlive it until gc"
    assert {s["owner_pid"] for s in segments} == {child.pid}
    assert not any(s["alive"] for s in segments)
    removed = _hicache("shm", "gc", "--json")["removed"]
    assert sorted(removed) == sorted(s["name"] for s in segments)
    assert _hicache("shm", "list", "--json")["segments"] == []
    assert os.listdir(shm_dir) == []
