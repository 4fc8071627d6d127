"""SGLang's own HiCacheController methods drive the backend: backup (``_page_backup``), the
storage-hit query (``_storage_hit_query``) and the page transfer of a prefetch
(``_page_transfer``), on both of SGLang's paths: zero-copy v1 (``interface_v1``) and the legacy
flat pages.

The controller itself cannot be constructed on a CPU machine: its ``__init__`` takes a device
KV allocator and pool, a torch.distributed tp group and an L2 transfer engine, and its
``attach_storage_backend`` creates gloo groups and reads the server's parallel state. The tests
build it with ``object.__new__`` and set exactly the attributes these methods read (the backend,
the host pool, the page size, the chosen page functions and the prefetch-sync queue); the methods
that run are SGLang's, unchanged.
"""

from __future__ import annotations

from queue import Queue
from typing import Any

import pytest

from tests.integrations.sglang.support import require_sglang

require_sglang()

from sglang.srt.managers.cache_controller import (  # noqa: E402
    HiCacheController,
    PrefetchOperation,
    StorageOperation,
)
from sglang.srt.mem_cache.utils import get_hash_str  # noqa: E402

from tests.integrations.sglang.pools import fill_page, mha_pool, page_bytes, tokens  # noqa: E402

pytestmark = pytest.mark.sglang


def controller(backend: Any, pool: Any, *, zero_copy: bool) -> Any:
    ctl = object.__new__(HiCacheController)
    ctl.storage_backend = backend
    ctl.mem_pool_host = pool
    ctl.storage_host_pool = pool
    ctl.page_size = pool.page_size
    ctl.prefetch_sync_queue = Queue()
    # What attach_storage_backend selects for a "dynamic" backend with / without interface_v1.
    if zero_copy:
        ctl.page_get_func, ctl.page_set_func = ctl._page_get_zero_copy, ctl._page_set_zero_copy
    else:
        ctl.page_get_func, ctl.page_set_func = ctl._generic_page_get, ctl._generic_page_set
    return ctl


@pytest.mark.parametrize("zero_copy", [True, False], ids=["v1", "legacy"])
@pytest.mark.parametrize("layout", ["layer_first", "page_first_direct"])
def test_backup_hit_query_and_prefetch_through_sglangs_controller(
    make_backend: Any, zero_copy: bool, layout: str
) -> None:
    pool = mha_pool(layout)
    backend = make_backend(pool, config={"interface_v1": int(zero_copy)})
    ctl = controller(backend, pool, zero_copy=zero_copy)
    ps = pool.page_size
    pages = 6
    token_ids = list(range(1000, 1000 + pages * ps))
    written = [fill_page(pool, (2 + i) * ps, i) for i in range(pages)]
    hashes = get_hash_str(token_ids, None, page_size=ps)

    backup = StorageOperation(tokens(pool, 2, pages), token_ids, hash_value=hashes)
    ctl._page_backup(backup)
    assert backup.completed_tokens == pages * ps

    # A request that shares the first 4 pages and then diverges.
    query = PrefetchOperation("req-1", token_ids[: 4 * ps] + [7] * (2 * ps))
    hit_hashes, hit_tokens = ctl._storage_hit_query(query)
    assert hit_tokens == 4 * ps
    assert hit_hashes == hashes[:4]

    query.hash_value = hit_hashes
    query.host_indices = tokens(pool, 20, 4)
    assert ctl._page_transfer(query) == 4
    assert [page_bytes(pool, (20 + i) * ps) for i in range(4)] == written[:4]
    ack = ctl.prefetch_sync_queue.get_nowait()
    assert ack.completed_tokens == 4 * ps


def test_a_failed_backup_stops_sglangs_backup_and_a_miss_ends_the_transfer(
    make_backend: Any,
) -> None:
    pool = mha_pool("page_first")
    backend = make_backend(pool)
    ctl = controller(backend, pool, zero_copy=True)
    ps = pool.page_size
    token_ids = list(range(3 * ps))
    hashes = get_hash_str(token_ids, None, page_size=ps)
    fill_page(pool, 0, 0)
    backup = StorageOperation(tokens(pool, 0, 1), token_ids[:ps], hash_value=hashes[:1])
    ctl._page_backup(backup)
    query = PrefetchOperation("req-2", token_ids)
    query.hash_value = hashes
    query.host_indices = tokens(pool, 10, 3)
    assert ctl._page_transfer(query) == 1
    backend.close()  # a closed backend: backups fail, SGLang stops at the first batch
    failed = StorageOperation(tokens(pool, 0, 1), token_ids[:ps], hash_value=hashes[1:2])
    ctl._page_backup(failed)
    assert failed.completed_tokens == 0
