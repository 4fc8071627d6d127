"""Copies of whole rows between two 2-D uint8 row tensors (a framework's blocks, host pages).

- RowCopier: ``copy(dst, dst_rows, src, src_rows)``: ``dst[dst_rows[i]] = src[src_rows[i]]``;
  one backend each: "memcpy" (CPU: hicache's native batched memcpy, GIL released), "cuda_batch"
  (NVIDIA: every row in one cuMemcpyBatchAsync on the current stream, pinned host rows),
  "torch" (any device: between pinned host rows and a device one asynchronous copy_ per run of
  rows consecutive on both sides; otherwise index_select / index_copy_ with each side's
  indices on its own device, synchronous with pageable host memory).
- row_copier(name, device, pinned): the backend for a copy setting; ``auto`` takes the measured
  default of hicache.adapters.copy.transfer.default_backend (memcpy on CPU, cuda_batch on an
  NVIDIA GPU, torch on ROCm). A backend that cannot run here is a TransferError naming the
  reason and the alternative; there is no switch to another backend on its own.

Rows may be strided (a view that skips each row's padding): every backend copies
``dst.shape[1]`` bytes from each source row start to each destination row start. The copies are
asynchronous on a GPU (issued on the caller's current stream: run them under a copy stream) and
synchronous on the CPU.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from hicache.adapters.copy.cuda_batch import cuda_batch_status, cuda_driver
from hicache.adapters.copy.native import load_native
from hicache.adapters.copy.transfer import AUTO, default_backend
from hicache.domain import ConfigError, TransferError

ROW_BACKENDS: tuple[str, ...] = ("memcpy", "cuda_batch", "torch")


def _check_rows(dst: torch.Tensor, src: torch.Tensor) -> int:
    if dst.dim() != 2 or src.dim() != 2 or dst.shape[1] != src.shape[1]:
        raise TransferError(
            f"row copy: destination {tuple(dst.shape)} and source {tuple(src.shape)} are not "
            "row tensors of equal width"
        )
    if dst.dtype != torch.uint8 or src.dtype != torch.uint8:
        raise TransferError(
            f"row copy: expected uint8 rows, got {dst.dtype} and {src.dtype} (view them as bytes)"
        )
    return int(dst.shape[1])


class RowCopier:
    """Copies whole rows with one backend (see the module docstring)."""

    def __init__(
        self, backend: str, device: torch.device | None = None, *, pinned: bool = False
    ) -> None:
        if backend not in ROW_BACKENDS:
            raise ConfigError(
                f"unknown row copy backend {backend!r}: expected one of {', '.join(ROW_BACKENDS)}"
            )
        self.backend = backend
        self.device = device
        self.pinned = pinned
        self._lib = load_native() if backend == "memcpy" else None  # NativeBuildError names why
        self._index = 0
        if backend == "cuda_batch":
            ok, why = cuda_batch_status()
            if not ok:
                raise TransferError(f"row copy backend 'cuda_batch' cannot run here: {why}")
            self._driver = cuda_driver()
            if device is not None and device.index is not None:
                self._index = int(device.index)
            else:
                self._index = torch.cuda.current_device()

    def __repr__(self) -> str:
        return f"<RowCopier {self.backend}>"

    def copy(
        self, dst: torch.Tensor, dst_rows: Sequence[int], src: torch.Tensor, src_rows: Sequence[int]
    ) -> None:
        """``dst[dst_rows[i]] = src[src_rows[i]]`` for every i; TransferError on a failure."""
        if len(dst_rows) != len(src_rows):
            raise TransferError(
                f"row copy: {len(dst_rows)} destination rows for {len(src_rows)} source rows"
            )
        width = _check_rows(dst, src)
        if not dst_rows:
            return
        if self.backend == "torch":
            self._torch(dst, dst_rows, src, src_rows, pinned=self.pinned)
            return
        d_off = np.asarray(dst_rows, dtype=np.int64) * dst.stride(0)
        s_off = np.asarray(src_rows, dtype=np.int64) * src.stride(0)
        if self._lib is not None:
            if dst.device.type != "cpu" or src.device.type != "cpu":
                raise TransferError(
                    f"row copy backend 'memcpy' copies CPU memory only; got {dst.device} <- "
                    f"{src.device}: choose 'cuda_batch' or 'torch'"
                )
            self._lib.copy(
                np.array([dst.data_ptr()], dtype=np.int64),
                np.array([src.data_ptr()], dtype=np.int64),
                d_off,
                s_off,
                np.full(len(d_off), width, dtype=np.int64),
            )
            return
        stream = int(torch.cuda.current_stream(self._index).cuda_stream)
        if stream == 0:
            raise TransferError(
                "row copy backend 'cuda_batch' cannot issue on the legacy default stream "
                "(cuMemcpyBatchAsync rejects it): run it under torch.cuda.stream(copy_stream)"
            )
        self._driver.run_batch(
            self._index,
            stream,
            d_off + dst.data_ptr(),
            s_off + src.data_ptr(),
            np.full(len(d_off), width, dtype=np.int64),
            f"{len(d_off)} rows of {width} B",
        )

    @staticmethod
    def _torch(
        dst: torch.Tensor,
        dst_rows: Sequence[int],
        src: torch.Tensor,
        src_rows: Sequence[int],
        *,
        pinned: bool,
    ) -> None:
        if dst.device != src.device and pinned:
            # pinned host <-> device: one asynchronous copy_ per run of rows consecutive on
            # both sides, straight between the two tensors (no host temporary to read early)
            for d, s, n in _runs(dst_rows, src_rows):
                dst[d : d + n].copy_(src[s : s + n], non_blocking=True)
            return
        # one device, or pageable host memory (whose copies are synchronous anyway): gather on
        # the source's device, move, scatter with the indices on the destination's device
        index = torch.tensor(list(src_rows), dtype=torch.long)
        target = torch.tensor(list(dst_rows), dtype=torch.long)
        if src.device.type != "cpu":
            index = index.to(src.device)
        if dst.device.type != "cpu":
            target = target.to(dst.device)
        rows = src.index_select(0, index)
        if rows.device != dst.device:
            rows = rows.to(dst.device)
        dst.index_copy_(0, target, rows)


def _runs(dst_rows: Sequence[int], src_rows: Sequence[int]) -> list[tuple[int, int, int]]:
    """(dst start, src start, length) of the maximal runs consecutive on both sides."""
    out: list[tuple[int, int, int]] = []
    for d, s in zip(dst_rows, src_rows, strict=True):
        if out and out[-1][0] + out[-1][2] == d and out[-1][1] + out[-1][2] == s:
            out[-1] = (out[-1][0], out[-1][1], out[-1][2] + 1)
        else:
            out.append((int(d), int(s), 1))
    return out


def row_copier(name: str, device: torch.device, *, pinned: bool) -> RowCopier:
    """The RowCopier for backend ``name`` (or ``auto``) between host rows and ``device`` rows.

    ``pinned``: whether the host rows are page-locked (cuda_batch needs it). ConfigError for a
    backend that does not fit the device; TransferError for one that cannot run here.
    """
    if name == AUTO:
        name = default_backend(device, "kv", 1)
    if name not in ROW_BACKENDS:
        raise ConfigError(
            f"unknown row copy backend {name!r}: expected {AUTO} or one of "
            f"{', '.join(ROW_BACKENDS)}"
        )
    if name == "memcpy" and device.type != "cpu":
        raise ConfigError(
            f"row copy backend 'memcpy' copies CPU memory only; the rows are on {device}: "
            "choose 'cuda_batch' or 'torch'"
        )
    if name == "cuda_batch":
        if device.type != "cuda":
            raise ConfigError(
                f"row copy backend 'cuda_batch' needs a CUDA device; the rows are on {device}: "
                "choose 'memcpy' or 'torch'"
            )
        if not pinned:
            raise ConfigError(
                "row copy backend 'cuda_batch' needs pinned host rows (a batch from pageable "
                "memory is not asynchronous): pin the host memory or choose 'torch'"
            )
    return RowCopier(name, device, pinned=pinned)


__all__ = ["ROW_BACKENDS", "RowCopier", "row_copier"]
