"""Device pools: the serving framework's per-layer cache buffers, allocated here or wrapped.

- parse_torch_device: "cpu", "cuda[:N]" or "rocm[:N]" (ROCm through torch.cuda) into a
  torch.device, checking up front that a GPU is really there.
- DevicePool: one pool's buffers on the device, per buffer a tuple of per-layer tensors of shape
  (capacity, *row) like a framework's ``k_buffer[layer]``; DevicePool.allocate(plan, ...) makes
  them, DevicePool.wrap(plan, buffers) checks and adopts a framework's tensors as views, without
  a copy: (capacity, *row) contiguous; the same with size-1 axes added or dropped (SGLang's MLA
  buffer (N, 1, 576)); or paged (blocks, page_size, *row) with each page contiguous and any page
  stride (vLLM's FlashInfer cache (blocks, 2, block_size, H, D) passed as ``t[:, 0]``/``t[:, 1]``).
- DevicePool.paged / paged_stacked: per-layer (pages, page_size, *row) views, what copies use.
- DeviceGroup: the device pools of one host group plan; DeviceGroup.allocate / DeviceGroup.wrap.

Device page ``p`` of a pool is its units ``[p * page_size, (p + 1) * page_size)``; state pools
have page size 1, so a page is a slot. A sidecar (indexer) uses the anchor's device pages, so
its capacity must equal the anchor's. fp8 buffers are held as uint8 views (raw bytes).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from types import MappingProxyType

import torch

from hicache.adapters.devices import parse_device_name
from hicache.adapters.dtypes import accepted_dtypes, as_storage, torch_dtype
from hicache.domain import (
    ConfigError,
    DeviceError,
    HostGroupPlan,
    PoolName,
    PoolPlan,
    PoolRole,
)
from hicache.domain.errors import shown
from hicache.domain.geometry import BufferSpec
from hicache.domain.pools import pool_keyed


def parse_torch_device(device: str | torch.device) -> torch.device:
    """``device`` as a torch.device; a GPU device raises DeviceError unless one is usable."""
    if isinstance(device, torch.device):
        text = str(device)
    elif isinstance(device, str):
        text = device.strip().lower()
    else:
        raise ConfigError(f"device must be 'cpu', 'cuda[:N]' or 'rocm[:N]', got {device!r}")
    kind, index = parse_device_name(text)
    if kind == "cpu":
        return torch.device("cpu")
    if kind == "rocm" and torch.version.hip is None:
        raise DeviceError(
            f"device {device!r} asks for ROCm, but this torch ({torch.__version__}) is not a ROCm "
            f"build"
        )
    if not torch.cuda.is_available():
        raise DeviceError(
            f"device {device!r} asks for a GPU, but torch {torch.__version__} sees none "
            f"(torch.cuda.is_available() is False)"
        )
    idx = index if index is not None else torch.cuda.current_device()
    count = torch.cuda.device_count()
    if not 0 <= idx < count:
        raise DeviceError(f"device {device!r}: GPU index {idx} out of range (0..{count - 1})")
    return torch.device("cuda", idx)


def _check_capacity(plan: PoolPlan, capacity: object) -> int:
    if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity <= 0:
        raise DeviceError(
            f"pool {plan.name.value!r}: device capacity must be a positive number of "
            f"{plan.unit.value}s, got {capacity!r}"
        )
    if capacity % plan.page_size:
        raise DeviceError(
            f"pool {plan.name.value!r}: device capacity {capacity} is not a whole number of "
            f"pages of {plan.page_size} {plan.unit.value}s"
        )
    return capacity


def _capacity_stacked(
    layers: Sequence[torch.Tensor], capacity: int, spec: BufferSpec
) -> torch.Tensor | None:
    """(L, capacity, *row) over wrapped layers given as (capacity, *row) or size-1 variants."""
    if any(t.shape[0] != capacity or not t.is_contiguous() for t in layers):
        return None  # paged buffers: only paged_stacked applies
    return _layer_strided([t.view(capacity, *spec.shape) for t in layers])


def _layer_strided(layers: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """One (L, *shape) view over per-layer tensors that sit at a constant stride in one storage."""
    first = layers[0]
    if len(layers) == 1:
        return first.unsqueeze(0)
    ptr = first.untyped_storage().data_ptr()
    delta = layers[1].data_ptr() - first.data_ptr()
    size = first.element_size()
    span = first.numel() * size
    if delta < span or delta % size:
        return None
    for i, t in enumerate(layers):
        if (
            t.untyped_storage().data_ptr() != ptr
            or t.shape != first.shape
            or t.stride() != first.stride()
            or t.data_ptr() - first.data_ptr() != i * delta
        ):
            return None
    return torch.as_strided(
        first,
        size=(len(layers), *first.shape),
        stride=(delta // size, *first.stride()),
        storage_offset=first.storage_offset(),
    )


class DevicePool:
    """One pool's buffers on a device: per buffer, one tensor per pool layer."""

    def __init__(
        self,
        plan: PoolPlan,
        *,
        device: torch.device,
        capacity: int,
        buffers: Mapping[str, Sequence[torch.Tensor]],
        stacked: Mapping[str, torch.Tensor | None],
        owned: bool,
    ) -> None:
        # Use DevicePool.allocate or DevicePool.wrap; this trusts what they checked.
        self.plan = plan
        self.device = device
        self.capacity = capacity
        self.owned = owned
        self._buffers = {k: tuple(v) for k, v in buffers.items()}
        self._stacked = dict(stacked)
        specs = {b.name: tuple(b.shape) for b in plan.geometry.buffers}
        page = plan.page_size
        self._paged = {
            k: tuple(_paged_view(f"buffer {k!r}", t, specs[k], page) for t in v)
            for k, v in self._buffers.items()
        }
        self._paged_stacked = {k: _layer_strided(v) for k, v in self._paged.items()}
        self._closed = False

    @classmethod
    def allocate(
        cls, plan: PoolPlan, *, device: str | torch.device = "cpu", capacity: int | None = None
    ) -> DevicePool:
        """Zeroed per-layer buffers for ``plan``: capacity defaults to ``plan.device_capacity``."""
        dev = parse_torch_device(device)
        cap = plan.device_capacity if capacity is None else capacity
        if cap is None:
            raise DeviceError(
                f"pool {plan.name.value!r} has no device capacity in its plan; pass capacity="
            )
        cap = _check_capacity(plan, cap)
        buffers: dict[str, tuple[torch.Tensor, ...]] = {}
        stacked: dict[str, torch.Tensor | None] = {}
        for spec in plan.geometry.buffers:
            try:
                # One allocation per buffer: every layer is a view of it, so an all-layer copy
                # of a run of pages is one strided slab.
                whole = torch.zeros(
                    (plan.layers, cap, *spec.shape), dtype=torch_dtype(spec.dtype), device=dev
                )
            except (RuntimeError, MemoryError) as e:
                nbytes = plan.layers * cap * spec.nbytes
                raise DeviceError(
                    f"pool {plan.name.value!r} buffer {spec.name!r}: cannot allocate "
                    f"{nbytes} B on {dev}: {e}"
                ) from e
            buffers[spec.name] = tuple(whole.unbind(0))
            stacked[spec.name] = whole
        return cls(plan, device=dev, capacity=cap, buffers=buffers, stacked=stacked, owned=True)

    @classmethod
    def wrap(
        cls,
        plan: PoolPlan,
        buffers: Mapping[str, Sequence[torch.Tensor]],
        *,
        capacity: int | None = None,
    ) -> DevicePool:
        """Adopt a framework's per-layer tensors after checking them against ``plan``.

        ``buffers`` maps each of the plan's buffer names (``k``/``v`` for MHA, ``kv`` for MLA,
        ``k`` for the indexer, the state tensor names) to one tensor per pool layer, each of
        shape (capacity, *row) in the buffer's dtype (fp8: the torch float8 dtype or uint8),
        contiguous, all on one device. Raises DeviceError naming pool, buffer, layer and the
        mismatch.
        """
        pool = plan.name.value
        if not isinstance(buffers, Mapping):
            raise DeviceError(
                f"pool {pool!r}: expected a mapping of buffer name to per-layer tensors, got "
                f"{type(buffers).__name__}"
            )
        specs = {b.name: b for b in plan.geometry.buffers}
        missing = sorted(set(specs) - set(buffers))
        extra = sorted(shown(b) for b in buffers if b not in specs)  # any key type, shown short
        if missing or extra:
            raise DeviceError(
                f"pool {pool!r} ({plan.geometry.kind}) has buffers {sorted(specs)}; missing "
                f"{missing}, unexpected [{', '.join(extra)}]"
            )
        device: torch.device | None = None
        cap = capacity
        adopted: dict[str, tuple[torch.Tensor, ...]] = {}
        for name, spec in specs.items():
            layers: object = buffers[name]
            if isinstance(layers, torch.Tensor) or not isinstance(layers, (list, tuple)):
                raise DeviceError(
                    f"pool {pool!r} buffer {name!r}: expected a sequence of {plan.layers} "
                    f"per-layer tensors, got {type(layers).__name__}"
                )
            if len(layers) != plan.layers:
                raise DeviceError(
                    f"pool {pool!r} buffer {name!r}: got {len(layers)} layer tensors, the plan "
                    f"has {plan.layers} layers"
                )
            out = []
            for layer, t in enumerate(layers):
                where = f"pool {pool!r} buffer {name!r} layer {layer}"
                cap, device = _check_layer(where, t, spec, plan, cap, device)
                out.append(as_storage(t, spec.dtype))
            adopted[name] = tuple(out)
        if cap is None or device is None:  # plan.layers >= 1 guarantees both
            raise DeviceError(f"pool {pool!r} has no layers to wrap")
        _check_capacity(plan, cap)
        stacked = {name: _capacity_stacked(ts, cap, specs[name]) for name, ts in adopted.items()}
        return cls(plan, device=device, capacity=cap, buffers=adopted, stacked=stacked, owned=False)

    # -- what the pool is ---------------------------------------------------------------------

    @property
    def name(self) -> PoolName:
        return self.plan.name

    @property
    def page_size(self) -> int:
        return self.plan.page_size

    @property
    def pages(self) -> int:
        return self.capacity // self.plan.page_size

    @property
    def layers(self) -> int:
        return self.plan.layers

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def buffers(self) -> Mapping[str, tuple[torch.Tensor, ...]]:
        """Buffer name -> per-layer tensors as allocated (capacity, *row) or as the framework gave them."""
        self._check_open()
        return MappingProxyType(self._buffers)

    def layer(self, buffer: str, layer: int) -> torch.Tensor:
        """The tensor of pool layer ``layer`` of ``buffer`` (like ``k_buffer[layer]``)."""
        self._check_open()
        if buffer not in self._buffers:
            raise ConfigError(
                f"pool {self.name.value!r} has no buffer {buffer!r}: it has {sorted(self._buffers)}"
            )
        if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < self.layers:
            raise ConfigError(
                f"pool {self.name.value!r} has layers 0..{self.layers - 1}, got {layer!r}"
            )
        return self._buffers[buffer][layer]

    def stacked(self, buffer: str) -> torch.Tensor | None:
        """All layers of ``buffer`` as one (L, capacity, *row) view, when they share a stride."""
        self._check_open()
        return self._stacked.get(buffer)

    def paged(self, buffer: str) -> tuple[torch.Tensor, ...]:
        """Per-layer (pages, page_size, *row) views of ``buffer`` (what the copy backends use)."""
        self._check_open()
        return self._paged[buffer]

    def paged_stacked(self, buffer: str) -> torch.Tensor | None:
        """All layers as one (L, pages, page_size, *row) view, when they share a stride."""
        self._check_open()
        return self._paged_stacked.get(buffer)

    @property
    def nbytes(self) -> int:
        return self.capacity * self.plan.bytes_per_unit

    def _check_open(self) -> None:
        if self._closed:
            raise DeviceError(f"device pool {self.name.value!r} is closed")

    def close(self) -> None:
        """Drop this pool's references to its tensors (frees what it allocated); idempotent."""
        self._closed = True
        self._buffers.clear()
        self._stacked.clear()
        self._paged.clear()
        self._paged_stacked.clear()

    def __repr__(self) -> str:
        how = "allocated" if self.owned else "wrapped"
        state = "closed" if self._closed else f"{self.pages} pages x {self.layers} layers"
        return (
            f"<DevicePool {self.name.value} ({self.plan.geometry.kind}) on {self.device}, "
            f"{how}: {state}>"
        )


