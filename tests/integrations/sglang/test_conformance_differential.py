"""hicache's backend answers ``batch_exists_v2`` exactly as SGLang's own ``HiCacheFile`` does, on
every combination of a small space (the installed sglang 0.5.23 is the reference, run in the
same test).

Where it comes from: an exhaustive script over the same space found through the search tool's
code index (``legal_endpoints`` / ``query`` over four pages, two side pools, both hit policies,
windows 1-3; its text carries no ``register_cpu_ci`` and no path, so it is not one of SGLang's
registered CI tests). It checks HiCacheFile against a hand-written rule; this file checks
hicache's backend against HiCacheFile itself, which is what conformance means here.

What was adapted, and why:
- Two backends per run: SGLang's ``HiCacheFile`` built as SGLang's own unit tests build it
  (``__new__``, ``file_path``, the rank suffixes, no metadata cache), a page marked present by
  touching the file its ``_get_component_key`` names; and hicache's, built by SGLang's factory,
  a page made present by ``batch_set_v2`` from a real SGLang host pool of that name (KV and SWA:
  MHA pools; Mamba: SGLang's Mamba pool).
- Three pages instead of four and windows 1-2 instead of 1-3 (a window longer than the prefix
  is covered by test_conformance.py's ``test_prefix_shorter_than_window``), so that the
  4 x 8 x 8 = 256 presence patterns, each queried under 9 policy pairs in both transfer
  orders, run in seconds on the shared CPUs: every pattern gets keys of its own (a salt), so
  one backend of each kind holds them all.
"""

from __future__ import annotations

import itertools
import os
import tempfile
from pathlib import Path
from typing import Any

import pytest

from tests.integrations.sglang.support import require_sglang

require_sglang()

from sglang.srt.mem_cache.hicache_storage import (  # noqa: E402
    HiCacheFile,
    PoolHitPolicy,
    PoolName,
    PoolTransfer,
)

from tests.integrations.sglang.pools import mamba_pool, mha_pool, tokens  # noqa: E402

pytestmark = pytest.mark.sglang

N = 3
SIDE = (PoolName.SWA, PoolName.MAMBA)
PAGE_SETS = [
    frozenset(i + 1 for i, bit in enumerate(bits) if bit)
    for bits in itertools.product([False, True], repeat=N)
]
# (policy, window): ALL_PAGES ignores the window; TRAILING_PAGES reads it from len(keys).
POLICIES = [
    (PoolHitPolicy.ALL_PAGES, 1),
    (PoolHitPolicy.TRAILING_PAGES, 1),
    (PoolHitPolicy.TRAILING_PAGES, 2),
]


def sglang_file_backend(directory: str) -> Any:
    backend = HiCacheFile.__new__(HiCacheFile)
    backend.file_path = directory
    backend.config_suffix = "_conformance"
    backend.tp_config_suffix = "_conformance_tp0"
    backend.metadata_cache = None
    return backend


def mark_present(file_backend: Any, key: str, name: PoolName) -> None:
    stem = file_backend._get_component_key(key, name)
    Path(os.path.join(file_backend.file_path, f"{stem}.bin")).touch()


def answers(backend: Any, keys: list[str], policies: Any, reverse: bool) -> Any:
    transfers = [
        PoolTransfer(name=name, keys=keys[:window], hit_policy=policy)
        for name, (policy, window) in zip(SIDE, policies, strict=True)
    ]
    if reverse:
        transfers.reverse()
    r = backend.batch_exists_v2(keys, transfers)
    hits = {str(getattr(k, "value", k)): v for k, v in r.extra_pool_hit_pages.items()}
    return r.kv_hit_pages, hits, r.restorable_prefix_pages


def test_batch_exists_v2_matches_sglangs_hicache_file_on_every_pattern(
    make_backend: Any,
) -> None:
    kv, swa, mamba = mha_pool("page_first"), mha_pool("page_first"), mamba_pool()
    ours = make_backend(kv, {"swa": swa, "mamba": mamba})
    hosts = {PoolName.KV: kv, PoolName.SWA: swa, PoolName.MAMBA: mamba}
    checked = 0
    differ: list[Any] = []
    with tempfile.TemporaryDirectory() as directory:
        theirs = sglang_file_backend(directory)
        patterns = itertools.product(range(N + 1), PAGE_SETS, PAGE_SETS)
        for n, (kv_prefix, swa_pages, mamba_pages) in enumerate(patterns):
            keys = [f"s{n}p{i}" for i in range(1, N + 1)]
            present = {
                PoolName.KV: range(1, kv_prefix + 1),
                PoolName.SWA: swa_pages,
                PoolName.MAMBA: mamba_pages,
            }
            for name, pages in present.items():
                chosen = [keys[p - 1] for p in sorted(pages)]
                for key in chosen:
                    mark_present(theirs, key, name)
                if chosen:
                    host = hosts[name]
                    ok = ours.batch_set_v2(
                        [
                            PoolTransfer(
                                name=name.value,
                                keys=chosen,
                                host_indices=tokens(host, 0, len(chosen)),
                            )
                        ]
                    )
                    assert ok == {name.value: [True] * len(chosen)}
            for policies in itertools.product(POLICIES, repeat=2):
                for reverse in (False, True):
                    want = answers(theirs, keys, policies, reverse)
                    got = answers(ours, keys, policies, reverse)
                    if got != want:
                        differ.append((kv_prefix, swa_pages, mamba_pages, policies, want, got))
                    checked += 1
    assert checked == 4 * 8 * 8 * 9 * 2
    assert not differ, differ[:5]
