"""A DirectoryStore whose reads a test can break from another process (flag files).

Loaded by HiCacheConnector through hicache's "dynamic" storage backend
(``module_path`` = this module, ``class_name`` = "FaultyStore"); ``flags_dir`` names a folder:
- ``fail_after`` (a number n): keys after the first n of a get answer TRANSIENT (a store fault
  in the middle of a load);
- ``corrupt``: every page read OK has its bytes scrambled after the checksum passed (damage the
  checksum cannot see: the output must change, which proves the loaded KV is used); the text
  ``1`` zeroes every third byte of every page, ``kv`` or ``state`` zeroes the whole pages of
  that kind only (a hybrid model's KV blocks or its states);
- ``lose``: lines ``pool-prefix:page-hash``: the store deletes each matching object the next
  time the connector asks for it (exists or get), before answering (a lost object);
- ``hang``: while this file exists, every exists / get / put (the text ``get``: every get only)
  waits, ignoring its deadline, at most ``HANG_MAX_S`` (a store that hangs: the connector must
  not).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from hicache.adapters.storage import DirectorySettings, DirectoryStore
from hicache.domain.storage import PageBuffer, StoreKey, StoreStatus
from tests.storage.fakes import damage_read, fail_after_first

HANG_MAX_S = 600.0


class FaultyStore(DirectoryStore):
    def __init__(self, config: Mapping[str, Any]) -> None:
        cfg = dict(config)
        self.flags = Path(cfg.pop("flags_dir"))
        super().__init__(DirectorySettings.from_config(cfg))

    def _hang(self, op: str) -> None:
        until = time.monotonic() + HANG_MAX_S
        while time.monotonic() < until:
            try:
                what = (self.flags / "hang").read_text().strip()
            except FileNotFoundError:
                return
            if what == "get" and op != "get":
                return
            time.sleep(0.05)

    def _lose(self, keys: Sequence[StoreKey]) -> None:
        try:
            lines = (self.flags / "lose").read_text().split()
        except FileNotFoundError:
            return
        lost = [tuple(line.split(":", 1)) for line in lines]
        gone = [k for k in keys if any(k.pool.startswith(p) and k.page_hash == h for p, h in lost)]
        if gone:
            self.remove(gone)

    def exists(self, keys: Sequence[StoreKey], *, deadline: float | None = None) -> list[bool]:
        self._hang("exists")
        self._lose(keys)
        return super().exists(keys, deadline=deadline)

    def put(
        self,
        keys: Sequence[StoreKey],
        buffers: Sequence[PageBuffer],
        *,
        deadline: float | None = None,
    ) -> list[StoreStatus]:
        self._hang("put")
        return super().put(keys, buffers, deadline=deadline)

    def get(
        self,
        keys: Sequence[StoreKey],
        buffers: Sequence[PageBuffer],
        *,
        deadline: float | None = None,
    ) -> list[StoreStatus]:
        self._hang("get")
        self._lose(keys)
        statuses = super().get(keys, buffers, deadline=deadline)
        fail = self.flags / "fail_after"
        if fail.exists():
            statuses = fail_after_first(statuses, int(fail.read_text()), StoreStatus.TRANSIENT)
        corrupt = self.flags / "corrupt"
        if corrupt.exists():
            damage_read(keys, statuses, buffers, _scrambler(corrupt.read_text().strip()))
        return statuses


def _scrambler(mode: str) -> Callable[[StoreKey, PageBuffer], None]:
    """The ``corrupt`` flag's damage: ``1`` zeroes every third byte of every page; ``kv`` or
    ``state`` zeroes the whole pages of that kind only."""

    def scramble(key: StoreKey, buffer: PageBuffer) -> None:
        for seg in buffer:
            if mode == "1":
                seg[::3] = bytes(len(seg[::3]))
            elif key.pool.startswith(mode):
                seg[:] = bytes(len(seg))

    return scramble
