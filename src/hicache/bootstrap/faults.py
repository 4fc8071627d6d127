"""Fault injectors for soak runs and tests: wrappers of the Transfer and Store ports.

- Faults: a thread-safe seeded coin and the count of faults it injected, per kind.
- FaultyTransfer(inner, faults, fail_rate, misroute_rate): a copy (load layer, backup) fails
  with TransferError at ``fail_rate``; at ``misroute_rate`` a load copies from the wrong host
  page (a deliberate bug, to show that a byte check catches it; 0 in a normal soak).
- FaultyStore(inner, faults, rates, corrupt=None): per store call, answers TRANSIENT, FULL or
  FATAL for every key without touching the store, or sleeps past the call's deadline ("slow")
  or a while within it ("stall"); after a put that succeeded, damages the stored object at
  ``corrupt`` rate through the ``corrupt(key)`` callback (bytes flipped on disk); at
  ``damage_read`` rate a page a get read OK has its first byte flipped afterwards, past any
  checksum (a deliberate bug, to show that a byte check catches it; 0 in a normal soak); with
  ``fail_first`` the first call of each operation answers TRANSIENT (a run that makes a call
  at all meets its failure). ``Faults.calls`` counts the calls per operation.
- StoreFaultRates: the per-call probabilities of the store faults.
- directory_corruptor(root): flips the last payload byte of a DirectoryStore object on disk.
- PathReport: what one path of ``hicache bench soak`` (the cache face, the vLLM connector, the
  SGLang backend) reports: ops, faults, errors, leaks, corrupt and checked pages, seconds, and
  per-operation, per-fault and per-error counts.

These are tools for ``hicache bench soak`` and for tests, never for serving.
"""

from __future__ import annotations

import os
import random
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import attrs

from hicache.adapters.storage.delegating import DelegatingStore
from hicache.adapters.storage.directory import SUFFIX, object_name
from hicache.domain import ConfigError, TransferError
from hicache.domain.errors import shown
from hicache.domain.ports import PageMap, Transfer
from hicache.domain.storage import PageBuffer, Store, StoreKey, StoreStatus
from hicache.domain.validators import nonneg_seconds


