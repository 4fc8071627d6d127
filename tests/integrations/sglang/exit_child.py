"""A child process of test_exit: open a backend through SGLang's factory (or over a store whose
get hangs), use it, close it (or not) and exit. argv: store_dir mode ("clean", "hang-close",
"hang-exit")."""

from __future__ import annotations

import sys
import threading
from collections.abc import Sequence
from typing import Any

from tests.integrations.sglang.support import PROBLEM

assert PROBLEM is None, PROBLEM

from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory  # noqa: E402

from hicache.adapters.storage.delegating import DelegatingStore  # noqa: E402
from hicache.adapters.storage.directory import DirectorySettings, DirectoryStore  # noqa: E402
from hicache.domain.storage import PageBuffer, StoreKey, StoreStatus  # noqa: E402
from hicache.integrations.sglang import HiCacheBackend  # noqa: E402
from tests.integrations.sglang.conftest import extra, storage_config  # noqa: E402
from tests.integrations.sglang.pools import fill_page, keys, mha_pool, tokens  # noqa: E402


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


def main(root: str, mode: str) -> None:
    pool = mha_pool("page_first")
    more: dict[str, Any] = {"deadline_s": 0.2, "grace_s": 0.2}
    if mode == "clean":
        cfg = storage_config(extra(root, **more))
        backend = StorageBackendFactory.create_backend("dynamic", cfg, pool)
    else:
        store = Hanging(DirectoryStore(DirectorySettings(root=root)))
        backend = HiCacheBackend(storage_config(extra(None, **more)), {"store": store})
    backend.register_mem_pool_host(pool)
    fill_page(pool, 0, 1)
    assert backend.batch_set_v1(keys(1), tokens(pool, 0, 1)) == [True]
    got = backend.batch_get_v1(keys(1), tokens(pool, 4, 1))
    assert got == ([True] if mode == "clean" else [False]), got
    if mode != "hang-exit":
        backend.close()
    print("done", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
