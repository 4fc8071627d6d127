"""Host pool plans and the host group plan that owns their one host memory.

- PoolName: kv, swa, mamba, indexer, draft.
- pool_keyed: a mapping keyed by PoolName or pool-name strings into one keyed by PoolName.
- page_ids: an iterable of page ids into a list (a string, a number or None is refused).
- PoolRole: ANCHOR (the group's slot index space), SIDECAR (borrows the anchor's indices 1:1),
  INDEPENDENT (its own slots).
- HitPolicy: ALL_PAGES (every page of a prefix is restorable) or TRAILING_PAGES (only the last
  pages at the boundary matter: sliding windows, recurrent state checkpoints).
- PoolPlan: one pool's geometry, binding, layout, page size and capacity. It has no memory kind:
  a pool takes its host memory from its group.
- HostGroupPlan: the pools of one model rank and their one resolved HostMemory.
  HostGroupPlan(...) builds from pool plans; HostGroupPlan.assemble(...) checks pool descriptions
  that each carry their own memory kind and raises AllocatorMismatchError when they differ.
  ``transfer_layer_of`` / ``model_layer_of`` / ``pool_layer_of`` map model layer ids to transfer
  layer indices and to each pool's buffer index (without ``model_layers``: the same numbers).
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import attrs

from hicache.domain.bindings import LayerBinding
from hicache.domain.errors import AllocatorMismatchError, ConfigError, GroupError, shown
from hicache.domain.geometry import AnyGeometry, Unit
from hicache.domain.host_memory import HostMemory
from hicache.domain.layouts import Layout, check_layout, host_buffer_shape
from hicache.domain.validators import nonneg_int, optional_positive_int, positive_int


class PoolName(enum.Enum):
    KV = "kv"
    SWA = "swa"
    MAMBA = "mamba"
    INDEXER = "indexer"
    DRAFT = "draft"

    # Members are singletons compared by identity: hash them by identity too, in C. Enum's own
    # __hash__ is a Python function (hash of the name), and placements are dicts keyed by
    # pool: it was a tenth of the prefix index's insert (docs/benchmarks.md, bench cache).
    __hash__ = object.__hash__

    @classmethod
    def parse(cls, value: str | PoolName) -> PoolName:
        if isinstance(value, PoolName):
            return value
        if not isinstance(value, str):
            raise ConfigError(
                f"a pool name must be a string or a PoolName, got {shown(value)}: expected one of "
                f"{', '.join(m.value for m in cls)}"
            )
        try:
            return cls(str(value).strip().lower())
        except ValueError:
            raise ConfigError(
                f"unknown pool name {shown(value)}: expected one of {', '.join(m.value for m in cls)}"
            ) from None


def pool_keyed(value: object, what: str) -> dict[PoolName, Any]:
    """``value`` keyed by PoolName; "kv" and PoolName.KV name the same pool."""
    if not isinstance(value, Mapping):
        raise ConfigError(
            f"{what} must be a mapping of pool name to pages, got {type(value).__name__}"
        )
    return {PoolName.parse(k): v for k, v in value.items()}


def page_ids(value: object, what: str) -> list[Any]:
    """The items of an iterable of page ids; the ids themselves are checked by their users."""
    if isinstance(value, (str, bytes, Mapping)) or not isinstance(value, Iterable):
        raise ConfigError(f"{what} must be a sequence of page ids, got {shown(value)}"[:200])
    return list(value)


class PoolRole(enum.Enum):
    ANCHOR = "anchor"
    SIDECAR = "sidecar"
    INDEPENDENT = "independent"


class HitPolicy(enum.Enum):
    ALL_PAGES = "all_pages"
    TRAILING_PAGES = "trailing_pages"


def _pool_tuple(value: object) -> tuple[PoolPlan, ...]:
    if not isinstance(value, (tuple, list)):
        raise GroupError(f"pools must be a sequence of PoolPlan, got {shown(value)}")
    return tuple(value)


@attrs.frozen(kw_only=True)
class PoolPlan:
    """One host pool: what it stores per unit, for which layers, in which layout, how many units."""

    name: PoolName
    role: PoolRole
    geometry: AnyGeometry
    binding: LayerBinding
    layout: Layout
    page_size: int = attrs.field(validator=positive_int)
    capacity: int = attrs.field(validator=nonneg_int)
    hit_policy: HitPolicy = HitPolicy.ALL_PAGES
    device_capacity: int | None = None

    def __attrs_post_init__(self) -> None:
        if self.geometry.unit is Unit.SLOT and self.page_size != 1:
            raise ConfigError(
                f"pool {shown(self.name.value)} holds state slots, whose page size is 1; "
                f"got page_size={self.page_size}"
            )
        if self.capacity % self.page_size:
            raise ConfigError(
                f"pool {shown(self.name.value)}: capacity {self.capacity} is not a whole number of "
                f"pages of {self.page_size}"
            )
        check_layout(self.layout, self.geometry, pool=self.name.value)

    @property
    def unit(self) -> Unit:
        return self.geometry.unit

    @property
    def layers(self) -> int:
        return self.binding.pool_layers

    @property
    def pages(self) -> int:
        return self.capacity // self.page_size

    @property
    def bytes_per_unit_per_layer(self) -> int:
        return self.geometry.bytes_per_unit_per_layer

    @property
    def bytes_per_unit(self) -> int:
        """Bytes of one unit over all of this pool's layers."""
        return self.bytes_per_unit_per_layer * self.layers

    @property
    def bytes_per_page(self) -> int:
        return self.bytes_per_unit * self.page_size

    @property
    def nbytes(self) -> int:
        return self.bytes_per_unit * self.capacity

    def host_buffer_shapes(self) -> dict[str, tuple[int, ...]]:
        """Each buffer's host tensor shape, in this pool's layout."""
        return {
            b.name: host_buffer_shape(
                self.layout, b, layers=self.layers, capacity=self.capacity, page_size=self.page_size
            )
            for b in self.geometry.buffers
        }

    def with_capacity(self, capacity: int) -> PoolPlan:
        return attrs.evolve(self, capacity=capacity)