def _probability(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
        raise ConfigError(f"{name} must be a probability in [0, 1], got {shown(value)}")


def _rate(_inst: object, attribute: attrs.Attribute[float], value: object) -> None:
    _probability(attribute.name, value)


class Faults:
    """A seeded coin shared by the injectors (thread-safe) and the count of injected faults."""

    def __init__(self, seed: int) -> None:
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self.counts: Counter[str] = Counter()
        self.calls: Counter[str] = Counter()  # calls seen per operation (store get, put, ...)

    def roll(self) -> float:
        with self._lock:
            return self._rng.random()

    def note(self, kind: str) -> None:
        with self._lock:
            self.counts[kind] += 1

    def call(self, op: str) -> int:
        """Count one call of ``op``; returns how many came before it."""
        with self._lock:
            seen = self.calls[op]
            self.calls[op] += 1
            return seen

    @property
    def total(self) -> int:
        return sum(self.counts.values())


class FaultyTransfer:
    """The Transfer port over another, with injected copy failures (see the module docstring)."""

    def __init__(
        self,
        inner: Transfer,
        faults: Faults,
        *,
        fail_rate: float = 0.0,
        misroute_rate: float = 0.0,
    ) -> None:
        _probability("fail_rate", fail_rate)
        _probability("misroute_rate", misroute_rate)
        self.inner = inner
        self.faults = faults
        self.fail_rate = fail_rate
        self.misroute_rate = misroute_rate

    @property
    def transfer_layers(self) -> int:
        return self.inner.transfer_layers

    def _maybe_fail(self, what: str) -> None:
        if self.fail_rate and self.faults.roll() < self.fail_rate:
            self.faults.note(f"copy_{what}")
            raise TransferError(f"injected {what} copy fault")

    def _misroute(self, maps: Sequence[PageMap]) -> Sequence[PageMap]:
        if not self.misroute_rate or self.faults.roll() >= self.misroute_rate:
            return maps
        self.faults.note("copy_misroute")
        out = []
        for m in maps:
            host = m.host_pages
            # Read the neighbouring host page instead: what an off-by-one in a copy plan does.
            out.append(PageMap(m.pool, tuple(h ^ 1 for h in host), m.device_pages))
        return out

    def load_layer(self, layer: int, maps: Sequence[PageMap]) -> int:
        self._maybe_fail("load")
        return self.inner.load_layer(layer, self._misroute(maps))

    def backup(self, maps: Sequence[PageMap]) -> int:
        self._maybe_fail("backup")
        return self.inner.backup(maps)

    def backup_layer(self, layer: int, maps: Sequence[PageMap]) -> int:
        self._maybe_fail("backup")
        return self.inner.backup_layer(layer, maps)

    def layer_bytes(self, layer: int, maps: Sequence[PageMap]) -> int:
        return self.inner.layer_bytes(layer, maps)

    def close(self) -> None:
        close = getattr(self.inner, "close", None)
        if callable(close):
            close()


@attrs.frozen(kw_only=True)
class StoreFaultRates:
    """Probabilities per store call (get / put / exists) of each injected fault."""

    transient: float = attrs.field(default=0.0, validator=_rate)
    full: float = attrs.field(default=0.0, validator=_rate)
    fatal: float = attrs.field(default=0.0, validator=_rate)
    slow: float = attrs.field(default=0.0, validator=_rate)
    corrupt: float = attrs.field(default=0.0, validator=_rate)
    slow_s: float = attrs.field(default=0.03, validator=nonneg_seconds)  # finite, <= 1e6
    # a stall: the call sleeps stall_s (capped to end before its deadline), then goes through
    stall: float = attrs.field(default=0.0, validator=_rate)
    stall_s: float = attrs.field(default=0.01, validator=nonneg_seconds)
    damage_read: float = attrs.field(default=0.0, validator=_rate)  # a deliberate bug
    # the first call of each operation (exists, get, put) answers TRANSIENT, so a run that
    # makes the call at all exercises its failure path whatever the coin gives
    fail_first: bool = attrs.field(default=False, validator=attrs.validators.instance_of(bool))


class FaultyStore(DelegatingStore):
    """The Store port over another, with injected faults (see the module docstring)."""

    def __init__(
        self,
        inner: Store,
        faults: Faults,
        rates: StoreFaultRates,
        *,
        corrupt: Callable[[StoreKey], bool] | None = None,
    ) -> None:
        super().__init__(inner)
        self.faults = faults
        self.rates = rates
        self._corrupt = corrupt

    @property
    def name(self) -> str:
        return f"faulty-{self.inner.name}"

    def _status(self, op: str, deadline: float | None) -> StoreStatus | None:
        r = self.rates
        if self.faults.call(f"store_{op}") == 0 and r.fail_first:
            self.faults.note(f"store_{op}_first")
            return StoreStatus.TRANSIENT
        x = self.faults.roll()
        for kind, rate, status in (
            ("transient", r.transient, StoreStatus.TRANSIENT),
            ("fatal", r.fatal, StoreStatus.FATAL),
            ("full", r.full if op == "put" else 0.0, StoreStatus.FULL),
        ):
            if x < rate:
                self.faults.note(f"store_{op}_{kind}")
                return status
            x -= rate
        if x < r.slow and deadline is not None:
            self.faults.note(f"store_{op}_slow")
            time.sleep(max(0.0, deadline - time.monotonic()) + r.slow_s)
            return None
        x -= r.slow
        if x < r.stall:
            self.faults.note(f"store_{op}_stall")
            left = r.stall_s if deadline is None else (deadline - time.monotonic()) / 2
            time.sleep(max(0.0, min(r.stall_s, left)))
        return None

    def exists(self, keys: Sequence[StoreKey], *, deadline: float | None = None) -> list[bool]:
        if self._status("exists", deadline) is not None:
            return [False] * len(keys)
        return self.inner.exists(keys, deadline=deadline)

    def get(
        self,
        keys: Sequence[StoreKey],
        buffers: Sequence[PageBuffer],
        *,
        deadline: float | None = None,
    ) -> list[StoreStatus]:
        status = self._status("get", deadline)
        if status is not None:
            return [status] * len(keys)
        out = self.inner.get(keys, buffers, deadline=deadline)
        if self.rates.damage_read:
            for st, buffer in zip(out, buffers, strict=True):
                if st.ok and buffer and self.faults.roll() < self.rates.damage_read:
                    view = buffer[0].cast("B")  # a page buffer: memoryview segments
                    view[0] ^= 0xFF
                    self.faults.note("store_damage_read")
        return out

    def put(
        self,
        keys: Sequence[StoreKey],
        buffers: Sequence[PageBuffer],
        *,
        deadline: float | None = None,
    ) -> list[StoreStatus]:
        status = self._status("put", deadline)
        if status is not None:
            return [status] * len(keys)
        out = self.inner.put(keys, buffers, deadline=deadline)
        if self._corrupt is not None and self.rates.corrupt:
            for key, st in zip(keys, out, strict=True):
                if (
                    st is StoreStatus.OK
                    and self.faults.roll() < self.rates.corrupt
                    and self._corrupt(key)
                ):
                    self.faults.note("store_corrupt")
        return out


def directory_corruptor(root: str | Path) -> Callable[[StoreKey], bool]:
    """A ``corrupt`` callback for a DirectoryStore at ``root``: flip its object's last byte."""
    base = Path(root)

    def corrupt(key: StoreKey) -> bool:
        name = object_name(key)
        path = base / name[:2] / f"{name}{SUFFIX}"
        try:
            with open(path, "r+b") as f:
                f.seek(-1, os.SEEK_END)
                byte = f.read(1)
                f.seek(-1, os.SEEK_END)
                f.write(bytes([byte[0] ^ 0xFF]))
        except (OSError, ValueError):
            return False
        return True

    return corrupt


@attrs.frozen(kw_only=True)
class PathReport:
    """One soak path's outcome. ``errors``: exceptions where the call should have been served;
    ``leaks``: slots, pins, held blocks or pending transfers left once the path is idle;
    ``corrupt_pages``: pages read back with bytes other than those saved for their key;
    ``checked_pages``: pages compared byte by byte; ``details``: the path's own breakdown."""

    path: str
    ops: int
    faults: int
    errors: int
    leaks: int
    corrupt_pages: int
    checked_pages: int
    seconds: float
    operations: dict[str, int]
    fault_kinds: dict[str, int]
    error_kinds: dict[str, int]
    error_samples: list[str]
    details: dict[str, Any] = attrs.field(factory=dict)

    @property
    def clean(self) -> bool:
        return not (self.errors or self.leaks or self.corrupt_pages)

    def as_json(self) -> dict[str, Any]:
        return attrs.asdict(self)


__all__ = [
    "Faults",
    "FaultyStore",
    "FaultyTransfer",
    "PathReport",
    "StoreFaultRates",
    "directory_corruptor",
]
