"""The face's view of a group's GroupRules for hits.

- HitRules(rules): the slot-owning pool of every pool, ``boundary(n, at, fallback)`` (the
  longest prefix every pool can restore from those placements) and ``needed(boundary)`` (the
  owner pools page i must restore).
"""

from __future__ import annotations

from collections.abc import Sequence

from hicache.domain.hybrid import GroupRules, Restore, needed_pages, usable_boundary
from hicache.domain.pools import PoolName
from hicache.domain.tiers import Placement


class HitRules:
    """Boundaries and needed pools of hits under one group's GroupRules."""

    def __init__(self, rules: GroupRules) -> None:
        self.rules = rules
        self.owner = {r.pool: (rules.anchor if r.follows_anchor else r.pool) for r in rules.rules}
        self.single_owner = len(rules.owners) == 1

    def boundary(
        self,
        n: int,
        at: Sequence[Placement | None],
        fallback: Sequence[Placement | None] | None,
    ) -> int:
        """The longest prefix of ``n`` pages every pool restores from ``at`` (else
        ``fallback``)."""
        owner = self.owner

        def has(pool: PoolName, i: int) -> bool:
            where = at[i]
            if where is not None and owner[pool] in where:
                return True
            if fallback is None:
                return False
            other = fallback[i]
            return other is not None and owner[pool] in other

        return usable_boundary(self.rules, n, has)

    def needed(self, boundary: int) -> list[frozenset[PoolName]]:
        """The slot-owning pools page i must restore for a hit of ``boundary`` pages."""
        rules = self.rules
        base = frozenset(self.owner[r.pool] for r in rules.rules if r.restore is Restore.ALL_PAGES)
        out = [base] * boundary
        for r in rules.rules:
            if r.restore is not Restore.ALL_PAGES:
                for i in needed_pages(rules, r.pool, boundary):
                    out[i] = out[i] | {self.owner[r.pool]}
        return out


__all__ = ["HitRules"]
