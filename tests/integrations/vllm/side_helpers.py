"""SchedulerSide test helpers: a block size, a store stand-in that only answers ``exists``,
store keys per rank, a SchedulerSide builder and one full prefill step."""

from __future__ import annotations

from collections.abc import Sequence

from hicache.domain.storage import StoreKey
from hicache.engine.bounded import BoundedStorage
from hicache.integrations.vllm.plan import Event, Op
from hicache.integrations.vllm.scheduler import Scheduled, SchedulerSide
from hicache.integrations.vllm.stats import ConnectorStats

BS = 4


class Exists:
    """A store stand-in: only ``exists`` is asked by the scheduler side."""

    def __init__(self) -> None:
        self.held: set[str] = set()

    def exists(self, keys: Sequence[StoreKey], *, deadline: float | None = None) -> list[bool]:
        return [str(k) in self.held for k in keys]

    name = "exists"

    def close(self) -> None:
        pass


def store_keys(ranks: int):  # type: ignore[no-untyped-def]
    def keys(page: bytes) -> list[StoreKey]:
        return [
            StoreKey(namespace="t", pool=f"kv-r{r}", page_hash=page.hex()) for r in range(ranks)
        ]

    return keys


def side(
    *, store: Exists | None = None, ranks: int = 1, slots: int = 16, decode: bool = True
) -> SchedulerSide:
    return SchedulerSide(
        block_size=BS,
        host_slots=slots,
        store=BoundedStorage(store) if store is not None else None,  # type: ignore[arg-type]
        store_keys=store_keys(ranks),
        write_storage=store is not None,
        save_decode=decode,
        ranks=ranks,
        stats=ConnectorStats(),
    )


def prefill(s: SchedulerSide, rid: str, tokens: list[int], blocks: list[int]) -> list[Event]:
    """Run one full prefill step of ``tokens`` and report every save done on every rank."""
    s.match(rid, tokens, 0)
    plan = s.build([Scheduled(rid, tokens, 0, len(tokens))], lambda _r: blocks)
    return [Event(Op.SAVE, op.key, True) for op in plan.saves]


PROMPT = list(range(1, 18))  # 4 full blocks and 1 token
