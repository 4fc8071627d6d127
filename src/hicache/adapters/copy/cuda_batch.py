"""CUDA: every chunk of a load or backup in one cuMemcpyBatchAsync call on the current stream.

- CudaDriver: the few CUDA driver entry points this needs, through ctypes on libcuda.so.1;
  cuMemcpyBatchAsync is taken with cuGetProcAddress at its CUDA 12.8 ABI (the 9-argument form
  with failIdx), which every later driver keeps serving under that version.
- cuda_batch_status: (available, reason) without raising.
- probe_batch: one real 3-copy cuMemcpyBatchAsync (pinned host to device) checked byte-exact, so
  a driver that serves a different signature fails loudly (scripts/gpu-check runs it first).
- CudaBatchBackend ("cuda_batch"): builds the (dst, src, size) arrays of a copy with numpy from
  the same byte-level description the CPU memcpy backend uses (runs coalesced where both sides
  are contiguous) and submits them as one batch (at most 65536 copies per call).

Requirements, each checked up front with an error that names the alternative ("torch"): an
NVIDIA GPU (ROCm has no attribute-aware batch copy), a driver of CUDA 12.8 or newer, pinned
host regions (a batch from pageable memory would not be asynchronous), and a non-default
stream (cuMemcpyBatchAsync rejects the legacy NULL stream; the engine's copy streams are never
the default one). The batch is ordered on the stream like any other copy: the copy stream's
events cover it.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Sequence

import numpy as np
import torch

from hicache.adapters.copy.base import Backend
from hicache.adapters.copy.pairs import I64, BufferPair, PageSet, PoolPair, layer_addresses
from hicache.domain import TransferError

BATCH_ABI_VERSION = 12080  # the cuMemcpyBatchAsync signature with failIdx (CUDA 12.8)
MAX_BATCH = 65536
_SRC_ACCESS_ORDER_STREAM = 1
_FLAG_PREFER_OVERLAP_WITH_COMPUTE = 1
_SIZE_MAX = (1 << 64) - 1


class _MemLocation(ctypes.Structure):
    _fields_ = (("type", ctypes.c_int), ("id", ctypes.c_int))


class _MemcpyAttributes(ctypes.Structure):
    _fields_ = (
        ("srcAccessOrder", ctypes.c_int),
        ("srcLocHint", _MemLocation),
        ("dstLocHint", _MemLocation),
        ("flags", ctypes.c_uint),
    )


_BatchFn = ctypes.CFUNCTYPE(
    ctypes.c_int,  # CUresult
    ctypes.c_void_p,  # CUdeviceptr *dsts
    ctypes.c_void_p,  # CUdeviceptr *srcs
    ctypes.c_void_p,  # size_t *sizes
    ctypes.c_size_t,  # count
    ctypes.c_void_p,  # CUmemcpyAttributes *attrs
    ctypes.c_void_p,  # size_t *attrsIdxs
    ctypes.c_size_t,  # numAttrs
    ctypes.c_void_p,  # size_t *failIdx
    ctypes.c_void_p,  # CUstream
)


class CudaDriver:
    """ctypes bindings of the driver calls the batch backend uses."""

    def __init__(self) -> None:
        try:
            lib = ctypes.CDLL("libcuda.so.1")
        except OSError as e:
            raise TransferError(f"cannot load the CUDA driver (libcuda.so.1): {e}") from e
        self._lib = lib
        c_int, c_void_p = ctypes.c_int, ctypes.c_void_p
        self._sig("cuGetErrorString", [c_int, ctypes.POINTER(ctypes.c_char_p)])
        self._sig("cuDriverGetVersion", [ctypes.POINTER(c_int)])
        self._sig("cuDeviceGet", [ctypes.POINTER(c_int), c_int])
        self._sig("cuDevicePrimaryCtxRetain", [ctypes.POINTER(c_void_p), c_int])
        self._sig("cuCtxGetCurrent", [ctypes.POINTER(c_void_p)])
        self._sig("cuCtxPushCurrent_v2", [c_void_p])
        self._sig("cuCtxPopCurrent_v2", [ctypes.POINTER(c_void_p)])
        self._sig(
            "cuGetProcAddress_v2",
            [
                ctypes.c_char_p,
                ctypes.POINTER(c_void_p),
                c_int,
                ctypes.c_uint64,
                ctypes.POINTER(c_int),
            ],
        )
        version = c_int(0)
        self.check(lib.cuDriverGetVersion(ctypes.byref(version)), "cuDriverGetVersion")
        self.version = version.value
        if self.version < BATCH_ABI_VERSION:
            raise TransferError(
                f"the CUDA driver supports CUDA {self.version // 1000}.{self.version % 1000 // 10}; "
                f"cuMemcpyBatchAsync needs 12.8 or newer"
            )
        pfn, status = c_void_p(), c_int(-1)
        rc = lib.cuGetProcAddress_v2(
            b"cuMemcpyBatchAsync", ctypes.byref(pfn), BATCH_ABI_VERSION, 0, ctypes.byref(status)
        )
        if rc != 0 or status.value != 0 or not pfn.value:
            raise TransferError(
                f"the CUDA driver does not provide cuMemcpyBatchAsync at version "
                f"{BATCH_ABI_VERSION} (result {rc}, query status {status.value})"
            )
        self.batch = _BatchFn(pfn.value)
        self._primary: dict[int, int] = {}
        self._lock = threading.Lock()

    def _sig(self, name: str, argtypes: list[type]) -> None:
        try:
            fn = getattr(self._lib, name)
        except AttributeError as e:
            raise TransferError(f"the CUDA driver has no {name}") from e
        fn.restype = ctypes.c_int
        fn.argtypes = argtypes

    def error(self, code: int) -> str:
        text = ctypes.c_char_p()
        if self._lib.cuGetErrorString(code, ctypes.byref(text)) == 0 and text.value:
            return f"{text.value.decode(errors='replace')} (CUresult {code})"
        return f"CUresult {code}"

    def check(self, code: int, what: str) -> None:
        if code != 0:
            raise TransferError(f"{what} failed: {self.error(code)}")

    def primary_context(self, index: int) -> int:
        with self._lock:
            ctx = self._primary.get(index)
            if ctx is None:
                dev, handle = ctypes.c_int(), ctypes.c_void_p()
                self.check(self._lib.cuDeviceGet(ctypes.byref(dev), index), "cuDeviceGet")
                self.check(
                    self._lib.cuDevicePrimaryCtxRetain(ctypes.byref(handle), dev.value),
                    "cuDevicePrimaryCtxRetain",
                )
                ctx = int(handle.value or 0)
                self._primary[index] = ctx
            return ctx

    def run_batch(
        self, index: int, stream: int, dsts: I64, srcs: I64, sizes: I64, describe: str
    ) -> None:
        """Submit the copies in chunks of MAX_BATCH with the device's primary context current."""
        ctx = self.primary_context(index)
        current = ctypes.c_void_p()
        self.check(self._lib.cuCtxGetCurrent(ctypes.byref(current)), "cuCtxGetCurrent")
        pushed = int(current.value or 0) != ctx
        if pushed:
            self.check(self._lib.cuCtxPushCurrent_v2(ctypes.c_void_p(ctx)), "cuCtxPushCurrent")
        try:
            attrs = _MemcpyAttributes()
            attrs.srcAccessOrder = _SRC_ACCESS_ORDER_STREAM
            attrs.flags = _FLAG_PREFER_OVERLAP_WITH_COMPUTE
            attr_idx = (ctypes.c_size_t * 1)(0)
            fail = ctypes.c_size_t(_SIZE_MAX)
            d = dsts.astype(np.uint64, copy=False)
            s = srcs.astype(np.uint64, copy=False)
            n = sizes.astype(np.uint64, copy=False)
            for lo in range(0, len(d), MAX_BATCH):
                hi = min(lo + MAX_BATCH, len(d))
                dd = np.ascontiguousarray(d[lo:hi])
                ss = np.ascontiguousarray(s[lo:hi])
                nn = np.ascontiguousarray(n[lo:hi])
                fail.value = _SIZE_MAX
                rc = self.batch(
                    dd.ctypes.data,
                    ss.ctypes.data,
                    nn.ctypes.data,
                    hi - lo,
                    ctypes.addressof(attrs),
                    ctypes.addressof(attr_idx),
                    1,
                    ctypes.addressof(fail),
                    stream,
                )
                if rc != 0:
                    where = ""
                    if fail.value != _SIZE_MAX and fail.value < hi - lo:
                        k = int(fail.value)
                        where = (
                            f"; copy {lo + k}: {int(nn[k])} B from 0x{int(ss[k]):x} to "
                            f"0x{int(dd[k]):x}"
                        )
                    raise TransferError(
                        f"cuMemcpyBatchAsync of {hi - lo} copies ({describe}) failed: "
                        f"{self.error(rc)}{where}"
                    )
        finally:
            if pushed:
                popped = ctypes.c_void_p()
                self._lib.cuCtxPopCurrent_v2(ctypes.byref(popped))


