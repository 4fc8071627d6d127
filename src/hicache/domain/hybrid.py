"""Hybrid-consistent hits: the longest page boundary at which EVERY pool of a group can restore.

- Restore: how a pool restores at a boundary: ALL_PAGES, WINDOW (the last ``window_pages``
  pages before it) or CHECKPOINT (a state checkpoint taken exactly at it).
- PoolRule: one pool's restore rule; ``follows_anchor`` for sidecars (they share the anchor's
  pages on device and host, but are separate objects in storage).
- GroupRules: the rules of a group; GroupRules.from_plan(plan, sliding_window=...) derives them
  from HitPolicy and the pool's unit (TRAILING_PAGES + tokens = WINDOW, + slots = CHECKPOINT).
- usable_boundary: the largest boundary b <= n such that every rule holds, given a predicate
  ``has(pool, page_index)``; 0 when nothing is restorable. Never a partial restore.
- needed_pages: the page indices a pool must restore at a boundary.
- CheckpointPolicy: which page boundaries keep a state checkpoint (every N pages + request end).

A checkpoint "at boundary b" (b pages restored) is kept with page b-1, the last page it covers.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable, Iterable, Mapping

import attrs

from hicache.domain.errors import ConfigError, shown
from hicache.domain.geometry import Unit
from hicache.domain.pools import HitPolicy, HostGroupPlan, PoolName, PoolRole
from hicache.domain.validators import nonneg_int, positive_int


class Restore(enum.Enum):
    ALL_PAGES = "all_pages"
    WINDOW = "window"
    CHECKPOINT = "checkpoint"


@attrs.frozen(kw_only=True)
class PoolRule:
    """How one pool restores at a boundary."""

    pool: PoolName
    restore: Restore
    window_pages: int = attrs.field(default=0, validator=nonneg_int)
    follows_anchor: bool = False

    def __attrs_post_init__(self) -> None:
        if (self.restore is Restore.WINDOW) != (self.window_pages > 0):
            raise ConfigError(
                f"pool {shown(self.pool.value)}: window_pages={self.window_pages} is only for (and "
                f"required by) a WINDOW rule, got {self.restore.value}"
            )


def _rules(value: object) -> tuple[PoolRule, ...]:
    if not isinstance(value, (tuple, list)):
        raise ConfigError(f"rules must be a sequence of PoolRule, got {shown(value)}")
    return tuple(value)


@attrs.frozen(kw_only=True)
class GroupRules:
    """The restore rules of a group; the first rule is the anchor (ALL_PAGES)."""

    page_size: int = attrs.field(validator=positive_int)
    rules: tuple[PoolRule, ...] = attrs.field(converter=_rules)

    def __attrs_post_init__(self) -> None:
        if not self.rules or self.rules[0].restore is not Restore.ALL_PAGES:
            raise ConfigError("the first rule must be the anchor's, restoring ALL_PAGES")
        names = [r.pool for r in self.rules]
        if len(set(names)) != len(names):
            raise ConfigError(f"one rule per pool, got {[n.value for n in names]}")

    @property
    def anchor(self) -> PoolName:
        return self.rules[0].pool

    @property
    def owners(self) -> tuple[PoolName, ...]:
        """Pools with their own pages on device and host (the anchor and independent pools)."""
        return tuple(r.pool for r in self.rules if not r.follows_anchor)

    @property
    def names(self) -> tuple[PoolName, ...]:
        return tuple(r.pool for r in self.rules)

    @property
    def is_plain(self) -> bool:
        """Every pool restores all pages: a hit is the leading run of the anchor."""
        return all(r.restore is Restore.ALL_PAGES for r in self.rules)

    def rule(self, pool: PoolName) -> PoolRule:
        for r in self.rules:
            if r.pool is pool:
                return r
        raise ConfigError(f"no rule for pool {shown(pool.value)}: rules cover {list(self.names)}")

    @classmethod
    def from_plan(cls, plan: HostGroupPlan, *, sliding_window: int | None = None) -> GroupRules:
        """Rules of ``plan``. A sliding pool's window (tokens) is the plan's
        (``plan.sliding_window``, from the model spec); ``sliding_window`` sets it for a plan
        without one, and one that differs from the plan's is a ConfigError naming both.

        The window in pages is ceil(window / page size): a boundary is page-aligned, so the
        last ``window`` tokens before it lie in exactly that many pages.
        """
        own = plan.sliding_window
        if sliding_window is not None and own is not None and sliding_window != own:
            raise ConfigError(
                f"CacheSettings.sliding_window={sliding_window} conflicts with the plan's "
                f"sliding window {own} (ModelSpec.sliding_window of {shown(plan.model_type)}): "
                "leave sliding_window=None to use the model's"
            )
        if sliding_window is None:
            sliding_window = own
        anchor = plan.anchor
        rules = [PoolRule(pool=anchor.name, restore=Restore.ALL_PAGES)]
        for p in plan.pools:
            if p is anchor:
                continue
            sidecar = p.role is PoolRole.SIDECAR
            if p.hit_policy is HitPolicy.ALL_PAGES:
                rules.append(
                    PoolRule(pool=p.name, restore=Restore.ALL_PAGES, follows_anchor=sidecar)
                )
            elif p.unit is Unit.SLOT:
                rules.append(PoolRule(pool=p.name, restore=Restore.CHECKPOINT))
            else:
                if sliding_window is None or sliding_window <= 0:
                    raise ConfigError(
                        f"pool {shown(p.name.value)} keeps a sliding window and the plan has none "
                        "(a plan built without a ModelSpec): set CacheSettings(sliding_window="
                        f"tokens) to a positive integer, got {shown(sliding_window)}"
                    )
                pages = math.ceil(sliding_window / anchor.page_size)
                rules.append(
                    PoolRule(
                        pool=p.name,
                        restore=Restore.WINDOW,
                        window_pages=pages,
                        follows_anchor=sidecar,
                    )
                )
        return cls(page_size=anchor.page_size, rules=rules)


Has = Callable[[PoolName, int], bool]


def _leading(pool: PoolName, n: int, has: Has) -> int:
    i = 0
    while i < n and has(pool, i):
        i += 1
    return i


def usable_boundary(rules: GroupRules, n: int, has: Has) -> int:
    """Largest b in [0, n] where every pool restores; ``has(pool, i)``: page i of pool is there.

    ALL_PAGES pools need pages 0..b-1; WINDOW pools the last ``window_pages`` of them (all when
    b is shorter); CHECKPOINT pools a checkpoint on page b-1. O(n) calls of ``has`` per pool.
    """
    if n < 0:
        raise ConfigError(f"page count must be non-negative, got {n}")
    top = n
    for r in rules.rules:
        if r.restore is Restore.ALL_PAGES:
            top = min(top, _leading(r.pool, top, has))
    if top == 0:
        return 0
    windows = [r for r in rules.rules if r.restore is Restore.WINDOW]
    checkpoints = [r.pool for r in rules.rules if r.restore is Restore.CHECKPOINT]
    if not windows and not checkpoints:
        return top
    # run[p][i]: how many consecutive pages of p end at page i (inclusive).
    runs: dict[PoolName, list[int]] = {}
    for r in windows:
        run = [0] * top
        prev = 0
        for i in range(top):
            prev = prev + 1 if has(r.pool, i) else 0
            run[i] = prev
        runs[r.pool] = run
    for b in range(top, 0, -1):
        if any(not has(p, b - 1) for p in checkpoints):
            continue
        if all(runs[r.pool][b - 1] >= min(r.window_pages, b) for r in windows):
            return b
    return 0


def needed_pages(rules: GroupRules, pool: PoolName, boundary: int) -> range:
    """The page indices ``pool`` must restore for a hit of ``boundary`` pages."""
    if boundary <= 0:
        return range(0)
    r = rules.rule(pool)
    if r.restore is Restore.ALL_PAGES:
        return range(boundary)
    if r.restore is Restore.WINDOW:
        return range(max(0, boundary - r.window_pages), boundary)
    return range(boundary - 1, boundary)


@attrs.frozen(kw_only=True)
class CheckpointPolicy:
    """Which boundaries keep a state checkpoint: every ``every_pages`` pages, and the end.

    ``boundaries(n)`` lists them for a request of ``n`` full pages (ascending, no zero).
    """

    every_pages: int = attrs.field(default=8, validator=positive_int)
    at_end: bool = True

    def keeps(self, boundary: int, total_pages: int) -> bool:
        if boundary <= 0 or boundary > total_pages:
            return False
        return boundary % self.every_pages == 0 or (self.at_end and boundary == total_pages)

    def boundaries(self, total_pages: int) -> list[int]:
        out = list(range(self.every_pages, total_pages + 1, self.every_pages))
        if self.at_end and total_pages > 0 and (not out or out[-1] != total_pages):
            out.append(total_pages)
        return out


def has_from_sets(present: Mapping[PoolName, Iterable[int]]) -> Has:
    """A ``has`` predicate over explicit page sets per pool (tests, storage exists answers)."""
    sets = {p: frozenset(v) for p, v in present.items()}
    return lambda pool, i: i in sets.get(pool, frozenset())
