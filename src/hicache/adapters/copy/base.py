"""The interface every copy backend implements for one pool (host pool <-> device pool).

- Backend: load one pool layer (host to device) or back up pool layers (device to host) for a
  checked PageSet; constructed once per pool of a transfer, so it can precompute and preallocate.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from typing import ClassVar

from hicache.adapters.copy.pairs import PageSet, PoolPair


class Backend(abc.ABC):
    """Copies the pages of one pool between its host and device buffers."""

    name: ClassVar[str]

    def __init__(self, pair: PoolPair) -> None:
        self.pair = pair

    @abc.abstractmethod
    def load(self, layer: int, pages: PageSet) -> None:
        """Host to device: pool layer ``layer`` of every buffer, for ``pages``."""

    @abc.abstractmethod
    def backup(self, layers: Sequence[int] | None, pages: PageSet) -> None:
        """Device to host: the given pool layers (None: all of them) of every buffer."""

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name} for pool {self.pair.name.value}>"
