"""The portable batched backend: torch only, no compiler, every device torch supports.

- TorchBackend ("torch"): per buffer, one of two paths, chosen from the pages of the call:
  * runs: pages consecutive on both sides form one run and one copy; all runs of a call go out
    in one ``torch._foreach_copy_`` (CPU) or as ``copy_(non_blocking=True)`` between pinned host
    views and device tensors (GPU); an all-layer backup of a device pool whose layers share one
    allocation copies each run as one strided slab moving every layer at once;
  * staged (CPU only): when runs are short (under RUN_BYTES_DIRECT bytes on average), a gather
    and a scatter with index_select(out=) / index_copy_ through a staging buffer that is
    allocated once and grown, never per call: a constant number of calls per layer whatever the
    number of pages. On a GPU every call takes the runs path: a staged copy there would have to
    wait on the host (for the staging to drain, or for the bytes to arrive before scattering),
    and copies are issued from the engine's event-loop thread, which must never block.
- GPU pieces: torch copies a non-contiguous pinned host view (a run of page_first,
  page_first_direct over several pages, or page_head) through an unpinned contiguous temporary,
  synchronously, blocking the calling thread. So on a GPU each run is split, on both sides in
  lockstep, into the largest views that are contiguous on both (whole runs where the layout
  allows, else a page of a layer, else a token row or a head row), and each piece goes out as
  ``copy_(non_blocking=True)`` straight from the pinned pool: nothing waits on the host.

Each instance keeps one staging per direction: run at most one load and one backup at a time
per instance (the engine has one copy worker per direction).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from hicache.adapters.copy.base import Backend
from hicache.adapters.copy.pairs import BufferPair, PageSet, PoolPair
from hicache.domain import TransferError

# Average bytes per run (per buffer, per layer) from which one copy per run is used instead of
# the staged gather/scatter. Measured with `hicache bench copy --backend torch`: at 16 KiB the
# two are level for per-layer loads while per-run all-layer slabs make backups 2-2.5x faster;
# below it the staged path wins (5x the naive method at 1 KiB pages) (docs/copy.md).
RUN_BYTES_DIRECT = 16 * 1024


class TorchBackend(Backend):
    name = "torch"

    def __init__(self, pair: PoolPair) -> None:
        super().__init__(pair)
        self.device = pair.device_pool.device
        self.on_cpu = self.device.type == "cpu"
        self._staging: dict[tuple[str, str], torch.Tensor] = {}

    # -- path choice --------------------------------------------------------------------------

    def _direct(self, bp: BufferPair, pages: PageSet) -> bool:
        if not self.on_cpu:
            return True  # never a host-side wait on a GPU (see the module docstring)
        runs = len(pages.runs()[0])
        return pages.count * bp.page_bytes >= RUN_BYTES_DIRECT * runs

    def _indices(self, pages: PageSet) -> tuple[torch.Tensor, torch.Tensor]:
        """(host page ids, device page ids) as int64 CPU tensors, for the staged path."""
        return pages.tensor("host"), pages.tensor("device")

    def _stage(self, direction: str, bp: BufferPair, n: int) -> torch.Tensor:
        """A (n, P, *row) host staging view, grown when needed, never allocated per call."""
        key = (direction, bp.name)
        need = n * bp.page_bytes
        buf = self._staging.get(key)
        if buf is None or buf.numel() < need:
            size = max(need, 0 if buf is None else buf.numel() * 3 // 2)
            buf = torch.empty(size, dtype=torch.uint8)
            buf.fill_(0)  # fault it in now, not during a copy
            self._staging[key] = buf
        shape = (n, *bp.device[0].shape[1:])
        return buf[:need].view(bp.device[0].dtype).view(shape)

    # -- load ---------------------------------------------------------------------------------

    def load(self, layer: int, pages: PageSet) -> None:
        dst: list[torch.Tensor] = []
        src: list[torch.Tensor] = []
        for bp in self.pair.buffers:
            if self._direct(bp, pages):
                hs, ds, ns = pages.run_lists()
                h, d = bp.host[layer], bp.device[layer]
                dst.extend(d[b : b + n] for b, n in zip(ds, ns, strict=True))
                src.extend(h[a : a + n] for a, n in zip(hs, ns, strict=True))
            else:
                self._load_staged(bp, layer, pages)
        self._issue(dst, src)

    def _load_staged(self, bp: BufferPair, layer: int, pages: PageSet) -> None:
        hidx, didx = self._indices(pages)
        stage = self._stage("load", bp, pages.count)
        torch.index_select(bp.host[layer], 0, hidx, out=stage)
        bp.device[layer].index_copy_(0, didx, stage)

    # -- backup -------------------------------------------------------------------------------

    def backup(self, layers: Sequence[int] | None, pages: PageSet) -> None:
        dst: list[torch.Tensor] = []
        src: list[torch.Tensor] = []
        for bp in self.pair.buffers:
            todo = range(bp.layers) if layers is None else layers
            if not self._direct(bp, pages):
                for layer in todo:
                    self._backup_staged(bp, layer, pages)
                continue
            hs, ds, ns = pages.run_lists()
            if layers is None and bp.device_all is not None:
                h_all, d_all = bp.host, bp.device_all
                dst.extend(h_all[:, a : a + n] for a, n in zip(hs, ns, strict=True))
                src.extend(d_all[:, b : b + n] for b, n in zip(ds, ns, strict=True))
                continue
            for layer in todo:
                h, d = bp.host[layer], bp.device[layer]
                dst.extend(h[a : a + n] for a, n in zip(hs, ns, strict=True))
                src.extend(d[b : b + n] for b, n in zip(ds, ns, strict=True))
        self._issue(dst, src)

    def _backup_staged(self, bp: BufferPair, layer: int, pages: PageSet) -> None:
        hidx, didx = self._indices(pages)
        stage = self._stage("backup", bp, pages.count)
        torch.index_select(bp.device[layer], 0, didx, out=stage)
        bp.host[layer].index_copy_(0, hidx, stage)

    # -- issuing ------------------------------------------------------------------------------

    def _issue(self, dst: list[torch.Tensor], src: list[torch.Tensor]) -> None:
        if not dst:
            return
        if self.on_cpu:
            torch._foreach_copy_(dst, src)
            return
        for d, s in contiguous_pieces(dst, src):
            d.copy_(s, non_blocking=True)


def contiguous_pieces(
    dst: Sequence[torch.Tensor], src: Sequence[torch.Tensor]
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Pairs of same-shape views split along their leading axes until both are contiguous.

    A pair already contiguous on both sides stays one piece; otherwise both are split along
    axis 0 (and again, as deep as needed). The result copies exactly the same elements.
    """
    out: list[tuple[torch.Tensor, torch.Tensor]] = []
    todo = list(zip(dst, src, strict=True))
    while todo:
        d, s = todo.pop()
        if d.shape != s.shape:
            raise TransferError(
                f"copy pieces of different shapes: {tuple(d.shape)} and {tuple(s.shape)}"
            )
        if d.is_contiguous() and s.is_contiguous():
            out.append((d, s))
            continue
        todo.extend(zip(reversed(d.unbind(0)), reversed(s.unbind(0)), strict=True))
    return out
