"""The Transfer port over a host group and a device group, and the choice of copy backend.

- BACKENDS: the backend names: naive, torch, memcpy, cuda_batch.
- default_backend: the measured default for a device, pool kind and page size (docs/copy.md).
- backend_status: whether each backend can run here, and why not.
- GroupTransfer: implements hicache.domain.ports.Transfer: per-layer load (host to device, one
  transfer layer of every pool that has it), all-layer backup and per-layer backup (device to
  host), byte counts; page maps are checked once and cached; a sidecar follows its anchor's
  pages; every backend failure becomes a TransferError naming pool, layer and pages; close()
  drops every view it holds of host and device memory.

Selection: ``backend="auto"`` (the default) takes ``$HICACHE_COPY_BACKEND`` if set, else
default_backend() for each pool. A backend that cannot run (no C compiler for memcpy, no CUDA
12.8 driver or no pinned memory for cuda_batch) raises TransferError naming the reason and the
alternative: hicache never switches to another backend on its own.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Mapping, Sequence

import torch

from hicache.adapters.copy.base import Backend
from hicache.adapters.copy.cuda_batch import CudaBatchBackend, cuda_batch_status
from hicache.adapters.copy.naive import NaiveBackend
from hicache.adapters.copy.native import MemcpyBackend, native_status
from hicache.adapters.copy.pairs import PageSet, PoolPair
from hicache.adapters.copy.torch_batched import TorchBackend
from hicache.adapters.device_pool import DeviceGroup
from hicache.adapters.host_pool import HostGroup
from hicache.domain import (
    BindingError,
    ConfigError,
    HiCacheError,
    PoolName,
    PoolRole,
    TransferError,
)
from hicache.domain.errors import shown
from hicache.domain.ports import PageMap

AUTO = "auto"
ENV_BACKEND = "HICACHE_COPY_BACKEND"
BACKENDS: tuple[str, ...] = ("naive", "torch", "memcpy", "cuda_batch")
_CLASSES: dict[str, Callable[[PoolPair], Backend]] = {
    "naive": NaiveBackend,
    "torch": TorchBackend,
    "memcpy": MemcpyBackend,
    "cuda_batch": CudaBatchBackend,
}
_CACHE_SIZE = 64


def check_backend_name(name: object) -> str:
    """``name`` if it names a backend or "auto", else a ConfigError listing them."""
    if not isinstance(name, str) or (name not in BACKENDS and name != AUTO):
        raise ConfigError(
            f"unknown copy backend {name!r}: expected {AUTO} or one of {', '.join(BACKENDS)}"
        )
    return name


def default_backend(device: torch.device | str, pool_kind: str, page_size: int) -> str:
    """The default backend for a pool: see docs/copy.md for the measurements behind it.

    CPU: "memcpy" for every pool kind and page size (one native call per buffer; measured at
    least as fast as "torch" and "naive" at every page size, and the only one that reaches the
    targets at pages 16 and 64). NVIDIA GPU: "cuda_batch" (one cuMemcpyBatchAsync per copy).
    ROCm: "torch" (no batch copy with attributes there).
    """
    dev = torch.device(device) if isinstance(device, str) else device
    if dev.type == "cpu":
        return "memcpy"
    if torch.version.hip is not None:
        return "torch"
    return "cuda_batch"


def backend_status() -> dict[str, tuple[bool, str]]:
    """Backend name -> (can run in this process, why or why not)."""
    return {
        "naive": (True, "one torch copy_ per buffer, layer and page"),
        "torch": (True, "torch views of coalesced runs, many copies per call"),
        "memcpy": native_status(),
        "cuda_batch": cuda_batch_status(),
    }


class _Pool:
    """One pool of the transfer: its buffer pairs and its backend."""

    def __init__(self, pair: PoolPair, backend: Backend) -> None:
        self.pair = pair
        self.backend = backend
        self.name = pair.name

    @property
    def role(self) -> PoolRole:
        return self.pair.plan.role


class GroupTransfer:
    """Copies between one host group and one device group (hicache.domain.ports.Transfer).

    Copies run on the caller's thread (CPU) or are issued on the caller's current stream (GPU);
    each call returns the number of bytes it moved.
    """

    def __init__(
        self,
        host: HostGroup,
        device: DeviceGroup,
        *,
        backend: str | Mapping[PoolName | str, str] = AUTO,
    ) -> None:
        if host.closed:
            raise TransferError("the host group is closed")
        names = [p.name for p in host.plan.pools]
        dev_names = sorted(n.value for n in device.pools)
        if sorted(n.value for n in names) != dev_names:
            raise ConfigError(
                f"host group pools {[n.value for n in names]} and device group pools "
                f"{dev_names} differ"
            )
        if isinstance(backend, str):
            chosen = {n: check_backend_name(backend) for n in names}
        elif isinstance(backend, Mapping):
            per = {PoolName.parse(k): check_backend_name(v) for k, v in backend.items()}
            unknown = sorted(n.value for n in per if n not in names)
            if unknown:
                raise ConfigError(
                    f"backend names pools {unknown} that this group does not have "
                    f"({[n.value for n in names]})"
                )
            chosen = {n: per.get(n, AUTO) for n in names}
        else:
            raise ConfigError(
                f"backend must be a name or a mapping of pool to name, got {shown(backend)}"
            )
        env = os.environ.get(ENV_BACKEND, "").strip()
        self.host = host
        self.device = device
        self._pools: dict[PoolName, _Pool] = {}
        for plan in host.plan.pools:
            pair = PoolPair(host.pool(plan.name), device.pool(plan.name))
            name = chosen[plan.name]
            if name == AUTO:
                if env:
                    try:
                        name = check_backend_name(env)
                    except ConfigError as e:
                        raise ConfigError(f"${ENV_BACKEND}: {e}") from None
                if name == AUTO:
                    name = default_backend(device.device, plan.geometry.kind, plan.page_size)
            if name == "memcpy" and device.device.type != "cpu":
                raise ConfigError(
                    f"backend 'memcpy' copies CPU memory only; the device group is on "
                    f"{device.device}: choose cuda_batch, torch or naive"
                )
            if name == "cuda_batch" and device.device.type != "cuda":
                raise ConfigError(
                    f"backend 'cuda_batch' needs a CUDA device; the device group is on "
                    f"{device.device}: choose memcpy, torch or naive"
                )
            self._pools[plan.name] = _Pool(pair, _CLASSES[name](pair))
        self._anchor = host.plan.anchor.name
        self._sidecars = tuple(p.name for p in host.plan.pools if p.role is PoolRole.SIDECAR)
        self._cache: dict[tuple[PoolName, int], tuple[PageMap, PageSet]] = {}
        self._lock = threading.Lock()
        self._closed = False

    def close(self) -> None:
        """Drop every view of host and device memory (buffer pairs, staging, cached page sets).

        The host and device groups are closed by their owner (the runtime); after this, every
        copy raises TransferError. Idempotent.
        """
        with self._lock:
            self._closed = True
            self._pools.clear()
            self._cache.clear()

    @property
    def closed(self) -> bool:
        return self._closed

    # -- what it is -----------------------------------------------------------------------------

    @property
    def transfer_layers(self) -> int:
        return self.host.plan.transfer_layers

    @property
    def backends(self) -> dict[PoolName, str]:
        """Pool -> the backend that copies it."""
        return {n: p.backend.name for n, p in self._pools.items()}

    def __repr__(self) -> str:
        inner = ", ".join(f"{n.value}={b}" for n, b in self.backends.items())
        return (
            f"<GroupTransfer {self.host.host_memory} <-> {self.device.device}: {inner}; "
            f"{self.transfer_layers} transfer layers>"
        )

    # -- the port ------------------------------------------------------------------------------

    def load_layer(self, layer: int, maps: Sequence[PageMap]) -> int:
        """Host to device: transfer layer ``layer`` of every pool in ``maps`` that has it."""
        return self._one_layer(layer, maps, load=True)

    def backup(self, maps: Sequence[PageMap]) -> int:
        """Device to host: every layer of the given pages of every pool in ``maps``."""
        self._check_open()
        total = 0
        for pool, pages in self._pagesets(maps):
            if pages.count == 0:
                continue
            self._check_unique(pool, pages, load=False)
            self._run("backup", pool, pages, load=False, layers=None)
            total += pages.count * pool.pair.bytes_per_page_layer * pool.pair.plan.layers
        return total

    def backup_layer(self, layer: int, maps: Sequence[PageMap]) -> int:
        """Device to host: transfer layer ``layer`` only."""
        return self._one_layer(layer, maps, load=False)

    def _one_layer(self, layer: int, maps: Sequence[PageMap], *, load: bool) -> int:
        self._check_layer(layer)
        what = "load" if load else "backup"
        total = 0
        for pool, pages in self._pagesets(maps):
            pool_layer = pool.pair.pool_layer(layer)
            if pool_layer is None or pages.count == 0:
                continue
            self._check_unique(pool, pages, load=load)
            self._run(
                f"{what} of transfer layer {layer} (pool layer {pool_layer})",
                pool,
                pages,
                load=load,
                layers=(pool_layer,),
            )
            total += pages.count * pool.pair.bytes_per_page_layer
        return total

    def layer_bytes(self, layer: int, maps: Sequence[PageMap]) -> int:
        """Bytes that load_layer(layer, maps) moves, computed without copying."""
        self._check_layer(layer)
        total = 0
        for pool, page_map in self._resolve(maps):
            if pool.pair.pool_layer(layer) is not None:
                total += len(page_map) * pool.pair.bytes_per_page_layer
        return total

    # -- internals -----------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise TransferError("the transfer is closed: its runtime was closed")
        if self.host.closed:
            raise TransferError("the host group is closed: no copy can use its memory")
        if self.device.closed:
            raise TransferError("the device group is closed")

    def _check_layer(self, layer: int) -> None:
        self._check_open()
        n = self.transfer_layers
        if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < n:
            raise BindingError(f"transfer layer {layer!r} is out of range: expected 0..{n - 1}")

    def _resolve(self, maps: Sequence[PageMap]) -> list[tuple[_Pool, PageMap]]:
        """(pool, its page map) in group order; sidecars take the anchor's map."""
        if isinstance(maps, PageMap) or not isinstance(maps, (list, tuple)):
            raise ConfigError(f"maps must be a list or tuple of PageMap, got {maps!r}")
        given: dict[PoolName, PageMap] = {}
        for m in maps:
            if not isinstance(m, PageMap):
                raise ConfigError(f"maps must hold PageMap values, got {m!r}")
            if m.pool not in self._pools:
                raise ConfigError(
                    f"no pool {m.pool.value!r} in this transfer's group: it has "
                    f"{[n.value for n in self._pools]}"
                )
            if m.pool in given:
                raise ConfigError(f"pool {m.pool.value!r} has more than one page map")
            given[m.pool] = m
        anchor = given.get(self._anchor)
        for side in self._sidecars:
            own = given.get(side)
            if anchor is None:
                continue
            if own is None:
                given[side] = anchor
            elif (own.host_pages, own.device_pages) != (anchor.host_pages, anchor.device_pages):
                raise ConfigError(
                    f"sidecar pool {side.value!r} borrows the anchor's pages; its page map "
                    f"differs from the {self._anchor.value!r} map (omit it to follow the anchor)"
                )
        return [(p, given[n]) for n, p in self._pools.items() if n in given]

    def _pagesets(self, maps: Sequence[PageMap]) -> list[tuple[_Pool, PageSet]]:
        out = []
        for pool, page_map in self._resolve(maps):
            key = (pool.name, id(page_map))
            with self._lock:
                hit = self._cache.get(key)
            if hit is None or hit[0] is not page_map:
                pages = PageSet(pool.pair, page_map)
                with self._lock:
                    if len(self._cache) >= _CACHE_SIZE:
                        self._cache.pop(next(iter(self._cache)))
                    self._cache[key] = (page_map, pages)
            else:
                pages = hit[1]
            out.append((pool, pages))
        return out

    @staticmethod
    def _check_unique(pool: _Pool, pages: PageSet, *, load: bool) -> None:
        unique = pages.device_unique if load else pages.host_unique
        if not unique:
            side = "device" if load else "host"
            raise ConfigError(
                f"pool {pool.name.value!r}: a {'load' if load else 'backup'} writes {side} pages, "
                f"which must not repeat; got {pages.describe()}"
            )

    @staticmethod
    def _run(
        what: str, pool: _Pool, pages: PageSet, *, load: bool, layers: tuple[int, ...] | None
    ) -> None:
        """Copy now; translate what a backend raises into a TransferError with context."""
        try:
            if load and layers is not None:
                pool.backend.load(layers[0], pages)
            else:
                pool.backend.backup(layers, pages)
        except HiCacheError as e:
            if isinstance(e, TransferError):
                raise TransferError(
                    f"{what} of pool {pool.name.value!r} with backend {pool.backend.name!r} "
                    f"failed for {pages.describe()}: {e}"
                ) from e
            raise
        except Exception as e:
            raise TransferError(
                f"{what} of pool {pool.name.value!r} with backend {pool.backend.name!r} failed "
                f"for {pages.describe()}: {type(e).__name__}: {e}"
            ) from e


def make_transfer(
    host: HostGroup,
    device: DeviceGroup,
    *,
    backend: str | Mapping[PoolName | str, str] = AUTO,
) -> GroupTransfer:
    """A GroupTransfer (see its docstring); the one factory the composition root calls."""
    return GroupTransfer(host, device, backend=backend)


__all__ = [
    "AUTO",
    "BACKENDS",
    "ENV_BACKEND",
    "GroupTransfer",
    "backend_status",
    "check_backend_name",
    "default_backend",
    "make_transfer",
]
