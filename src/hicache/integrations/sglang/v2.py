"""The SGLang backend's v2 calls of hybrid side pools (``PoolTransfer`` per pool).

- exists_v2(tiers, moves, keys, transfers): ``batch_exists_v2``: the usable prefix under each
  side pool's hit policy (SGLang's file backend's rules): ``all_pages`` needs every page up to
  the prefix, ``trailing_pages`` only the last ``len(transfer.keys)`` pages before it. Returns
  SGLang's PoolTransferResult: the usable prefix, the pages each pool has, and the prefix
  lengths every pool can restore.
- move_v2(tiers, moves, transfers, op): ``batch_get_v2`` / ``batch_set_v2``: per pool name, one
  bool per key, moved at the transfer's host indices. A transfer whose host indices do not
  match its keys is answered all False (and logged), as SGLang's file backend does.
"""

from __future__ import annotations

import torch
from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolTransfer, PoolTransferResult

from hicache.domain.errors import ConfigError, shown
from hicache.engine.logs import get_logger
from hicache.integrations.sglang.arguments import host_tokens, page_keys, transfers_of
from hicache.integrations.sglang.moves import PageMoves
from hicache.integrations.sglang.tiers import BackendTiers

log = get_logger("hicache.sglang")


def exists_v2(
    tiers: BackendTiers,
    moves: PageMoves,
    keys: object,
    pool_transfers: object,
) -> PoolTransferResult:
    """``batch_exists_v2`` (module docstring)."""
    checked = page_keys(keys, "batch_exists_v2")
    transfers = transfers_of(
        [] if pool_transfers is None else pool_transfers, PoolTransfer, "batch_exists_v2"
    )
    kv = moves.exists_each(tiers.pool("kv"), checked)
    kv_pages = kv.index(False) if False in kv else len(kv)
    hits: dict[str, int] = {"kv": kv_pages} if kv_pages else {}
    restorable = list(range(1, kv_pages + 1))
    for transfer in transfers or []:
        if not restorable:
            break
        name = str(getattr(transfer.name, "value", transfer.name))
        have = moves.exists_each(tiers.pool(name), checked[:kv_pages])
        if transfer.hit_policy == PoolHitPolicy.ALL_PAGES:
            boundary = have.index(False) if False in have else kv_pages
            allowed = set(range(1, boundary + 1))
        elif transfer.hit_policy == PoolHitPolicy.TRAILING_PAGES:
            window = max(1, len(transfer.keys) if transfer.keys else 1)
            allowed = {n for n in range(1, kv_pages + 1) if all(have[max(0, n - window) : n])}
            boundary = max(allowed, default=0)
        else:
            raise ConfigError(
                f"HiCacheBackend: pool {shown(name)} hit policy {shown(transfer.hit_policy)} is not "
                "supported: expected all_pages or trailing_pages"
            )
        if boundary:
            hits[name] = boundary
        restorable = [n for n in restorable if n in allowed]
    usable = restorable[-1] if restorable else 0
    moves.count_lookup(tiers.pool("kv"), len(checked), usable)
    return PoolTransferResult(usable, hits, restorable)


def move_v2(
    tiers: BackendTiers, moves: PageMoves, transfers: object, op: str
) -> dict[str, list[bool]]:
    """``batch_get_v2`` (op "get") / ``batch_set_v2`` (op "set") (module docstring)."""
    out: dict[str, list[bool]] = {}
    for transfer in transfers_of(transfers, PoolTransfer, f"batch_{op}_v2"):
        name = str(getattr(transfer.name, "value", transfer.name))
        pool = tiers.pool(name)
        keys = page_keys(transfer.keys or [], f"batch_{op}_v2 pool {shown(name)}")
        indices = transfer.host_indices
        expected = len(keys) * pool.pages.page_size
        if indices is None or (
            isinstance(indices, torch.Tensor) and int(indices.numel()) != expected
        ):
            # SGLang's file backend answers all False (and logs) here; so do we.
            log.error(
                "v2 host_indices length mismatch",
                op=op,
                pool=name,
                expected=expected,
                got=None if indices is None else int(indices.numel()),
            )
            moves.counters.count_error(operation=op, status="bad_host_indices")
            out[transfer.name] = [False] * len(keys)
            continue
        call = f"batch_{op}_v2 pool {shown(name)}"
        tokens = host_tokens(indices, len(keys), pool.pages.page_size, pool.name, call)
        out[transfer.name] = moves.host(op)(pool, keys, tokens)
    return out