def _check_layer(
    where: str,
    t: object,
    spec: BufferSpec,
    plan: PoolPlan,
    capacity: int | None,
    device: torch.device | None,
) -> tuple[int, torch.device]:
    if not isinstance(t, torch.Tensor):
        raise DeviceError(f"{where}: expected a torch.Tensor, got {type(t).__name__}")
    if t.device.type not in ("cpu", "cuda"):
        raise DeviceError(f"{where}: tensor is on {t.device}; expected cpu or a cuda/rocm GPU")
    if device is not None and t.device != device:
        raise DeviceError(f"{where}: tensor is on {t.device}, the pool's other tensors on {device}")
    accepted = accepted_dtypes(spec.dtype)
    if t.dtype not in accepted:
        raise DeviceError(
            f"{where}: dtype {t.dtype} does not match the plan's {spec.dtype.value} "
            f"(expected {' or '.join(str(d) for d in accepted)})"
        )
    if t.requires_grad:
        raise DeviceError(f"{where}: tensor requires grad; a cache buffer must not")
    rows = int(_paged_view(where, t, tuple(spec.shape), plan.page_size).shape[0]) * plan.page_size
    if capacity is not None and rows != capacity:
        raise DeviceError(
            f"{where}: has {rows} {plan.unit.value}s, the pool's capacity is {capacity}"
        )
    return rows, t.device


