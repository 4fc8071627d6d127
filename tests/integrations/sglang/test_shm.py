"""``"allocator": "shm"`` in the backend's extra config: SGLang allocates every host pool, side
pools included, on shared memory, and the backend moves their pages byte-exact.

SGLang reads the key itself (python/sglang/srt/mem_cache/pool_host/common.py,
``get_allocator_type``: backend "dynamic" and ``allocator == "shm"`` in the extra config JSON);
the test hands that function the server's memory settings (the extra config an SGLang user passes,
as JSON) instead of a full server-args context, then builds every pool kind with the allocator it
chose.
"""

from __future__ import annotations

import json
import os
from types import SimpleNamespace
from typing import Any

import pytest

from tests.integrations.sglang.support import require_sglang

require_sglang()

import sglang.srt.mem_cache.pool_host.common as host_common  # noqa: E402
from sglang.srt.mem_cache.hicache_storage import PoolTransfer  # noqa: E402

from tests.integrations.sglang.conftest import extra  # noqa: E402
from tests.integrations.sglang.pools import (  # noqa: E402
    dsa_indexer_pool,
    fill_page,
    keys,
    mamba_pool,
    mha_pool,
    minimax_index_pool,
    mla_pool,
    page_bytes,
    tokens,
)

pytestmark = pytest.mark.sglang


def shared_memory(pool: Any) -> bool:
    fds = getattr(pool.allocator, "fds", [])
    return bool(fds) and all(os.readlink(f"/proc/self/fd/{fd}").startswith("/memfd:") for fd in fds)


def test_allocator_shm_puts_every_host_pool_on_shared_memory(
    make_backend: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    memory = SimpleNamespace(
        hicache_storage_backend="dynamic",
        hicache_storage_backend_extra_config=json.dumps(extra("/tmp/unused", allocator="shm")),
    )
    monkeypatch.setattr(host_common, "get_memory", lambda: memory)
    allocator = host_common.get_allocator_type()
    assert allocator == "shm"

    mha = mha_pool("page_first", allocator=allocator)
    mla = mla_pool("page_first", allocator=allocator)
    side = {
        "mamba": mamba_pool(allocator=allocator),
        "indexer": minimax_index_pool(mha, "page_first", allocator=allocator),
    }
    dsa = dsa_indexer_pool(mla, allocator=allocator)
    built = [mha, mla, side["mamba"], side["indexer"], dsa]
    assert all(shared_memory(p) for p in built), [type(p.allocator).__name__ for p in built]

    backend = make_backend(mha, {"mamba": side["mamba"]}, config={"allocator": "shm"})
    kv_bytes = fill_page(mha, 0, 1)
    m_bytes = fill_page(side["mamba"], 0, 2)
    k = keys(1)
    assert backend.batch_set_v2(
        [
            PoolTransfer(name="kv", keys=k, host_indices=tokens(mha, 0, 1)),
            PoolTransfer(name="mamba", keys=k, host_indices=tokens(side["mamba"], 0, 1)),
        ]
    ) == {"kv": [True], "mamba": [True]}
    assert backend.batch_get_v2(
        [
            PoolTransfer(name="kv", keys=k, host_indices=tokens(mha, 5, 1)),
            PoolTransfer(name="mamba", keys=k, host_indices=tokens(side["mamba"], 5, 1)),
        ]
    ) == {"kv": [True], "mamba": [True]}
    assert page_bytes(mha, 5 * mha.page_size) == kv_bytes
    assert page_bytes(side["mamba"], 5) == m_bytes
