"""Hits of hybrid models: the deepest boundary at which the KV pages, every sliding-window
group's window and the state are all held (no vLLM import, no torch).

- window_pages(window_tokens, block_size): how many blocks before a boundary a sliding group
  keeps, and so a hit there needs: vLLM's SlidingWindowManager skips (and frees, leaving its
  null block) the first ``T - window + 1 - extra_retained`` tokens of ``T`` computed ones, so at
  a boundary of ``b`` blocks it holds the last ``ceil((window - 1 + extra) / block_size)``.
- hybrid_rules(window_pages, states): hicache's hybrid-consistent rule
  (hicache.domain.hybrid.GroupRules) for the connector's page kinds: KV pages ALL_PAGES, window
  pages WINDOW, states CHECKPOINT.
- HybridHit / match_hybrid(...): where a hit ends (hicache.domain.hybrid.usable_boundary over
  what the host tier and the store hold), which KV pages are on host, and where the state and
  each window page it needs are. Pages before ``start`` (vLLM's own hit) count as held.
- take_windows(...): pins (host) or reserves (store) the window pages of an accepted hit for the
  blocks vLLM allocated; None when one is gone or vLLM's blocks do not match the hit.

A window page is one block of every sliding-window layer, keyed window_key(block key) (its own
store object per page, beside the page of the full-attention layers): a hit loads only the pages
of its window, and a lost window page shrinks the hit (or makes it a miss), never a wrong load.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import attrs

from hicache.domain import CacheStateError, ConfigError
from hicache.domain.host_pages import HostPages
from hicache.domain.hybrid import GroupRules, PoolRule, Restore, has_from_sets, usable_boundary
from hicache.domain.pools import PoolName
from hicache.integrations.vllm.plan import StateLoad, state_key, window_key

NULL_BLOCK = 0  # vLLM's null block id: a sliding group's block outside its window


def window_pages(window_tokens: int, block_size: int) -> int:
    """Blocks a sliding group holds before a boundary (vLLM's rule, see the module docstring)."""
    if window_tokens < 1 or block_size < 1:
        raise ConfigError(
            f"a sliding window of {window_tokens} tokens before a boundary with blocks of "
            f"{block_size} tokens: expected both positive"
        )
    return math.ceil(window_tokens / block_size)


def hybrid_rules(window_pages: int, states: bool) -> GroupRules:
    """KV pages restore every page; window pages the last ``window_pages`` (0: no sliding
    groups); a state is needed at the boundary itself (``states``)."""
    rules = [PoolRule(pool=PoolName.KV, restore=Restore.ALL_PAGES)]
    if window_pages:
        rules.append(PoolRule(pool=PoolName.SWA, restore=Restore.WINDOW, window_pages=window_pages))
    if states:
        rules.append(PoolRule(pool=PoolName.MAMBA, restore=Restore.CHECKPOINT))
    return GroupRules(page_size=1, rules=rules)


@attrs.frozen
class HybridHit:
    end: int  # the hit's boundary (blocks)
    host: int  # KV blocks [start, host) are on host, [host, end) in the store
    state_from_store: bool | None  # None: the model has no state groups
    windows: dict[int, bool]  # window page index -> from the store, for the hit's window
    # a sliding attention group (kv_window): KV page index -> from the store, for the pages of
    # the hit's window (the only ones loaded); empty otherwise (``host`` splits the pages)
    kv: dict[int, bool] = attrs.field(factory=dict)


InStore = Callable[[Sequence[bytes]], list[bool]]


def match_hybrid(
    keys: Sequence[bytes],
    start: int,
    limit: int,
    *,
    index: HostPages,
    states: HostPages | None,
    windows: HostPages | None,
    window_size: int,
    bad: set[bytes],
    in_store: InStore,
    kv_window: int = 0,
) -> HybridHit | None:
    """The deepest boundary in (start, limit] the connector can restore; None when none.

    KV pages: the host run from ``start``, then the store run after it; with ``kv_window``
    (the attention group slides) every page held on host or in the store (one call), of which
    a boundary needs only the last ``kv_window``. Then the states at each boundary and the
    window pages of blocks ``[start, kv_end)``, from host or (one store call for all of them)
    the store; usable_boundary picks the boundary. ``bad``: keys whose read or load failed
    (never offered).
    """
    kv_from: dict[int, bool] = {}  # kv_window: page -> from the store
    if kv_window:
        kv_end = _sliding_kv(keys, start, limit, index, bad, in_store, kv_from)
        host = start
    else:
        i = start
        while i < limit and keys[i] not in bad and index.lookup(keys[i]) is not None:
            i += 1
        host = i
        run = 0
        while i + run < limit and keys[i + run] not in bad and not index.known(keys[i + run]):
            run += 1
        if run:
            there = in_store(keys[i : i + run])
            run = there.index(False) if False in there else run
        kv_end = i + run
    if kv_end <= start:
        return None
    where: dict[bytes, bool] = {}  # key -> from the store
    ask: list[bytes] = []

    def look(pages: HostPages, key: bytes) -> None:
        if key in bad:
            return
        if pages.lookup(key) is not None:
            where[key] = False
        elif not pages.known(key):  # known but not ready: a save or read in flight
            ask.append(key)

    if states is not None:
        for j in range(start + 1, kv_end + 1):  # the state at j ends block j - 1
            look(states, state_key(keys[j - 1]))
    if windows is not None:
        for p in range(start, kv_end):  # vLLM holds the window before start
            look(windows, window_key(keys[p]))
    if ask:
        where.update({k: True for k, ok in zip(ask, in_store(ask), strict=True) if ok})
    present: dict[PoolName, set[int]] = {PoolName.KV: set(range(kv_end))}
    if kv_window:  # the sliding attention pages take the window rule (no window groups here)
        present[PoolName.SWA] = set(range(start)) | set(kv_from)
    if states is not None:
        present[PoolName.MAMBA] = {
            j - 1 for j in range(start + 1, kv_end + 1) if state_key(keys[j - 1]) in where
        }
    if windows is not None:  # vLLM holds the window of its own hit
        present[PoolName.SWA] = set(range(start)) | {
            p for p in range(start, kv_end) if window_key(keys[p]) in where
        }
    if kv_window and windows is not None:
        raise ConfigError("a sliding attention group beside sliding-window groups: not a layout")
    rules = hybrid_rules(
        kv_window or (window_size if windows is not None else 0), states is not None
    )
    end = usable_boundary(rules, kv_end, has_from_sets(present))
    if end <= start:
        return None
    kv = {p: kv_from[p] for p in range(max(start, end - kv_window), end)} if kv_window else {}
    if kv_window:  # the hit's tokens split by tier: the store's are the pages read from it
        host = end - sum(kv.values())
    return HybridHit(
        end=end,
        host=min(max(host, start), end),
        kv=kv,
        state_from_store=where[state_key(keys[end - 1])] if states is not None else None,
        windows=(
            {p: where[window_key(keys[p])] for p in range(max(start, end - window_size), end)}
            if windows is not None
            else {}
        ),
    )


def _sliding_kv(
    keys: Sequence[bytes],
    start: int,
    limit: int,
    index: HostPages,
    bad: set[bytes],
    in_store: InStore,
    kv_from: dict[int, bool],
) -> int:
    """Every KV page of ``[start, limit)`` held on host or (one store call) in the store, into
    ``kv_from`` (page -> from the store); the end of the last one (``start`` when none)."""
    ask: list[int] = []
    for p in range(start, limit):
        if keys[p] in bad:
            continue
        if index.lookup(keys[p]) is not None:
            kv_from[p] = False
        elif not index.known(keys[p]):  # known but not ready: a save or read in flight
            ask.append(p)
    if ask:
        there = in_store([keys[p] for p in ask])
        kv_from.update({p: True for p, ok in zip(ask, there, strict=True) if ok})
    return max(kv_from) + 1 if kv_from else start


Taken = list[tuple[HostPages, bytes, bool]]  # (index, key, from the store): what to give back


def take(pages: HostPages, key: bytes, from_store: bool, taken: Taken) -> int | None:
    """Pin a host page, or reserve a slot for one read from the store; None when it is gone
    (or already held by another reader); what was taken is added to ``taken``."""
    try:
        if from_store:
            slot = None if pages.known(key) else pages.reserve(key, pins=1)
        else:
            slot = pages.pin(key)
    except CacheStateError:
        slot = None
    if slot is not None:
        taken.append((pages, key, from_store))
    return slot


def give_back(taken: Taken) -> None:
    """Undo take(): host pages unpinned, reserved store pages forgotten."""
    for pages, key, from_store in taken:
        if from_store:
            pages.drop(key)
        pages.unpin(key)
    taken.clear()


def take_windows(
    windows: HostPages,
    keys: Sequence[bytes],
    hit: HybridHit,
    start: int,
    end: int,
    window_blocks: Sequence[Sequence[int]],
    taken: Taken,
) -> list[StateLoad] | None:
    """The window pages to load into every block vLLM allocated for the sliding groups in
    ``[start, end)`` (null blocks are outside the window: nothing to load); None when a block
    vLLM allocated has no page in the hit, or a page is gone."""
    loads: list[StateLoad] = []
    for p in range(start, end):
        blocks = tuple(ids[p] if p < len(ids) else NULL_BLOCK for ids in window_blocks)
        if all(b == NULL_BLOCK for b in blocks):
            continue
        if NULL_BLOCK in blocks or p not in hit.windows:
            return None
        key = window_key(keys[p])
        from_store = hit.windows[p]
        slot = take(windows, key, from_store, taken)
        if slot is None:
            return None
        loads.append(StateLoad(key, slot, blocks, from_store))
    return loads


def window_saves(
    windows: HostPages,
    keys: Sequence[bytes],
    first: int,
    stop: int,
    window_blocks: Sequence[Sequence[int]],
) -> list[tuple[bytes, tuple[int, ...]]]:
    """(window key, one block per sliding group) of blocks ``[first, stop)`` not held yet whose
    blocks vLLM still holds in every sliding group (a freed one is its null block)."""
    out: list[tuple[bytes, tuple[int, ...]]] = []
    for p in range(first, min(stop, len(keys))):
        key = window_key(keys[p])
        if windows.known(key):
            continue
        blocks = tuple(ids[p] if p < len(ids) else NULL_BLOCK for ids in window_blocks)
        if blocks and NULL_BLOCK not in blocks:
            out.append((key, blocks))
    return out