@attrs.frozen
class PoolDescription:
    """A pool built elsewhere (e.g. a framework's existing pool) with the memory kind it uses."""

    pool: PoolPlan
    host_memory: HostMemory


@attrs.frozen(kw_only=True)
class HostGroupPlan:
    """The host pools of one model rank, all on the group's one resolved host memory.

    ``model_layers[t]`` is the stage-local model layer id of transfer layer ``t``.
    ``sliding_window``: the model's sliding window in tokens (``ModelSpec.sliding_window``;
    plan_stack copies it), which the cache face's window rule uses; None without one.
    """

    host_memory: HostMemory
    pools: tuple[PoolPlan, ...] = attrs.field(converter=_pool_tuple)
    model_layers: tuple[int, ...] | None = attrs.field(default=None)
    model_type: str | None = None
    archetype: str | None = None
    tp_size: int = 1
    stage: tuple[int, int] | None = None
    sliding_window: int | None = attrs.field(default=None, validator=optional_positive_int)
    _transfer_layers: int = attrs.field(init=False, default=0, repr=False, eq=False)
    _by_model: dict[int, int] = attrs.field(init=False, factory=dict, repr=False, eq=False)

    def __attrs_post_init__(self) -> None:
        if not isinstance(self.host_memory, HostMemory):
            raise GroupError(
                f"host_memory must be a HostMemory (hicache.domain.resolve_host_memory), got "
                f"{shown(self.host_memory)}"
            )
        names = [p.name for p in self.pools]
        dup = sorted({n.value for n in names if names.count(n) > 1})
        if dup:
            raise GroupError(f"pool names must be unique in a group, got {dup} more than once")
        anchors = [p for p in self.pools if p.role is PoolRole.ANCHOR]
        if len(anchors) != 1:
            raise GroupError(
                f"a host group needs exactly one anchor pool, got {len(anchors)}: "
                f"{[p.name.value for p in anchors]}"
            )
        anchor = anchors[0]
        if anchor.unit is not Unit.TOKEN:
            raise GroupError(
                f"the anchor pool {shown(anchor.name.value)} must hold tokens, not slots"
            )
        for p in self.pools:
            if p.role is not PoolRole.SIDECAR:
                continue
            if p.unit is not Unit.TOKEN:
                raise GroupError(
                    f"sidecar {shown(p.name.value)} must hold tokens to share anchor indices"
                )
            if p.page_size != anchor.page_size or p.capacity != anchor.capacity:
                raise GroupError(
                    f"sidecar {shown(p.name.value)} borrows the anchor's indices and must have its page "
                    f"size and capacity ({anchor.page_size}, {anchor.capacity}); got "
                    f"({p.page_size}, {p.capacity})"
                )
        union = sorted({t for p in self.pools for t in p.binding.transfer_layers})
        if union != list(range(len(union))):
            raise GroupError(
                f"transfer layers must be numbered 0..n-1 over the union of all pools; got {union}"
            )
        # Derived once: the engine and the copy backends ask for it on every layer.
        object.__setattr__(self, "_transfer_layers", len(union))
        if self.model_layers is not None and len(self.model_layers) != len(union):
            raise GroupError(
                f"model_layers has {len(self.model_layers)} entries for {len(union)} transfer layers"
            )
        ids = self.model_layers if self.model_layers is not None else tuple(range(len(union)))
        if len(set(ids)) != len(ids):
            raise GroupError(f"model_layers names a model layer twice: {list(ids)}")
        self._by_model.update({m: t for t, m in enumerate(ids)})

    @classmethod
    def assemble(
        cls,
        descriptions: Sequence[PoolDescription],
        *,
        model_layers: Sequence[int] | None = None,
        model_type: str | None = None,
    ) -> HostGroupPlan:
        """Build a group from pools that each carry a memory kind; every kind must be the same."""
        if not descriptions:
            raise GroupError("a host group needs at least one pool, got none")
        kinds = {d.host_memory for d in descriptions}
        if len(kinds) > 1:
            listing = ", ".join(f"{d.pool.name.value}={d.host_memory}" for d in descriptions)
            raise AllocatorMismatchError(
                f"every pool of a host group must use the same host memory; got {listing}"
            )
        return cls(
            host_memory=descriptions[0].host_memory,
            pools=[d.pool for d in descriptions],
            model_layers=tuple(model_layers) if model_layers is not None else None,
            model_type=model_type,
        )

    @property
    def anchor(self) -> PoolPlan:
        return next(p for p in self.pools if p.role is PoolRole.ANCHOR)

    @property
    def transfer_layers(self) -> int:
        return self._transfer_layers

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.pools)

    @property
    def cached_model_layers(self) -> tuple[int, ...]:
        """The model layer id of each transfer layer (the transfer indices without model_layers)."""
        if self.model_layers is not None:
            return self.model_layers
        return tuple(range(self._transfer_layers))

    def transfer_layer_of(self, model_layer: int) -> int | None:
        """The transfer layer of model layer ``model_layer``; None if it holds no cache here."""
        if type(model_layer) is not int or model_layer < 0:
            raise ConfigError(
                f"model layer must be a non-negative integer, got {shown(model_layer)}"
            )
        return self._by_model.get(model_layer)

    def model_layer_of(self, transfer_layer: int) -> int:
        """The model layer id of transfer layer ``transfer_layer``."""
        n = self._transfer_layers
        if type(transfer_layer) is not int or not 0 <= transfer_layer < n:
            raise ConfigError(
                f"transfer layer {shown(transfer_layer)} is out of range: expected 0..{n - 1}"
            )
        return self.cached_model_layers[transfer_layer]

    def pool_layer_of(self, pool: PoolName | str, model_layer: int) -> int | None:
        """The buffer index in ``pool`` that model layer ``model_layer`` uses; None if none."""
        plan = self.pool(pool)
        transfer = self.transfer_layer_of(model_layer)
        return None if transfer is None else plan.binding.pool_layer(transfer)

    def pool(self, name: PoolName | str) -> PoolPlan:
        key = PoolName.parse(name)
        for p in self.pools:
            if p.name is key:
                return p
        raise GroupError(
            f"no pool {shown(key.value)} in this group: it has {[p.name.value for p in self.pools]}"
        )

    def memory_of(self, _pool: PoolPlan | PoolName | str) -> HostMemory:
        """Every pool's host memory is the group's; there is no other."""
        return self.host_memory

    def independent_pools(self) -> Iterable[PoolPlan]:
        """Pools that own slots: the anchor first, then the independent pools in group order."""
        yield self.anchor
        yield from (p for p in self.pools if p.role is PoolRole.INDEPENDENT)

    def as_json(self) -> dict[str, Any]:
        mem = self.host_memory.as_json()
        anchor = self.anchor
        return {
            "model_type": self.model_type,
            "archetype": self.archetype,
            "tp_size": self.tp_size,
            "stage": list(self.stage) if self.stage is not None else None,
            "page_size": anchor.page_size,
            "layout": anchor.layout.value,
            "transfer_layers": self.transfer_layers,
            "model_layers": list(self.model_layers) if self.model_layers is not None else None,
            "host_memory": mem,
            "host_bytes_total": self.nbytes,
            "pools": [
                {
                    "name": p.name.value,
                    "role": p.role.value,
                    "kind": p.geometry.kind,
                    "layers": p.layers,
                    "unit": p.unit.value,
                    "bytes_per_unit_per_layer": p.bytes_per_unit_per_layer,
                    "page_size": p.page_size,
                    "capacity": p.capacity,
                    "bytes": p.nbytes,
                    "layout": p.layout.value,
                    "host_memory": dict(mem),
                    "hit_policy": p.hit_policy.value,
                    "binding": {str(t): pl for t, pl in p.binding.pairs},
                }
                for p in self.pools
            ],
        }
