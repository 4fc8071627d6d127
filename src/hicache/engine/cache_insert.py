"""Checking what ``HiCache.insert`` is given and turning it into the prefix index's placements.

- pool_name: a PoolName from its text (ConfigError naming an unknown one).
- insert_placements: one placement per full page from the anchor's ids, a window pool's ids (or
  None) per page and the state checkpoints per boundary; checkpoints at boundaries the
  CheckpointPolicy does not keep come back as released ids. ConfigError names what is wrong.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from hicache.domain.errors import ConfigError
from hicache.domain.hybrid import CheckpointPolicy, GroupRules, Restore
from hicache.domain.pools import PoolName


def pool_name(value: object) -> PoolName:
    """A pool name from a PoolName or its text; ConfigError for anything else."""
    try:
        return PoolName(value)
    except ValueError:
        raise ConfigError(
            f"unknown pool {value!r}: expected one of {[p.value for p in PoolName]}"
        ) from None


def insert_placements(
    rules: GroupRules,
    policy: CheckpointPolicy,
    tokens: int,
    n: int,
    device_pages: Mapping[PoolName, Sequence[int | None]],
    checkpoints: Mapping[int, Mapping[PoolName, int]] | None,
) -> tuple[list[dict[PoolName, int]], dict[PoolName, list[int]]]:
    """Placements of ``n`` full pages (of ``tokens`` tokens) and the checkpoint slots released."""
    windows = [r.pool for r in rules.rules if r.restore is Restore.WINDOW and not r.follows_anchor]
    states = [r.pool for r in rules.rules if r.restore is Restore.CHECKPOINT]
    pages = {pool_name(p): list(v) for p, v in device_pages.items()}
    anchor = rules.anchor
    if anchor not in pages:
        raise ConfigError(f"insert: device_pages needs the anchor {anchor.value!r}")
    tail = -(-tokens // rules.page_size)
    if len(pages[anchor]) not in (n, tail):
        raise ConfigError(
            f"insert: {len(pages[anchor])} {anchor.value!r} pages for {tokens} "
            f"tokens: expected {n} (full pages) or {tail}"
        )
    for p, ids in pages.items():
        if p is not anchor and p not in windows:
            raise ConfigError(
                f"insert: pool {p.value!r} is not given per page (anchor "
                f"{anchor.value!r}, window pools {[w.value for w in windows]}; "
                "state pools go in checkpoints)"
            )
        if p is not anchor and len(ids) not in (n, tail):
            raise ConfigError(f"insert: {len(ids)} {p.value!r} entries for {n} pages")
    placements: list[dict[PoolName, int]] = []
    for i in range(n):
        where: dict[PoolName, int] = {}
        for p, ids in pages.items():
            pid = ids[i]
            if pid is None:
                if p is anchor:
                    raise ConfigError(f"insert: page {i} has no {anchor.value!r} page")
                continue
            where[p] = pid
        placements.append(where)
    released: dict[PoolName, list[int]] = {}
    for b, slots in (checkpoints or {}).items():
        bad = [p for p in slots if pool_name(p) not in states]
        if bad or not isinstance(b, int) or not 0 < b <= n:
            raise ConfigError(
                f"insert: checkpoint at boundary {b!r} for {list(slots)}: boundaries are "
                f"1..{n}, pools {[p.value for p in states]}"
            )
        if policy.keeps(b, n):
            placements[b - 1].update({pool_name(p): s for p, s in slots.items()})
        else:
            for p, s in slots.items():
                released.setdefault(pool_name(p), []).append(s)
    return placements, released