_driver_lock = threading.Lock()
_driver: CudaDriver | TransferError | None = None


def cuda_driver() -> CudaDriver:
    """The process's driver bindings; raises TransferError (remembered) when unusable."""
    global _driver
    with _driver_lock:
        if _driver is None:
            try:
                _driver = CudaDriver()
            except TransferError as e:
                _driver = e
        if isinstance(_driver, TransferError):
            raise TransferError(str(_driver))
        return _driver


def cuda_batch_status() -> tuple[bool, str]:
    """(available, why) of the batch backend in this process."""
    if torch.version.hip is not None:
        return False, "this torch is a ROCm build; cuda_batch needs the CUDA driver"
    if not torch.cuda.is_available():
        return False, "no CUDA GPU (torch.cuda.is_available() is False)"
    try:
        driver = cuda_driver()
    except TransferError as e:
        return False, str(e)
    return True, f"CUDA driver {driver.version}"


def probe_batch(index: int = 0) -> str:
    """Run one batch of 3 copies through the driver and check every byte; returns a summary.

    Raises TransferError if the driver refuses the call or the bytes differ (what a wrong
    signature, e.g. one without failIdx, would produce).
    """
    ok, why = cuda_batch_status()
    if not ok:
        raise TransferError(f"cuMemcpyBatchAsync cannot run here: {why}")
    driver = cuda_driver()
    dev = torch.device("cuda", index)
    sizes = [4096, 1, 65536 + 3]
    src = torch.randint(0, 256, (sum(sizes),), dtype=torch.uint8).pin_memory()
    dst = torch.zeros(sum(sizes) + 64, dtype=torch.uint8, device=dev)
    offsets = np.cumsum([0, *sizes[:-1]]).astype(np.int64)
    # Scattered and unaligned on the device side (the copies do not overlap there).
    dst_off = np.array([0, sizes[0] + 5, sizes[0] + 17], dtype=np.int64) + 7
    stream = torch.cuda.Stream(dev)  # type: ignore[no-untyped-call]
    driver.run_batch(
        index,
        int(stream.cuda_stream),
        dst_off + dst.data_ptr(),
        offsets + src.data_ptr(),
        np.asarray(sizes, dtype=np.int64),
        "probe",
    )
    stream.synchronize()
    host = dst.cpu()
    for a, b, n in zip(offsets.tolist(), dst_off.tolist(), sizes, strict=True):
        if not torch.equal(host[b : b + n], src[a : a + n]):
            raise TransferError(
                f"cuMemcpyBatchAsync (ABI {BATCH_ABI_VERSION}) returned success but copy of {n} B "
                f"to offset {b} differs: the driver's signature is not the one hicache calls"
            )
    return f"cuMemcpyBatchAsync ABI {BATCH_ABI_VERSION} on CUDA driver {driver.version}: 3 copies exact"


