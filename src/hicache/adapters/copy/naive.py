"""The peer method, kept as the reference point of `hicache bench copy`.

- NaiveBackend ("naive"): one ``copy_`` per buffer per layer per page, as serving engines issue
  them one page at a time; about 4 us of Python and dispatch per copy on the development machine.
"""

from __future__ import annotations

from collections.abc import Sequence

from hicache.adapters.copy.base import Backend
from hicache.adapters.copy.pairs import PageSet


class NaiveBackend(Backend):
    name = "naive"

    def load(self, layer: int, pages: PageSet) -> None:
        pairs = tuple(zip(pages.map.host_pages, pages.map.device_pages, strict=True))
        for bp in self.pair.buffers:
            src, dst = bp.host[layer], bp.device[layer]
            nb = not bp.on_cpu
            for h, d in pairs:
                dst[d].copy_(src[h], non_blocking=nb)

    def backup(self, layers: Sequence[int] | None, pages: PageSet) -> None:
        pairs = tuple(zip(pages.map.host_pages, pages.map.device_pages, strict=True))
        todo = range(self.pair.plan.layers) if layers is None else layers
        for bp in self.pair.buffers:
            nb = not bp.on_cpu
            for layer in todo:
                src, dst = bp.device[layer], bp.host[layer]
                for h, d in pairs:
                    dst[h].copy_(src[d], non_blocking=nb)
