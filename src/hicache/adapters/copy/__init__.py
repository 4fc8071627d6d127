"""Copy backends between host pools and device pools, behind the Transfer port.

- GroupTransfer / make_transfer: hicache.domain.ports.Transfer over (HostGroup, DeviceGroup).
- BACKENDS, default_backend, backend_status: the backends, the measured default, what runs here.
- Backends: "naive" (one copy_ per buffer, layer and page; the bench's reference), "torch"
  (coalesced runs as torch views, many copies per call), "memcpy" (CPU: a native batched memcpy
  built on first use), "cuda_batch" (NVIDIA: cuMemcpyBatchAsync on the current stream).
- load_native / NativeBuildError: the native helper and its explicit build failure.

See docs/copy.md for the selection rule and the measurements behind it.
"""

from hicache.adapters.copy.base import Backend
from hicache.adapters.copy.native import NativeBuildError, load_native, native_status
from hicache.adapters.copy.pairs import BufferPair, PageSet, PoolPair
from hicache.adapters.copy.transfer import (
    AUTO,
    BACKENDS,
    ENV_BACKEND,
    GroupTransfer,
    backend_status,
    check_backend_name,
    default_backend,
    make_transfer,
)

__all__ = [
    "AUTO",
    "BACKENDS",
    "ENV_BACKEND",
    "Backend",
    "BufferPair",
    "GroupTransfer",
    "NativeBuildError",
    "PageSet",
    "PoolPair",
    "backend_status",
    "check_backend_name",
    "default_backend",
    "load_native",
    "make_transfer",
    "native_status",
]