def _flat(
    bp: BufferPair, layers: Sequence[int] | None, pages: PageSet, *, load: bool
) -> tuple[I64, I64, I64]:
    """(dst addresses, src addresses, sizes) of every copy of one buffer."""
    h_off, d_off, lengths = pages.offsets(bp)
    h_layers, d_layers = layer_addresses(bp, layers)
    if lengths is not None:
        h = (h_layers[:, None] + h_off[None, :]).ravel()
        d = (d_layers[:, None] + d_off[None, :]).ravel()
        sizes = np.broadcast_to(lengths[None, :], (len(h_layers), len(lengths))).ravel()
    else:
        h = (h_layers[:, None, None] + h_off[None, :, None] + bp.host_chunks[None, None, :]).ravel()
        d = (
            d_layers[:, None, None] + d_off[None, :, None] + bp.device_chunks[None, None, :]
        ).ravel()
        sizes = np.full(len(h), bp.chunk_bytes, dtype=np.int64)
    return (d, h, sizes) if load else (h, d, sizes)


class CudaBatchBackend(Backend):
    name = "cuda_batch"

    def __init__(self, pair: PoolPair) -> None:
        super().__init__(pair)
        device = pair.device_pool.device
        if device.type != "cuda" or torch.version.hip is not None:
            raise TransferError(
                f"backend 'cuda_batch' needs an NVIDIA CUDA device; pool {pair.name.value!r} is "
                f"on {device} (torch hip={torch.version.hip}); choose 'torch'"
            )
        if not pair.host_pool.pinned:
            raise TransferError(
                f"backend 'cuda_batch' needs pinned host memory; the host regions of pool "
                f"{pair.name.value!r} are not page-locked. Pin them (pinned=on, or auto with a "
                f"GPU) or choose backend 'torch'"
            )
        self.driver = cuda_driver()
        self.index = device.index if device.index is not None else torch.cuda.current_device()

    def _stream(self) -> int:
        stream = int(torch.cuda.current_stream(self.index).cuda_stream)
        if stream == 0:
            raise TransferError(
                "backend 'cuda_batch' cannot issue on the legacy default stream "
                "(cuMemcpyBatchAsync rejects it): run the copy under torch.cuda.stream(s) with a "
                "side stream (the engine's copy streams are), or choose backend 'torch'"
            )
        return stream

    def _run(self, layers: Sequence[int] | None, pages: PageSet, *, load: bool) -> None:
        if pages.count == 0:
            return
        stream = self._stream()
        parts = [_flat(bp, layers, pages, load=load) for bp in self.pair.buffers]
        dsts = np.concatenate([p[0] for p in parts])
        srcs = np.concatenate([p[1] for p in parts])
        sizes = np.concatenate([p[2] for p in parts])
        self.driver.run_batch(
            self.index, stream, dsts, srcs, sizes, f"pool {self.pair.name.value!r}"
        )

    def load(self, layer: int, pages: PageSet) -> None:
        self._run((layer,), pages, load=True)

    def backup(self, layers: Sequence[int] | None, pages: PageSet) -> None:
        self._run(layers, pages, load=False)


__all__ = ["CudaBatchBackend", "CudaDriver", "cuda_batch_status", "cuda_driver", "probe_batch"]
