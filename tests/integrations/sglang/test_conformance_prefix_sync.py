"""SGLang's CPU/Gloo test of hybrid storage prefix agreement across ranks (Mamba hit gating),
run against hicache's backend in place of ``HiCacheFile``.

Source: SGLang's ``TestHiCachePrefixSync`` ("CPU/Gloo coverage for hybrid storage prefix
agreement across ranks", ``register_cpu_ci(est_time=30, suite="base-a-test-cpu")``), read
through the search tool's code index (text without its path; it is written against a later
tree than the installed sglang 0.5.23). Two gloo ranks each query storage through SGLang's own
``HybridCacheController.prefetch_thread_func`` (``_storage_hit_query`` -> ``batch_exists_v2``
-> ``_sync_prefetch_hit_query``, whose MIN all-reduce over one restorable flag per prefix
length is what keeps a Mamba checkpoint that only one rank holds from being chosen). The
scenarios and expected page counts are SGLang's.

What was adapted, and why:
- The backend: SGLang builds a bare ``HiCacheFile`` per rank (``__new__``, suffix
  ``_rank{r}``) and touches one file per present page. Here each rank builds hicache's backend
  through SGLang's factory with ``tp_rank=r, tp_size=2`` (its own per-rank namespaces) and
  writes the present KV pages and Mamba checkpoints through ``batch_set_v2`` from real SGLang
  host pools (MHA, page size 4; SGLang's Mamba pool).
- 0.5.23's controller API: ``PrefetchOperation`` takes a ``CacheRequestHandle``; the hit
  flags come from ``pool_storage_result.restorable_prefix_pages``; the module is imported under
  hicache's torchvision stand-in (hicache.integrations.sglang.sglang_imports), as the other tests do.
- Not adapted: ``mixed_controllers`` and ``hybrid_kv_only`` (in 0.5.23 a plain
  ``HiCacheController``, or a hybrid one without trailing transfers, all-reduces one scalar
  while the other rank all-reduces a vector: the ranks cannot be mixed, and the collective
  would fail on SGLang's side, not the backend's); the legacy-dense-prefix and four-rank
  orthogonal-group cases and ``test_single_rank_metadata_contract`` call
  ``_sync_storage_hit_count``, which 0.5.23 does not have (they test the controller alone, not a
  backend); ``test_trailing_windows_follow_selected_endpoint`` tests only the controller's
  ``_sync_trailing_keys`` (no backend). Two ranks only (the four-rank run adds no backend call).
"""

from __future__ import annotations

import multiprocessing
import tempfile
import threading
import time
import traceback
from datetime import timedelta
from pathlib import Path
from queue import Queue
from typing import Any
from unittest.mock import patch

import pytest

from tests.integrations.sglang.support import require_sglang

require_sglang()

pytestmark = pytest.mark.sglang

PAGE_SIZE = 4
TOKENS = list(range(4 * PAGE_SIZE))
HASHES = [f"{page:064x}" for page in range(1, 5)]
WORKER_TIMEOUT = 240
# scenario -> (kv pages, Mamba checkpoints, terminated) per rank, and the agreed pages.
SCENARIOS: dict[str, tuple[Any, int]] = {
    "aligned": (lambda r: (4, (4,), False), 4),
    "disjoint": (lambda r: (4, (4,) if r % 2 == 0 else (3,), False), 0),
    "earlier_common": (lambda r: (4, (1, 4) if r % 2 == 0 else (1, 3), False), 1),
    "kv_bound": (lambda r: ((4, (1, 3, 4)) if r % 2 == 0 else (3, (1, 2, 4))) + (False,), 1),
    "zero_hit": (lambda r: (0 if r == 0 else 4, (4,), False), 0),
    "terminated": (lambda r: (4, (4,), r == 0), 0),
}


