"""Layer bindings: transfer layer -> pool layer, injective and in range; the transfer-layer union."""

from __future__ import annotations

import pytest

from hicache.domain import BindingError, LayerBinding, stage_local, transfer_layer_count


def test_contiguous_binds_in_the_given_order() -> None:
    b = LayerBinding.contiguous([3, 7, 11])
    assert b.as_dict() == {3: 0, 7: 1, 11: 2}
    assert b.pool_layers == 3
    assert b.transfer_layers == (3, 7, 11)
    assert len(b) == 3


def test_pool_layer_is_none_where_the_pool_has_nothing() -> None:
    b = LayerBinding.contiguous([1, 3])
    assert b.pool_layer(3) == 1
    assert b.pool_layer(2) is None


def test_binding_accepts_a_mapping_or_pairs_and_sorts_them() -> None:
    a = LayerBinding({5: 1, 2: 0}, 2)
    b = LayerBinding([(2, 0), (5, 1)], 2)
    assert a == b
    assert a.pairs == ((2, 0), (5, 1))


def test_a_pool_may_have_more_layers_than_are_bound() -> None:
    assert LayerBinding({0: 2}, 4).pool_layer(0) == 2


def test_two_transfer_layers_on_one_pool_layer_is_not_injective() -> None:
    with pytest.raises(BindingError, match=r"pool layers \[0\] are bound to more than one"):
        LayerBinding([(0, 0), (1, 0)], 2)


def test_one_transfer_layer_bound_twice_is_rejected() -> None:
    with pytest.raises(BindingError, match=r"transfer layers \[1\] are bound more than once"):
        LayerBinding([(1, 0), (1, 1)], 2)


def test_pool_layer_out_of_range_names_it_and_the_pool_size() -> None:
    with pytest.raises(BindingError, match=r"pool layers \[2\] are out of range: the pool has 2"):
        LayerBinding([(0, 0), (1, 2)], 2)


def test_negative_ids_are_rejected() -> None:
    with pytest.raises(BindingError, match="transfer layers must be >= 0"):
        LayerBinding([(-1, 0)], 1)
    with pytest.raises(BindingError, match="out of range"):
        LayerBinding([(0, -1)], 1)
    with pytest.raises(BindingError, match="pool_layers must be >= 0"):
        LayerBinding([], -1)


def test_transfer_layer_count_is_the_size_of_the_union() -> None:
    # Qwen3-Next style: full attention every 4th layer, linear attention elsewhere.
    full = LayerBinding.contiguous([3, 7, 11])
    linear = LayerBinding.contiguous([0, 1, 2, 4, 5, 6, 8, 9, 10])
    assert transfer_layer_count([full, linear]) == 12
    # An indexer on the same layers as the anchor adds no transfer layer.
    assert transfer_layer_count([full, LayerBinding.contiguous([3, 7, 11])]) == 3
    assert transfer_layer_count([]) == 0


def test_stage_local_keeps_the_stage_and_subtracts_its_start() -> None:
    assert stage_local([0, 3, 7, 11, 15], 4, 12) == (3, 7)
    assert stage_local(range(10), 0, 10) == tuple(range(10))
    assert stage_local([1, 2], 5, 5) == ()


@pytest.mark.parametrize(("start", "end"), [(-1, 4), (5, 4)])
def test_stage_local_rejects_a_bad_range(start: int, end: int) -> None:
    with pytest.raises(BindingError, match="not a valid layer range"):
        stage_local([1], start, end)
