"""Group rules and keys of the prefix-index tests: PLAIN (one KV pool), HYBRID (KV anchor,
indexer sidecar following it, Mamba state restored from a checkpoint), both with 4-token pages;
keys(n, base) chains the keys of n pages of tokens base, base + 1, ..."""

from __future__ import annotations

from hicache.domain import PoolName
from hicache.domain.hybrid import GroupRules, PoolRule, Restore
from hicache.domain.keys import chain_keys

KV, IDX, MAMBA = PoolName.KV, PoolName.INDEXER, PoolName.MAMBA


PLAIN = GroupRules(page_size=4, rules=[PoolRule(pool=KV, restore=Restore.ALL_PAGES)])


HYBRID = GroupRules(
    page_size=4,
    rules=[
        PoolRule(pool=KV, restore=Restore.ALL_PAGES),
        PoolRule(pool=IDX, restore=Restore.ALL_PAGES, follows_anchor=True),
        PoolRule(pool=MAMBA, restore=Restore.CHECKPOINT),
    ],
)


def keys(n: int, base: int = 0) -> list[bytes]:
    return chain_keys(list(range(base, base + 4 * n)), 4)
