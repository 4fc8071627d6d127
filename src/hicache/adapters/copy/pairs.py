"""What a copy backend needs to know about one buffer on both sides, computed once.

- BufferPair: one buffer of one pool as a host view and device views of the same logical shape
  ``(layer, page, token in page, *row)``, plus the byte-level description of both sides
  (per-layer base addresses, page strides, the contiguous chunks of one page of one layer).
- PoolPair: the BufferPairs of one pool (host pool + device pool), checked to match.
- PageSet: one pool's host and device page ids as int64 arrays, checked once per PageMap, with
  the runs (pages consecutive on both sides) and per-buffer byte offsets computed on demand.
- chunk_pattern: the contiguous chunks two strided views of one logical shape have in common.
- layer_addresses: per-layer base addresses of both sides of a BufferPair for some layers.

Host layouts as logical views (L layers, N units, P page size, R row):
  layer_first (L, N, *R) -> (L, N/P, P, *R)                  one page of one layer contiguous
  page_first (N, L, *R) -> (L, N/P, P, *R) by permutation    a token's row per layer contiguous
  page_first_direct (N/P, L, P, *R) -> (L, N/P, P, *R)       one page of one layer contiguous
  page_head (N/P, H, P, L, *R[1:]) -> (L, N/P, P, H, *R[1:]) one head row contiguous
"""

from __future__ import annotations

import math
import threading
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt
import torch

from hicache.adapters.device_pool import DevicePool
from hicache.adapters.host_pool import HostPool
from hicache.domain import ConfigError, ForeignIndexError, Layout
from hicache.domain.ports import PageMap

I64 = npt.NDArray[np.int64]


