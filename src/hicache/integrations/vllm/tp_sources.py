"""The scheduler side's look for pages a server of another tensor parallel size stored (no torch,
no vLLM).

- reader_keys(namespace, ranks, heads): the store keys function of the scheduler's storage tier:
  a plain page key names every rank's object at this server's size (as before); a key tagged
  with a writer size (tp_plan.writer_tag) names the objects this server's ranks need from a
  server of that size (one replica of each head; rank 0's alone for MLA).
- WriterProbe(tier, ranks, heads).leading(keys): the leading run of ``keys`` held in the
  store, for each page the writer size to read it from, and whether every call answered. Pages of this server's own size are
  looked for first, with one bounded ``exists`` over the run (what a server that never reads
  across sizes does); where that run stops, one bounded ``exists_each`` asks which other
  candidate size (tp_plan.candidate_writers: the usual sizes that fit the model's KV heads)
  holds the next page, and the run goes on under that size. At most ``MAX_SWITCHES`` changes
  of size per lookup, so a lookup makes at most 2 x (MAX_SWITCHES + 1) store calls, each
  bounded by the tier (a hung store is a miss).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from hicache.domain.storage import StoreKey
from hicache.engine.bounded import BoundedTier
from hicache.integrations.vllm.plan import store_key
from hicache.integrations.vllm.stats import ConnectorStats
from hicache.integrations.vllm.tp_plan import TpHeads, tagged, untag, writer_tag

MAX_SWITCHES = 3


def reader_keys(
    namespace: str, ranks: int, heads: TpHeads | None
) -> Callable[[bytes], list[StoreKey]]:
    """The scheduler's keys function (see the module docstring)."""

    def keys(page: bytes) -> list[StoreKey]:
        kind, writers, _, raw = untag(page)
        if kind == "all" and heads is not None:
            return [store_key(namespace, 0, tagged(writers, r, raw)) for r in heads.needed(writers)]
        return [store_key(namespace, r, page, ranks) for r in range(ranks)]

    return keys


class WriterProbe:
    """Finds which server size stored each page of a run (see the module docstring)."""

    def __init__(
        self, tier: BoundedTier, ranks: int, heads: TpHeads, stats: ConnectorStats
    ) -> None:
        self.tier = tier
        self.ranks = ranks
        self.sizes = heads.candidates(ranks)  # this server's own size first
        self.stats = stats
        self._unanswered = False

    def _key(self, writers: int, key: bytes) -> bytes:
        return key if writers == self.ranks else writer_tag(writers, key)

    def _run(self, writers: int, keys: Sequence[bytes]) -> int:
        answer = self.tier.exists([self._key(writers, k) for k in keys])
        if not answer.answered:
            self.stats.error("exists", answer.outcome.value)
            self._unanswered = True
        return answer.value

    def _holder(self, key: bytes, but: int) -> int | None:
        """The first size other than ``but`` whose objects of page ``key`` are all stored."""
        sizes = [n for n in self.sizes if n != but]
        if not sizes:
            return None
        answer = self.tier.exists_each([self._key(n, key) for n in sizes])
        if not answer.answered:
            self.stats.error("exists", answer.outcome.value)
            self._unanswered = True
        return next((n for n, ok in zip(sizes, answer.value, strict=True) if ok), None)

    def leading(self, keys: Sequence[bytes]) -> tuple[list[int], bool]:
        """The writer size of each page of the leading run of ``keys`` the store holds, and
        whether every store call answered (else the run may stop early)."""
        self._unanswered = False
        out: list[int] = []
        writers = self.ranks
        for _ in range(MAX_SWITCHES + 1):
            n = self._run(writers, keys[len(out) :])
            out.extend([writers] * n)
            if len(out) >= len(keys):
                break
            found = self._holder(keys[len(out)], writers)
            if found is None:
                break
            writers = found
        return out, not self._unanswered


__all__ = ["MAX_SWITCHES", "WriterProbe", "reader_keys"]
