"""Namespaces: what makes bytes incompatible changes the namespace, never the page key."""

from __future__ import annotations

import attrs
import pytest

from hicache.domain import (
    ConfigError,
    DType,
    HostGroupPlan,
    KVGeometry,
    Layout,
    MLAGeometry,
    PoolName,
)
from hicache.domain.keys import chain_keys
from hicache.domain.namespace import (
    RankIdentity,
    group_namespaces,
    pool_namespace,
    rank_replicated,
    store_keys,
)
from tests.domain.builders import ANON, anchor, sidecar, state_pool

KV = PoolName.KV


def group(tp: int = 2, **kw: object) -> HostGroupPlan:
    return HostGroupPlan(
        host_memory=ANON, pools=[anchor(**kw)], tp_size=tp, model_type="llama", stage=(0, 2)
    )


def ns(plan: HostGroupPlan, rank: int = 0, model: str = "org/model-7b", pp: int = 0) -> str:
    return pool_namespace(plan, KV, RankIdentity(model=model, tp_rank=rank, pp_rank=pp))


def test_namespace_is_a_valid_store_key_token_and_deterministic() -> None:
    a = ns(group())
    assert a == ns(group())
    assert a.startswith("org_model_7b-")
    key = store_keys(a, KV, chain_keys([1, 2, 3, 4], 4))[0]
    assert str(key).startswith(a + "/kv/")


@pytest.mark.parametrize(
    "change",
    [
        {"model": "org/other"},
        {"rank": 1},
        {"pp": 1},
        {"plan": {"page_size": 32}},
        {"plan": {"layout": Layout.LAYER_FIRST}},
        {"plan": {"geometry": KVGeometry(kv_heads=2, head_dim=64, dtype=DType.FP16)}},
        {"plan": {"geometry": KVGeometry(kv_heads=4, head_dim=64)}},
        {"plan": {"transfer": [0, 1, 2]}},
    ],
)
def test_everything_that_changes_bytes_changes_the_namespace(change: dict[str, object]) -> None:
    base = ns(group())
    plan_kw = change.get("plan", {})
    other = ns(
        group(**plan_kw),  # type: ignore[arg-type]
        rank=int(change.get("rank", 0)),  # type: ignore[call-overload]
        model=str(change.get("model", "org/model-7b")),
        pp=int(change.get("pp", 0)),  # type: ignore[call-overload]
    )
    assert other != base


def test_latent_attention_bytes_share_one_namespace_over_tp_ranks() -> None:
    mla = group(geometry=MLAGeometry(kv_lora_rank=512, qk_rope_head_dim=64))
    assert rank_replicated(mla.pool(KV))
    assert ns(mla, rank=0) == ns(mla, rank=1)
    mha = group()
    assert not rank_replicated(mha.pool(KV))
    assert ns(mha, rank=0) != ns(mha, rank=1)


def test_each_pool_of_a_group_has_its_own_namespace() -> None:
    plan = HostGroupPlan(
        host_memory=ANON, pools=[anchor(), sidecar(), state_pool(capacity=8)], tp_size=1
    )
    spaces = group_namespaces(plan, RankIdentity(model="m"))
    assert set(spaces) == {PoolName.KV, PoolName.INDEXER, PoolName.MAMBA}
    assert len(set(spaces.values())) == 3


def test_a_rank_outside_the_plan_or_an_empty_model_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="tp_rank 2 is out of range for tp_size 2"):
        ns(group(), rank=2)
    with pytest.raises(ConfigError, match="model name"):
        RankIdentity(model=" ")
    with pytest.raises(ConfigError, match="tp_rank"):
        RankIdentity(model="m", tp_rank=-1)


def test_the_page_key_does_not_depend_on_the_namespace() -> None:
    keys = chain_keys(list(range(8)), 4)
    a = store_keys(ns(group()), KV, keys)
    b = store_keys(ns(group(), rank=1), KV, keys)
    assert [k.page_hash for k in a] == [k.page_hash for k in b]
    assert attrs.evolve(a[0], namespace=b[0].namespace) == b[0]
