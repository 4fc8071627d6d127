"""The scheduler harness's store: hicache's DirectoryStore as a "dynamic" plug-in a test steers.

- StoreControl: what a test steers (hold reads, fail reads, fail lookups) and what the store saw
  (gets, pages read and written); ``wait_idle`` waits until no get or put runs.
- HarnessStore: the DirectoryStore both connector roles open (``module_path`` this module,
  ``class_name`` "HarnessStore"); its extra config's ``harness_id`` names its StoreControl.
- register(control) / unregister(id): the process-wide table the ids resolve in.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from hicache.adapters.storage import DirectorySettings, DirectoryStore
from hicache.domain.storage import PageBuffer, StoreKey, StoreStatus
from tests.storage.fakes import fail_after_first


@attrs.define(eq=False)
class StoreControl:
    """What a test steers in HarnessStore, and what the store saw (all of its instances: the
    scheduler role and the worker role each open one)."""

    reads_open: threading.Event = attrs.field(factory=threading.Event)
    fail_reads: bool = False
    fail_reads_after: int | None = None  # pages after the first n of each get fail
    fail_exists: bool = False
    gets: int = 0  # get calls (each a batch of pages)
    pages_read: int = 0
    pages_written: int = 0
    _busy: int = 0
    _lock: threading.Lock = attrs.field(factory=threading.Lock)
    _idle: threading.Condition = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        self.reads_open.set()
        self._idle = threading.Condition(self._lock)

    def hold_reads(self) -> None:
        """Reads block until ``release_reads`` (a pending asynchronous load)."""
        self.reads_open.clear()

    def release_reads(self) -> None:
        self.reads_open.set()

    def enter(self) -> None:
        with self._lock:
            self._busy += 1

    def leave(self) -> None:
        with self._lock:
            self._busy -= 1
            self._idle.notify_all()

    def wait_idle(self, timeout: float = 10.0) -> bool:
        """True once no get or put runs (False after ``timeout`` seconds)."""
        with self._lock:
            return self._idle.wait_for(lambda: self._busy == 0, timeout)


_CONTROLS: dict[str, StoreControl] = {}
HOLD_LIMIT_S = 30.0  # a held read gives up after this (a test that forgot to release)


class HarnessStore(DirectoryStore):
    """hicache's DirectoryStore, steered by the StoreControl its ``harness_id`` names."""

    def __init__(self, config: Mapping[str, Any]) -> None:
        cfg = dict(config)
        self.control = _CONTROLS[cfg.pop("harness_id")]
        super().__init__(DirectorySettings.from_config(cfg))

    def exists(self, keys: Sequence[StoreKey], *, deadline: float | None = None) -> list[bool]:
        if self.control.fail_exists:
            raise OSError("harness: exists fails")
        return super().exists(keys, deadline=deadline)

    def get(
        self,
        keys: Sequence[StoreKey],
        buffers: Sequence[PageBuffer],
        *,
        deadline: float | None = None,
    ) -> list[StoreStatus]:
        c = self.control
        c.enter()
        try:
            c.reads_open.wait(HOLD_LIMIT_S)
            c.gets += 1
            statuses = super().get(keys, buffers, deadline=deadline)
            if c.fail_reads:
                return [StoreStatus.TRANSIENT] * len(keys)
            if c.fail_reads_after is not None:
                statuses = fail_after_first(statuses, c.fail_reads_after, StoreStatus.TRANSIENT)
            c.pages_read += sum(1 for s in statuses if s.ok)
            return statuses
        finally:
            c.leave()

    def put(
        self,
        keys: Sequence[StoreKey],
        buffers: Sequence[PageBuffer],
        *,
        deadline: float | None = None,
    ) -> list[StoreStatus]:
        c = self.control
        c.enter()
        try:
            statuses = super().put(keys, buffers, deadline=deadline)
            c.pages_written += sum(1 for s in statuses if s.ok)
            return statuses
        finally:
            c.leave()


def register(control: StoreControl) -> str:
    """A new id under which HarnessStore finds ``control``."""
    key = uuid.uuid4().hex
    _CONTROLS[key] = control
    return key


def unregister(key: str) -> None:
    _CONTROLS.pop(key, None)
