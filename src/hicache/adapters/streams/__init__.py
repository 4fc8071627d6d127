"""Streams and events adapters (the hicache.domain.ports.Streams port).

- CpuStreams / CpuEvent: a long-lived worker thread per direction; events on threading
  primitives (hicache.adapters.streams.cpu; imports no torch).
- CudaStreams / CudaEvent: torch.cuda streams and timing events, CUDA or ROCm
  (hicache.adapters.streams.cuda; imported on first use so that CPU users never load it).
- open_streams: the streams for a device string ("cpu", "cuda", "cuda:1", "rocm:0").
- SyntheticCompute: a stand-in for one layer's compute on the device's compute stream (a matrix
  product of a calibrated size), for benchmarks of how much copy time compute hides.
"""

from __future__ import annotations

import math
import statistics
import time
from typing import TYPE_CHECKING, Any

from hicache.adapters.devices import parse_device_name
from hicache.adapters.streams.cpu import CpuEvent, CpuFence, CpuStreams
from hicache.domain.ports import Streams

if TYPE_CHECKING:
    from hicache.adapters.streams.cuda import CudaEvent, CudaStreams


def open_streams(device: str = "cpu") -> Streams:
    """CPU streams for "cpu"; CUDA streams for "cuda[:N]" or "rocm[:N]" (ROCm is torch.cuda)."""
    kind, index = parse_device_name(device)
    if kind == "cpu":
        return CpuStreams()
    from hicache.adapters.streams.cuda import CudaStreams

    return CudaStreams(f"cuda:{index}" if index is not None else "cuda")


class SyntheticCompute:
    """One layer's stand-in compute: an n x n float32 matrix product on the compute stream.

    ``layer()`` issues it (and, on CPU, runs it on the calling thread: give it one torch
    thread so that the copy worker keeps the other core); ``synchronize()`` waits for the
    device; ``calibrate(t)`` sizes the product so that one layer takes ``t`` to 1.1x ``t``.
    torch is imported on first use.
    """

    def __init__(self, device: str = "cpu") -> None:
        import torch

        name, index = parse_device_name(device)
        self._torch = torch
        kind = "cpu" if name == "cpu" else "cuda"
        self.device = torch.device(kind if index is None else f"{kind}:{index}")
        self.gpu = kind == "cuda"
        self.n = 0
        self._a: Any = None
        self._b: Any = None
        self._c: Any = None
        self.resize(512 if self.gpu else 128)

    def resize(self, n: int) -> None:
        torch = self._torch
        gen = torch.Generator().manual_seed(n)
        self._a = torch.randn(n, n, generator=gen).to(self.device)
        self._b = (torch.randn(n, n, generator=gen) / n).to(self.device)
        self._c = torch.empty(n, n, device=self.device)
        self.n = n

    def layer(self) -> None:
        self._torch.mm(self._a, self._b, out=self._c)

    def synchronize(self) -> None:
        if self.gpu:
            self._torch.cuda.synchronize(self.device)

    def time_layer(self, rounds: int = 20) -> float:
        """Median seconds of one layer (three samples of ``rounds`` layers each)."""
        self.layer()
        self.synchronize()
        samples = []
        for _ in range(3):
            start = time.perf_counter()
            for _ in range(rounds):
                self.layer()
            self.synchronize()
            samples.append((time.perf_counter() - start) / rounds)
        return statistics.median(samples)

    def calibrate(self, target_s: float) -> float:
        """Size the product so that one layer takes ``target_s`` to 1.1x that; return it."""
        step = 128 if self.gpu else 16
        n = self.n
        took = self.time_layer()
        for _ in range(8):
            if target_s <= took <= 1.1 * target_s:
                break
            scale = (1.05 * target_s / took) ** (1 / 3) if took > 0 else 2.0
            new = max(step, min(16384, math.ceil(n * scale / step) * step))
            if new == n:
                new = n + step if took < target_s else max(step, n - step)
            n = new
            self.resize(n)
            took = self.time_layer()
        while took < target_s and n < 16384:
            n += step
            self.resize(n)
            took = self.time_layer()
        return took

    @staticmethod
    def torch_threads(n: int | None = None) -> int:
        """torch's intra-op thread count; with ``n``, set it and return the previous one."""
        import torch

        before = int(torch.get_num_threads())
        if n is not None:
            torch.set_num_threads(n)
        return before

    def __repr__(self) -> str:
        return f"<SyntheticCompute {self.n}x{self.n} matmul on {self.device}>"


def __getattr__(name: str) -> Any:
    if name in ("CudaStreams", "CudaEvent"):
        from hicache.adapters.streams import cuda

        return getattr(cuda, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "CpuEvent",
    "CpuFence",
    "CpuStreams",
    "CudaEvent",
    "CudaStreams",
    "SyntheticCompute",
    "open_streams",
]