def _check(rank: int, scenario: str, store_root: str) -> None:
    import torch.distributed as dist
    from sglang.srt.mem_cache.base_prefix_cache import CacheRequestHandle
    from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName, PoolTransfer
    from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import (
        HybridCacheController,
        PrefetchOperation,
    )
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

    from tests.integrations.sglang.conftest import extra, storage_config
    from tests.integrations.sglang.pools import mamba_pool, mha_pool, tokens

    layout, expected = SCENARIOS[scenario]
    kv_pages, checkpoints, terminated = layout(rank)
    kv, mamba = mha_pool("page_first", page_size=PAGE_SIZE), mamba_pool()
    path = Path(store_root, f"{scenario}-rank{rank}")
    config = storage_config(extra(path), tp_rank=rank, tp_size=2)
    backend = StorageBackendFactory.create_backend("dynamic", config, kv)
    try:
        backend.register_mem_pool_host(kv)
        backend.register_mem_host_pool_v2(mamba, "mamba")
        for name, host, pages in (
            ("kv", kv, range(1, kv_pages + 1)),
            ("mamba", mamba, checkpoints),
        ):
            keys = [HASHES[p - 1] for p in pages]
            if keys:
                written = backend.batch_set_v2(
                    [PoolTransfer(name=name, keys=keys, host_indices=tokens(host, 0, len(keys)))]
                )
                assert written == {name: [True] * len(keys)}, (rank, scenario, written)

        with patch("sglang.srt.mem_cache.utils.get_native_hash", return_value=HASHES):
            controller = HybridCacheController.__new__(HybridCacheController)
            controller.page_size = PAGE_SIZE
            controller.prefetch_hits_sync_groups = [dist.group.WORLD]
            controller.storage_backend = backend
            transfer = PoolTransfer(
                name=PoolName.MAMBA, keys=HASHES[-1:], hit_policy=PoolHitPolicy.TRAILING_PAGES
            )
            operation = PrefetchOperation(
                CacheRequestHandle("request", 0), TOKENS, pool_transfers=[transfer]
            )
            if terminated:
                operation.mark_terminate()
            controller.prefetch_queue = Queue()
            controller.prefetch_hit_queue = Queue()
            controller.prefetch_queue.put(operation)
            controller.storage_stop_event = threading.Event()
            controller.storage_stop_event.set()  # the loop drains pending work, then stops
            controller.prefetch_thread_func()

        result = controller.prefetch_hit_queue.get_nowait()
        assert result is operation
        assert result.storage_hit_count == expected * PAGE_SIZE, (
            rank,
            scenario,
            result.storage_hit_count,
        )
        assert result.hash_value == HASHES[:expected], (rank, scenario)
        assert controller.prefetch_hit_queue.empty()
        if expected:
            assert expected in operation.pool_storage_result.restorable_prefix_pages
            controller._sync_trailing_keys(
                operation.pool_transfers, operation.all_hash_values, expected
            )
            assert operation.pool_transfers[0].keys == HASHES[expected - 1 : expected]
            # The chosen checkpoint is really in this rank's store.
            again = backend.batch_exists_v2(HASHES[:expected], operation.pool_transfers)
            assert expected in again.restorable_prefix_pages, (rank, scenario, again)
    finally:
        backend.close()


def _worker(rank: int, world: int, rendezvous: str, store_root: str, errors: Any) -> None:
    try:
        from hicache.integrations.sglang.sglang_imports import allow_sglang_without_torchvision

        allow_sglang_without_torchvision()
        import torch.distributed as dist

        dist.init_process_group(
            backend="gloo",
            init_method=rendezvous,
            rank=rank,
            world_size=world,
            timeout=timedelta(seconds=60),
        )
        try:
            for scenario in SCENARIOS:
                _check(rank, scenario, store_root)
        finally:
            dist.destroy_process_group()
    except BaseException:
        errors.put(f"rank {rank}: {traceback.format_exc()}")
        raise


def test_two_ranks_agree_on_a_prefix_both_can_restore() -> None:
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("gloo is required for the CPU prefix synchronisation")
    context = multiprocessing.get_context("spawn")
    errors = context.Queue()
    with tempfile.TemporaryDirectory() as directory:
        rendezvous = Path(directory, "rendezvous").as_uri()
        workers = [
            context.Process(target=_worker, args=(rank, 2, rendezvous, directory, errors))
            for rank in range(2)
        ]
        try:
            for worker in workers:
                worker.start()
            deadline = time.monotonic() + WORKER_TIMEOUT
            for worker in workers:
                worker.join(max(0.0, deadline - time.monotonic()))
            failures = []
            while not errors.empty():
                failures.append(errors.get())
            assert not failures, "\n".join(failures)
            for rank, worker in enumerate(workers):
                assert not worker.is_alive(), f"rank {rank} timed out"
                assert worker.exitcode == 0, f"rank {rank} failed"
        finally:
            for worker in workers:
                if worker.is_alive():
                    worker.terminate()
                if worker.pid is not None:
                    worker.join(timeout=5)
