"""The child processes of test_exit: imports torch and SGLang once, then forks one child per
mode in argv[2:] ("clean", "hang-close", "hang-exit"), a few at a time. Each child opens a
backend (through SGLang's factory, or over a store whose get never returns), uses it, closes it
(exit status 5 when close took longer than deadline + grace + CLOSE_SLACK_S) or leaves it open, and leaves by the interpreter's normal exit (threads joined, atexit run).
Prints one JSON line per child: mode, exit status and seconds from fork to exit (None: killed
after the bound argv[1]). Run as ``python -m tests.integrations.sglang.exit_children BOUND DIR
MODE...``."""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any

from tests.integrations.sglang.support import PROBLEM

if PROBLEM is not None:
    raise SystemExit(PROBLEM)

from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

from hicache.adapters.storage.delegating import DelegatingStore
from hicache.adapters.storage.directory import DirectorySettings, DirectoryStore
from hicache.domain.storage import PageBuffer, StoreKey, StoreStatus
from hicache.integrations.sglang import HiCacheBackend
from tests.integrations.sglang.conftest import extra, storage_config
from tests.integrations.sglang.pools import fill_page, keys, mha_pool, tokens

DEADLINE_S = 0.2
GRACE_S = 0.2
CLOSE_SLACK_S = 1.0  # a loaded machine's scheduling delay


class Hanging(DelegatingStore):
    """A store whose get never returns (ignores its deadline)."""

    def get(
        self,
        keys: Sequence[StoreKey],
        buffers: Sequence[PageBuffer],
        *,
        deadline: float | None = None,
    ) -> list[StoreStatus]:
        threading.Event().wait()
        return []


def child(root: str, mode: str) -> None:
    pool = mha_pool("page_first")
    more: dict[str, Any] = {"deadline_s": DEADLINE_S, "grace_s": GRACE_S}
    if mode == "clean":
        cfg = storage_config(extra(root, **more))
        backend = StorageBackendFactory.create_backend("dynamic", cfg, pool)
    else:
        store = Hanging(DirectoryStore(DirectorySettings(root=root)))
        backend = HiCacheBackend(storage_config(extra(None, **more)), {"store": store})
    backend.register_mem_pool_host(pool)
    fill_page(pool, 0, 1)
    if backend.batch_set_v1(keys(1), tokens(pool, 0, 1)) != [True]:
        raise SystemExit(3)
    got = backend.batch_get_v1(keys(1), tokens(pool, 4, 1))
    if got != ([True] if mode == "clean" else [False]):
        raise SystemExit(4)
    if mode != "hang-exit":
        start = time.monotonic()
        backend.close()
        if time.monotonic() - start > DEADLINE_S + GRACE_S + CLOSE_SLACK_S:
            raise SystemExit(5)


def spawn(bound_s: float, root: str, modes: list[str], wave: int = 5) -> bool:
    """Fork the children, ``wave`` at a time; True in a child (which has run ``child``)."""
    for first in range(0, len(modes), wave):
        running: dict[int, tuple[str, float]] = {}
        for i in range(first, min(first + wave, len(modes))):
            pid = os.fork()
            if pid == 0:
                child(os.path.join(root, str(i)), modes[i])
                return True
            running[pid] = (modes[i], time.monotonic())
        for pid, (mode, start) in running.items():
            seconds: float | None = None
            status = 0
            while time.monotonic() - start < bound_s:
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    seconds = time.monotonic() - start
                    break
                time.sleep(0.01)
            code: int | None = None
            if seconds is None:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
            else:
                code = os.waitstatus_to_exitcode(status)
            print(json.dumps({"mode": mode, "exit": code, "seconds": seconds}), flush=True)
    return False


if __name__ == "__main__":
    spawn(float(sys.argv[1]), sys.argv[2], sys.argv[3:])
    # A child falls through to here as well: the interpreter's normal exit.
