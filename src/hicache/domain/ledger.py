"""The transfer ledger: slots, pins and operation states of loads and backups, sans I/O.

- Phase: queued, running, done, failed, cancelled (``finished`` for the last three).
- PinTableKind: the four pin tables an operation uses (host, device, host writes, device writes).
- Pin / Unpin / Free: the actions the ledger hands back; the caller applies them to its pin
  tables and allocators, in order.
- LedgerError: an illegal transition; the message names the operation, its phase and the fact.
- Ledger: facts in (prepared, joined, submitted, finished, stopped, handle dropped), actions out.
  A load pins its host pages (read) and its device pages (read and written); a backup its device
  pages (read) and its host pages (read and written). On success the pins drop and allocated
  pages become the caller's; on failure or cancellation the pins drop and allocated pages are
  freed. Nothing here blocks, copies, logs or reads a clock (like h11 for HTTP).
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence

import attrs

from hicache.domain.errors import HiCacheError
from hicache.domain.pools import PoolName

Pages = Mapping[PoolName, Sequence[int]]


class Phase(enum.Enum):
    QUEUED = "queued"
    RUNNING = "running"
    DONE = "done"
    FAILED = "failed"
    CANCELLED = "cancelled"

    @property
    def finished(self) -> bool:
        return self in (Phase.DONE, Phase.FAILED, Phase.CANCELLED)


class PinTableKind(enum.Enum):
    HOST = "host pins"
    DEVICE = "device pins"
    HOST_WRITES = "host writes"
    DEVICE_WRITES = "device writes"


class Side(enum.Enum):
    HOST = "host"
    DEVICE = "device"


@attrs.frozen
class Pin:
    table: PinTableKind
    pages: Pages


@attrs.frozen
class Unpin:
    table: PinTableKind
    pages: Pages


@attrs.frozen
class Free:
    side: Side
    pages: Pages


Action = Pin | Unpin | Free


class LedgerError(HiCacheError):
    """A fact that the operation's phase does not allow (a bug in the caller, never input)."""


@attrs.define
class _Record:
    load: bool
    host: Pages
    device: Pages
    allocated_host: bool
    allocated_device: bool
    phase: Phase = Phase.QUEUED
    refs: int = 1
    stopping: bool = False

    def tables(self) -> list[tuple[PinTableKind, Pages]]:
        writes = (
            (PinTableKind.DEVICE_WRITES, self.device)
            if self.load
            else (PinTableKind.HOST_WRITES, self.host)
        )
        return [(PinTableKind.HOST, self.host), (PinTableKind.DEVICE, self.device), writes]


class Ledger:
    """Operations in flight and what each fact about them takes or gives back."""

    def __init__(self) -> None:
        self._ops: dict[int, _Record] = {}

    # -- questions -------------------------------------------------------------------------------
    def phase(self, op: int) -> Phase:
        return self._get(op, "phase").phase

    def refs(self, op: int) -> int:
        return self._get(op, "refs").refs

    def open_operations(self) -> frozenset[int]:
        """Operations not finished yet (finished ones are forgotten)."""
        return frozenset(self._ops)

    # -- facts -----------------------------------------------------------------------------------
    def prepared(
        self,
        op: int,
        *,
        load: bool,
        host: Pages,
        device: Pages,
        allocated_host: bool = False,
        allocated_device: bool = False,
    ) -> list[Action]:
        """A load (``load=True``) or backup was prepared: pin what it touches."""
        if op in self._ops:
            raise LedgerError(f"operation #{op} is already {self._ops[op].phase.value}")
        record = _Record(load, host, device, allocated_host, allocated_device)
        self._ops[op] = record
        return [Pin(table, pages) for table, pages in record.tables()]

    def joined(self, op: int) -> int:
        """Another handle shares the operation; returns its handle count."""
        record = self._expect(op, "join", Phase.QUEUED, Phase.RUNNING)
        if record.stopping:
            raise LedgerError(
                f"operation #{op} is {record.phase.value} and being cancelled: cannot join it"
            )
        record.refs += 1
        return record.refs

    def submitted(self, op: int) -> None:
        self._expect(op, "submit", Phase.QUEUED).phase = Phase.RUNNING

    def handle_dropped(self, op: int) -> int:
        """A handle gave the operation up; returns how many handles still hold it."""
        record = self._expect(op, "drop a handle of", Phase.QUEUED, Phase.RUNNING)
        if record.refs == 0:
            raise LedgerError(f"operation #{op} ({record.phase.value}) has no handle left")
        record.refs -= 1
        if record.refs == 0 and record.phase is Phase.RUNNING:
            record.stopping = True
        return record.refs

    def cancelled_queued(self, op: int) -> list[Action]:
        """A queued operation is given up (no handle left, or the engine closed)."""
        record = self._expect(op, "cancel", Phase.QUEUED)
        return self._end(op, record, Phase.CANCELLED)

    def finished(self, op: int, *, failed: bool) -> list[Action]:
        """A running operation's copies all finished (``failed``: one of them failed)."""
        record = self._expect(op, "finish", Phase.RUNNING)
        if record.stopping:
            raise LedgerError(
                f"operation #{op} is {record.phase.value} and being cancelled: cannot finish it "
                f"(it ends with stopped())"
            )
        return self._end(op, record, Phase.FAILED if failed else Phase.DONE)

    def stopped(self, op: int, *, failed: bool) -> list[Action]:
        """A running operation that lost its last handle has no copy left in flight."""
        record = self._expect(op, "stop", Phase.RUNNING)
        if not record.stopping:
            raise LedgerError(
                f"operation #{op} is {record.phase.value} with {record.refs} handle(s): cannot "
                f"stop it (only once its last handle dropped or the engine closes)"
            )
        return self._end(op, record, Phase.FAILED if failed else Phase.CANCELLED)

    def closing(self, op: int) -> None:
        """The engine closes: a running operation is stopped whatever its handles."""
        record = self._expect(op, "close", Phase.RUNNING)
        record.stopping = True

    # -- internals -------------------------------------------------------------------------------
    def _end(self, op: int, record: _Record, phase: Phase) -> list[Action]:
        record.phase = phase
        del self._ops[op]
        actions: list[Action] = [Unpin(table, pages) for table, pages in record.tables()]
        if phase is not Phase.DONE:
            if record.allocated_device:
                actions.append(Free(Side.DEVICE, record.device))
            if record.allocated_host:
                actions.append(Free(Side.HOST, record.host))
        return actions

    def _get(self, op: int, what: str) -> _Record:
        record = self._ops.get(op)
        if record is None:
            raise LedgerError(f"operation #{op} is unknown or finished: cannot {what} it")
        return record

    def _expect(self, op: int, fact: str, *phases: Phase) -> _Record:
        record = self._get(op, fact)
        if record.phase not in phases:
            allowed = " or ".join(p.value for p in phases)
            raise LedgerError(
                f"operation #{op} is {record.phase.value}: cannot {fact} it (only when {allowed})"
            )
        return record

    def __len__(self) -> int:
        return len(self._ops)

    def __repr__(self) -> str:
        return f"<Ledger: {len(self._ops)} operation(s) open>"


__all__ = [
    "Action",
    "Free",
    "Ledger",
    "LedgerError",
    "Phase",
    "Pin",
    "PinTableKind",
    "Side",
    "Unpin",
]