def _contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    out, step = [], 1
    for size in reversed(shape):
        out.append(step)
        step *= size
    return tuple(reversed(out))


def _dense(t: torch.Tensor, first: int) -> bool:
    """Whether axes ``first..`` of ``t`` are laid out contiguously (size-1 axes may stride freely)."""
    want = _contiguous_strides(t.shape[first:])
    return all(
        size == 1 or stride == w
        for size, stride, w in zip(t.shape[first:], t.stride()[first:], want, strict=True)
    )


def _paged_view(where: str, t: torch.Tensor, row: tuple[int, ...], page: int) -> torch.Tensor:
    """``t`` as a (pages, page, *row) view (no copy), or a DeviceError saying what was expected.

    Accepted: (capacity, *row) contiguous; (capacity, *row') where row' is row with size-1 axes
    added or dropped (SGLang's MLA (N, 1, 576) for row (576,)), contiguous; (blocks, page, *row)
    with every page contiguous and pages at any stride >= one page (vLLM's FlashInfer
    ``kv_cache[:, 0]`` of a (blocks, 2, block_size, H, D) cache).
    """
    shape = tuple(int(d) for d in t.shape)
    expected = (
        f"expected (capacity, {', '.join(str(d) for d in row)}) contiguous, the same with size-1 "
        f"axes, or (blocks, {page}, {', '.join(str(d) for d in row)}) with contiguous pages"
    )
    unit_elems = math.prod(row)
    if len(shape) == 2 + len(row) and shape[1] == page and shape[2:] == row and len(shape) > 1:
        if not _dense(t, 1):
            raise DeviceError(
                f"{where}: the pages of shape {shape} are not contiguous (strides "
                f"{tuple(t.stride())}); {expected}"
            )
        if shape[0] > 1 and t.stride(0) < page * unit_elems:
            raise DeviceError(f"{where}: pages overlap (page stride {t.stride(0)}); {expected}")
        return t
    if len(shape) >= 1 and tuple(d for d in shape[1:] if d != 1) == tuple(d for d in row if d != 1):
        if not t.is_contiguous():
            raise DeviceError(
                f"{where}: tensor is not contiguous (shape {shape}, strides "
                f"{tuple(t.stride())}); {expected}"
            )
        if shape[0] % page:
            raise DeviceError(
                f"{where}: {shape[0]} rows are not a whole number of pages of {page}; {expected}"
            )
        return t.view(shape[0] // page, page, *row)
    raise DeviceError(f"{where}: shape {shape} does not match the plan: {expected}")


class DeviceGroup:
    """The device pools of one host group plan (every pool of the plan, one device)."""

    def __init__(self, plan: HostGroupPlan, pools: Mapping[PoolName, DevicePool]) -> None:
        # Use DeviceGroup.allocate or DeviceGroup.wrap.
        self.plan = plan
        self._pools = dict(pools)
        devices = {p.device for p in self._pools.values()}
        if len(devices) != 1:
            raise DeviceError(
                f"a device group lives on one device; got "
                f"{ {n.value: str(p.device) for n, p in self._pools.items()} }"
            )
        self.device: torch.device = devices.pop()
        anchor = self._pools[plan.anchor.name]
        for p in self._pools.values():
            if p.plan.role is PoolRole.SIDECAR and p.capacity != anchor.capacity:
                raise DeviceError(
                    f"sidecar pool {p.name.value!r} uses the anchor's device pages, so its "
                    f"capacity must be the anchor's {anchor.capacity}; got {p.capacity}"
                )

    @classmethod
    def allocate(
        cls,
        plan: HostGroupPlan,
        *,
        device: str | torch.device = "cpu",
        capacities: Mapping[PoolName | str, int] | None = None,
    ) -> DeviceGroup:
        """Allocate every pool of ``plan``; capacities default to each plan's device_capacity."""
        caps = pool_keyed(capacities or {}, "device capacities")
        unknown = sorted(n.value for n in caps if n not in {p.name for p in plan.pools})
        if unknown:
            raise ConfigError(
                f"capacities name pools {unknown} that the plan does not have "
                f"({[p.name.value for p in plan.pools]})"
            )
        anchor_cap = caps.get(plan.anchor.name)
        pools = {}
        for p in plan.pools:
            cap = caps.get(p.name)
            if cap is None and p.role is PoolRole.SIDECAR:
                cap = anchor_cap
            pools[p.name] = DevicePool.allocate(p, device=device, capacity=cap)
        return cls(plan, pools)

    @classmethod
    def wrap(
        cls,
        plan: HostGroupPlan,
        tensors: Mapping[PoolName | str, Mapping[str, Sequence[torch.Tensor]]],
    ) -> DeviceGroup:
        """Adopt a framework's tensors for every pool of ``plan`` (see DevicePool.wrap)."""
        given = {PoolName.parse(k): v for k, v in tensors.items()}
        names = [p.name for p in plan.pools]
        missing = [n.value for n in names if n not in given]
        extra = sorted(n.value for n in given if n not in names)
        if missing or extra:
            raise DeviceError(
                f"the plan has pools {[n.value for n in names]}; missing {missing}, "
                f"unexpected {extra}"
            )
        return cls(plan, {p.name: DevicePool.wrap(p, given[p.name]) for p in plan.pools})

    @property
    def pools(self) -> Mapping[PoolName, DevicePool]:
        return MappingProxyType(self._pools)

    def pool(self, name: PoolName | str) -> DevicePool:
        key = PoolName.parse(name)
        try:
            return self._pools[key]
        except KeyError:
            raise ConfigError(
                f"no pool {key.value!r} in this device group: it has "
                f"{[n.value for n in self._pools]}"
            ) from None

    def __iter__(self) -> Iterator[DevicePool]:
        return iter(self._pools.values())

    @property
    def closed(self) -> bool:
        return all(p.closed for p in self._pools.values())

    def close(self) -> None:
        for p in self._pools.values():
            p.close()

    def __repr__(self) -> str:
        inner = ", ".join(repr(p) for p in self._pools.values())
        return f"<DeviceGroup on {self.device}: {inner}>"


__all__ = ["DeviceGroup", "DevicePool", "parse_torch_device"]