def logical_host_view(buf: torch.Tensor, layout: Layout, page_size: int) -> torch.Tensor:
    """A host buffer in its layout as a (layer, page, token in page, *row) view (no copy)."""
    if layout is Layout.LAYER_FIRST:
        layers, units, *row = buf.shape
        return buf.view(layers, units // page_size, page_size, *row)
    if layout is Layout.PAGE_FIRST:
        units, layers, *row = buf.shape
        v = buf.view(units // page_size, page_size, layers, *row)
        return v.permute(2, 0, 1, *range(3, v.dim()))
    if layout is Layout.PAGE_FIRST_DIRECT:
        return buf.permute(1, 0, 2, *range(3, buf.dim()))
    # page_head: (pages, H, P, L, *R1) -> (L, pages, P, H, *R1)
    return buf.permute(3, 0, 2, 1, *range(4, buf.dim()))


def chunk_pattern(
    shape: Sequence[int], a_strides: Sequence[int], b_strides: Sequence[int], itemsize: int
) -> tuple[int, I64, I64]:
    """The common contiguous chunks of two strided views of one logical ``shape``.

    Returns (chunk_bytes, a_offsets, b_offsets): element ``k`` of the logical order of chunks
    starts ``a_offsets[k]`` bytes into view a and ``b_offsets[k]`` into view b.
    """
    k = len(shape)
    expect = 1
    while k > 0:
        size = shape[k - 1]
        if size != 1 and (a_strides[k - 1] != expect or b_strides[k - 1] != expect):
            break
        expect *= size
        k -= 1
    chunk = expect * itemsize
    outer = list(shape[:k])
    if not outer:
        zero = np.zeros(1, dtype=np.int64)
        return chunk, zero, zero.copy()
    grids = np.indices(outer, dtype=np.int64).reshape(len(outer), -1)
    a = (grids * np.asarray(a_strides[:k], dtype=np.int64)[:, None]).sum(axis=0) * itemsize
    b = (grids * np.asarray(b_strides[:k], dtype=np.int64)[:, None]).sum(axis=0) * itemsize
    return chunk, np.ascontiguousarray(a, dtype=np.int64), np.ascontiguousarray(b, dtype=np.int64)


class BufferPair:
    """One buffer of one pool, host and device, in the same logical shape."""

    def __init__(
        self,
        name: str,
        *,
        host: torch.Tensor,
        layout: Layout,
        page_size: int,
        device_layers: Sequence[torch.Tensor],
        device_stacked: torch.Tensor | None,
    ) -> None:
        self.name = name
        self.page_size = page_size
        self.host = logical_host_view(host, layout, page_size)  # (L, Hpages, P, *R)
        layers = self.host.shape[0]
        row = tuple(self.host.shape[3:])
        # Device layers come as (capacity, *row) or already paged (pages, page_size, *row) with
        # pages at any stride (DevicePool.paged): viewing either as the paged shape is free.
        dev_pages = device_layers[0].numel() // (page_size * math.prod(row))
        self.device = tuple(t.view(dev_pages, page_size, *row) for t in device_layers)
        self.device_all = (
            None
            if device_stacked is None
            else device_stacked.view(layers, dev_pages, page_size, *row)
        )
        self.itemsize = host.element_size()
        self.on_cpu = device_layers[0].device.type == "cpu"
        isz = self.itemsize
        logical = (page_size, *row)
        self.page_bytes = math.prod(logical) * isz
        # Byte-level description (for address-based backends).
        self.host_layer_addr: I64 = np.array(
            [self.host.data_ptr() + i * self.host.stride(0) * isz for i in range(layers)],
            dtype=np.int64,
        )
        self.device_layer_addr: I64 = np.array([t.data_ptr() for t in self.device], dtype=np.int64)
        self.host_page_stride = self.host.stride(1) * isz
        self.device_page_stride = self.device[0].stride(0) * isz
        if any(t.stride() != self.device[0].stride() for t in self.device):
            raise ConfigError(f"buffer {name!r}: device layers have different strides")
        self.chunk_bytes, self.host_chunks, self.device_chunks = chunk_pattern(
            logical, self.host.stride()[2:], self.device[0].stride()[1:], isz
        )
        # Whole pages contiguous on both sides and adjacent pages adjacent: runs coalesce.
        self.coalesces = (
            self.chunk_bytes == self.page_bytes
            and self.host_page_stride == self.page_bytes
            and self.device_page_stride == self.page_bytes
        )

    @property
    def layers(self) -> int:
        return int(self.host.shape[0])

    def __repr__(self) -> str:
        return (
            f"<BufferPair {self.name}: {self.layers} layers, page {self.page_bytes} B in "
            f"{len(self.host_chunks)} chunk(s) of {self.chunk_bytes} B>"
        )


class PoolPair:
    """The buffers of one pool on both sides."""

    def __init__(self, host: HostPool, device: DevicePool) -> None:
        hp, dp = host.plan, device.plan
        if (hp.name, hp.geometry, hp.binding, hp.page_size) != (
            dp.name,
            dp.geometry,
            dp.binding,
            dp.page_size,
        ):
            raise ConfigError(
                f"host pool {hp.name.value!r} and device pool {dp.name.value!r} were planned "
                f"differently (geometry, layer binding or page size differ)"
            )
        self.host_pool = host
        self.device_pool = device
        self.plan = hp
        self.name = hp.name
        self.host_pages = hp.pages
        self.device_pages = device.pages
        self.bytes_per_page_layer = hp.page_size * hp.bytes_per_unit_per_layer
        self.buffers = tuple(
            BufferPair(
                spec.name,
                host=host.buffers[spec.name],
                layout=hp.layout,
                page_size=hp.page_size,
                device_layers=device.paged(spec.name),
                device_stacked=device.paged_stacked(spec.name),
            )
            for spec in hp.geometry.buffers
        )

    def pool_layer(self, transfer_layer: int) -> int | None:
        return self.plan.binding.pool_layer(transfer_layer)


def _preview(ids: Sequence[int] | I64) -> str:
    shown = ", ".join(str(int(i)) for i in ids[:6])
    return f"[{shown}{', ...' if len(ids) > 6 else ''}] ({len(ids)} pages)"


class PageSet:
    """One PageMap of one pool, checked against both pools, with derived arrays cached."""

    def __init__(self, pair: PoolPair, page_map: PageMap) -> None:
        self.pool = pair.name
        self.map = page_map
        self.host: I64 = np.asarray(page_map.host_pages, dtype=np.int64)
        self.device: I64 = np.asarray(page_map.device_pages, dtype=np.int64)
        self.count = len(self.host)
        for side, ids, limit in (
            ("host", self.host, pair.host_pages),
            ("device", self.device, pair.device_pages),
        ):
            if self.count and (int(ids.min()) < 0 or int(ids.max()) >= limit):
                bad = [int(i) for i in ids if not 0 <= i < limit][:6]
                raise ForeignIndexError(
                    f"pool {self.pool.value!r}: {side} pages {bad} are out of range "
                    f"(the {side} pool has pages 0..{limit - 1})"
                )
        self.host_unique = len(np.unique(self.host)) == self.count
        self.device_unique = len(np.unique(self.device)) == self.count
        self._lock = threading.Lock()
        self._runs: tuple[I64, I64, I64] | None = None
        self._run_lists: tuple[list[int], list[int], list[int]] | None = None
        self._tensors: dict[str, torch.Tensor] = {}
        self._offsets: dict[int, tuple[I64, I64, I64 | None]] = {}

    def describe(self) -> str:
        return f"host pages {_preview(self.host)}, device pages {_preview(self.device)}"

    def runs(self) -> tuple[I64, I64, I64]:
        """(host start, device start, length) of maximal runs consecutive on both sides."""
        runs = self._runs
        if runs is None:
            if self.count == 0:
                empty = np.zeros(0, dtype=np.int64)
                runs = (empty, empty, empty)
            else:
                brk = (np.diff(self.host) != 1) | (np.diff(self.device) != 1)
                starts = np.concatenate(([0], np.flatnonzero(brk) + 1)).astype(np.int64)
                lengths = np.diff(np.concatenate((starts, [self.count]))).astype(np.int64)
                runs = (self.host[starts], self.device[starts], lengths)
            self._runs = runs
        return runs

    def tensor(self, side: str) -> torch.Tensor:
        """The host or device page ids as an int64 CPU tensor (shares the numpy ids)."""
        found = self._tensors.get(side)
        if found is None:
            found = torch.from_numpy(self.host if side == "host" else self.device)
            with self._lock:
                self._tensors[side] = found
        return found

    def run_lists(self) -> tuple[list[int], list[int], list[int]]:
        """runs() as Python lists (for slicing torch views)."""
        found = self._run_lists
        if found is None:
            hs, ds, ns = self.runs()
            found = (hs.tolist(), ds.tolist(), ns.tolist())
            self._run_lists = found
        return found

    def offsets(self, pair: BufferPair) -> tuple[I64, I64, I64 | None]:
        """(host byte offsets, device byte offsets, lengths or None) of the pieces to copy.

        With lengths (pages that coalesce), piece ``i`` is one contiguous run of
        ``lengths[i]`` bytes on both sides; without, piece ``i`` is one page whose chunks are
        ``pair.host_chunks`` / ``pair.device_chunks`` of ``pair.chunk_bytes`` each.
        """
        key = id(pair)
        found = self._offsets.get(key)
        if found is not None:
            return found
        if pair.coalesces:
            hs, ds, n = self.runs()
            found = (
                hs * pair.host_page_stride,
                ds * pair.device_page_stride,
                n * pair.page_bytes,
            )
        else:
            found = (self.host * pair.host_page_stride, self.device * pair.device_page_stride, None)
        with self._lock:
            self._offsets[key] = found
        return found


def layer_addresses(bp: BufferPair, layers: Sequence[int] | None) -> tuple[I64, I64]:
    """Per-layer base addresses of both sides for ``layers`` (None: all), as int64 arrays."""
    if layers is None:
        return bp.host_layer_addr, bp.device_layer_addr
    if len(layers) == 1:
        i = layers[0]
        return bp.host_layer_addr[i : i + 1], bp.device_layer_addr[i : i + 1]
    idx = np.asarray(layers, dtype=np.int64)
    return (
        np.ascontiguousarray(bp.host_layer_addr[idx]),
        np.ascontiguousarray(bp.device_layer_addr[idx]),
    )


__all__ = [
    "BufferPair",
    "PageSet",
    "PoolPair",
    "chunk_pattern",
    "layer_addresses",
    "logical_host_view",
]
