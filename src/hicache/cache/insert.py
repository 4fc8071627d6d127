"""Checking what ``HiCache.insert`` is given and turning it into the prefix index's placements.

- pool_name: a PoolName from its text (ConfigError naming an unknown one).
- insert_placements: one placement per full page from the anchor's ids, a window pool's ids (or
  None) per page and the state checkpoints per boundary; checkpoints at boundaries the
  CheckpointPolicy does not keep come back as released ids; every device id named comes back
  too, with the argument that named it (for ``cache_args.device_ids``, checked before the
  index changes). ConfigError names what is wrong.

A group with a state pool (restored from a checkpoint) needs ``checkpoints``: without one no
page of the insert can ever be hit (a hit ends at a boundary with a checkpoint), so
``checkpoints=None`` is refused; ``checkpoints={}`` says so on purpose and is accepted.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from hicache.cache import args as cache_args
from hicache.domain.errors import ConfigError
from hicache.domain.hybrid import CheckpointPolicy, GroupRules, Restore
from hicache.domain.pools import PoolName, page_ids

Named = list[tuple[str, PoolName, object]]


def pool_name(value: object) -> PoolName:
    """A pool name from a PoolName or its text; ConfigError for anything else."""
    return cache_args.pool(value, "pool name")


def _expected(n: int, tail: int) -> str:
    return f"{n}" if n == tail else f"{n} (full pages) or {tail} (with the partial page)"


def insert_placements(
    rules: GroupRules,
    policy: CheckpointPolicy,
    tokens: int,
    n: int,
    device_pages: Mapping[PoolName, Sequence[int | None]],
    checkpoints: Mapping[int, Mapping[PoolName, int]] | None,
) -> tuple[list[dict[PoolName, int]], dict[PoolName, list[int]], Named]:
    """Placements of ``n`` full pages (of ``tokens`` tokens), the checkpoint slots released
    and every device id named (see the module docstring)."""
    windows = [r.pool for r in rules.rules if r.restore is Restore.WINDOW and not r.follows_anchor]
    states = [r.pool for r in rules.rules if r.restore is Restore.CHECKPOINT]
    raw = cache_args.mapping(device_pages, "insert: device_pages")
    pages: dict[PoolName, list[int | None]] = {}
    for key, ids in raw.items():
        p = cache_args.pool(key, "insert: device_pages key")
        if p in pages:
            raise ConfigError(f"insert: device_pages names pool {p.value!r} twice")
        pages[p] = page_ids(ids, f"insert: device_pages[{p.value!r}]")
    anchor = rules.anchor
    if anchor not in pages:
        raise ConfigError(f"insert: device_pages needs the anchor {anchor.value!r}")
    tail = -(-tokens // rules.page_size)
    for p, ids in pages.items():
        if p is not anchor and p not in windows:
            raise ConfigError(
                f"insert: pool {p.value!r} is not given per page (anchor "
                f"{anchor.value!r}, window pools {[w.value for w in windows]}; "
                "state pools go in checkpoints)"
            )
        if len(ids) not in (n, tail):
            raise ConfigError(
                f"insert: device_pages[{p.value!r}] has {len(ids)} pages for {tokens} tokens "
                f"of page size {rules.page_size}: expected {_expected(n, tail)}"
            )
    if states and checkpoints is None and n > 0:
        names = [s.value for s in states]
        raise ConfigError(
            f"insert: this model restores pool(s) {names} from state checkpoints: pass "
            f"checkpoints={{boundary: {{{names[0]!r}: slot}}}} (cache.checkpoint_boundaries("
            f"{n}) lists the boundaries to keep); without one none of these {n} pages can ever "
            "be hit (pass checkpoints={} to insert them anyway)"
        )
    named: Named = []
    placements: list[dict[PoolName, int]] = []
    for i in range(n):
        where: dict[PoolName, int] = {}
        for p, ids in pages.items():
            pid = ids[i]
            if pid is None:
                if p is anchor:
                    raise ConfigError(f"insert: page {i} has no {anchor.value!r} page")
                continue
            named.append((f"device_pages[{p.value!r}][{i}]", p, pid))
            where[p] = pid  # an int: checked by device_ids before the index sees it
        placements.append(where)
    for p, ids in pages.items():  # a trailing partial page's id stays the framework's
        for i in range(n, len(ids)):
            if ids[i] is not None:
                named.append((f"device_pages[{p.value!r}][{i}]", p, ids[i]))
    released: dict[PoolName, list[int]] = {}
    given = {} if checkpoints is None else cache_args.mapping(checkpoints, "insert: checkpoints")
    for b, slots in given.items():
        what = f"checkpoints[{b!r}]"
        slots = cache_args.mapping(slots, f"insert: {what}")
        bad = [s for s in slots if cache_args.pool(s, f"insert: {what} key") not in states]
        if bad or not isinstance(b, int) or isinstance(b, bool) or not 0 < b <= n:
            raise ConfigError(
                f"insert: checkpoint at boundary {b!r} for {list(slots)}: boundaries are "
                f"1..{n}, pools {[p.value for p in states]}"
            )
        for key, s in slots.items():
            p = cache_args.pool(key)
            named.append((f"checkpoints[{b}][{p.value!r}]", p, s))
            if policy.keeps(b, n):
                placements[b - 1][p] = s
            else:
                released.setdefault(p, []).append(s)
    return placements, released, named
