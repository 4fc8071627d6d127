"""Layer bindings: which transfer layer maps to which of a pool's own buffer layers.

- LayerBinding: an injective map transfer layer -> pool-local layer, validated on construction.
- LayerBinding.contiguous: bind the given transfer layers to pool layers 0..n-1 in order.
- transfer_layer_count: the size of the union of the transfer layers of several bindings.
- stage_local: global model layer ids of one pipeline stage to stage-local ids.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import attrs

from hicache.domain.errors import BindingError, shown


def _layer(value: object, what: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise BindingError(f"{what} must be an integer layer id, got {value!r}"[:200])
    return value


def _pairs(value: object) -> tuple[tuple[int, int], ...]:
    """The (transfer, pool) layer pairs as ints; a float, bool or text layer id is refused
    (``int(1.5)`` would silently bind layer 1)."""
    if isinstance(value, Mapping):
        items: Iterable[object] = value.items()
    elif isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        raise BindingError(
            f"a binding must be a mapping or pairs of transfer -> pool layer, got {shown(value)}"
        )
    else:
        items = value
    out = []
    for item in items:
        if not isinstance(item, (tuple, list)) or len(item) != 2:
            raise BindingError(f"a binding pair must be (transfer, pool), got {shown(item)}")
        out.append((_layer(item[0], "a transfer layer"), _layer(item[1], "a pool layer")))
    return tuple(sorted(out))


@attrs.frozen
class LayerBinding:
    """An injective map from transfer layers to the pool's own layers ``0..pool_layers-1``."""

    pairs: tuple[tuple[int, int], ...] = attrs.field(converter=_pairs)
    pool_layers: int

    def __attrs_post_init__(self) -> None:
        if not isinstance(self.pool_layers, int) or isinstance(self.pool_layers, bool):
            raise BindingError(f"pool_layers must be an integer, got {shown(self.pool_layers)}")
        if self.pool_layers < 0:
            raise BindingError(f"pool_layers must be >= 0, got {self.pool_layers}")
        transfer = [t for t, _ in self.pairs]
        pool = [p for _, p in self.pairs]
        if len(set(transfer)) != len(transfer):
            dup = sorted({t for t in transfer if transfer.count(t) > 1})
            raise BindingError(f"transfer layers {dup} are bound more than once")
        if len(set(pool)) != len(pool):
            dup = sorted({p for p in pool if pool.count(p) > 1})
            raise BindingError(f"pool layers {dup} are bound to more than one transfer layer")
        bad_t = [t for t in transfer if t < 0]
        if bad_t:
            raise BindingError(f"transfer layers must be >= 0, got {bad_t}")
        bad_p = [p for p in pool if not 0 <= p < self.pool_layers]
        if bad_p:
            raise BindingError(
                f"pool layers {bad_p} are out of range: the pool has {self.pool_layers} layers"
            )

    @classmethod
    def contiguous(cls, transfer_layers: Sequence[int]) -> LayerBinding:
        """Bind ``transfer_layers`` (in the given order) to pool layers 0, 1, 2, ..."""
        if isinstance(transfer_layers, (str, bytes)) or not isinstance(
            transfer_layers, (Sequence, range)
        ):
            raise BindingError(
                f"transfer layers must be a sequence of layer ids, got {transfer_layers!r}"[:200]
            )
        return cls([(t, i) for i, t in enumerate(transfer_layers)], len(transfer_layers))

    @property
    def transfer_layers(self) -> tuple[int, ...]:
        return tuple(t for t, _ in self.pairs)

    def __len__(self) -> int:
        return len(self.pairs)

    def pool_layer(self, transfer_layer: int) -> int | None:
        """The pool's layer for ``transfer_layer``, or None when the pool has nothing there."""
        for t, p in self.pairs:
            if t == transfer_layer:
                return p
        return None

    def as_dict(self) -> dict[int, int]:
        return dict(self.pairs)


def transfer_layer_count(bindings: Iterable[LayerBinding]) -> int:
    """The number of distinct transfer layers over all bindings (the size of their union)."""
    union: set[int] = set()
    for b in bindings:
        union.update(b.transfer_layers)
    return len(union)


def stage_local(global_layers: Iterable[int], start_layer: int, end_layer: int) -> tuple[int, ...]:
    """The stage-local ids (global id - start_layer) of the layers in ``[start, end)``."""
    if not 0 <= start_layer <= end_layer:
        raise BindingError(f"stage range [{start_layer}, {end_layer}) is not a valid layer range")
    return tuple(g - start_layer for g in global_layers if start_layer <= g < end_layer)
