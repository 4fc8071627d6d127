"""Which models' pages are read across tensor parallel sizes, and the namespace that then
drops the size (hicache.integrations.vllm.tp_shape, over vLLM's own spec classes)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from tests.integrations.vllm.vllm_support import require_vllm

require_vllm()

import torch  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
)

from hicache.domain import ConfigError  # noqa: E402
from hicache.integrations.vllm.layout import Shape, layout_of  # noqa: E402
from hicache.integrations.vllm.settings import ConnectorSettings  # noqa: E402
from hicache.integrations.vllm.tp_plan import TpHeads  # noqa: E402
from hicache.integrations.vllm.tp_shape import namespace_ident, tp_heads  # noqa: E402

pytestmark = pytest.mark.vllm
BLOCK = 32


def _vllm(tp: int, total: int, *, mla: bool = False, dcp: int = 1) -> SimpleNamespace:
    return SimpleNamespace(
        parallel_config=SimpleNamespace(tensor_parallel_size=tp, decode_context_parallel_size=dcp),
        model_config=SimpleNamespace(use_mla=mla, get_total_num_kv_heads=lambda: total),
    )


def _config(*groups: KVCacheGroupSpec) -> KVCacheConfig:
    return KVCacheConfig(num_blocks=16, kv_cache_tensors=[], kv_cache_groups=list(groups))


def _dense(per_rank: int, **more: object) -> KVCacheConfig:
    spec = FullAttentionSpec(
        block_size=BLOCK, num_kv_heads=per_rank, head_size=64, dtype=torch.bfloat16, **more
    )
    return _config(KVCacheGroupSpec(["l0", "l1"], spec))


def _heads(vllm: SimpleNamespace, config: KVCacheConfig) -> TpHeads | None:
    layout = layout_of(config)
    return tp_heads(vllm, config, layout.attn_group, bool(layout.state))  # type: ignore[arg-type]


def _ident(tp: int, total: int, config: KVCacheConfig, **more: object) -> str:
    layout = layout_of(config)
    heads = _heads(_vllm(tp, total, **more), config)
    return namespace_ident("m", "bf16", BLOCK, layout, layout.kv, tp, heads)


def test_a_dense_model_has_one_namespace_at_every_tp_size() -> None:
    config = _dense(2)
    assert _heads(_vllm(2, 4), config) == TpHeads(4)
    idents = {_ident(tp, 4, _dense(4 // tp)) for tp in (1, 2, 4)}
    idents.add(_ident(8, 4, _dense(1)))  # replicated heads
    assert len(idents) == 1


def test_another_model_shape_keeps_another_namespace() -> None:
    assert _ident(1, 4, _dense(4)) != _ident(1, 8, _dense(8))


def test_mla_is_replicated_and_shares_its_namespace_across_sizes() -> None:
    spec = MLAAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=576, dtype=torch.bfloat16)
    config = _config(KVCacheGroupSpec(["l0"], spec))
    heads = _heads(_vllm(2, 8, mla=True), config)
    assert heads == TpHeads(1, replicated=True)
    assert _ident(1, 8, config, mla=True) == _ident(4, 8, config, mla=True)


def test_models_whose_pages_do_not_split_by_head_keep_the_tp_size() -> None:
    padded = _dense(2, page_size_padded=2 * 64 * 2 * 2 * BLOCK + 64)
    assert _heads(_vllm(2, 4), padded) is None
    dense = _dense(2)
    assert _heads(_vllm(2, 4, dcp=2), dense) is None
    assert _heads(_vllm(2, 4), _dense(1)) is None  # 1 head a rank where tp 2 of 4 holds 2
    mamba = MambaSpec(
        block_size=BLOCK,
        shapes=((3, 1024), (8, 64, 64)),
        dtypes=(torch.bfloat16, torch.bfloat16),
        page_size_padded=81920,
        mamba_cache_mode="align",
    )
    hybrid = _config(
        KVCacheGroupSpec(["g0"], mamba),
        KVCacheGroupSpec(["a"], _dense(2).kv_cache_groups[0].kv_cache_spec),
    )
    layout = layout_of(hybrid)
    assert _heads(_vllm(2, 4), hybrid) is None
    assert namespace_ident("m", "bf16", BLOCK, layout, layout.kv, 1, None) != namespace_ident(
        "m", "bf16", BLOCK, layout, layout.kv, 2, None
    )


def _shape(tp: int, config: KVCacheConfig) -> Shape:
    vllm = _vllm(tp, 4)
    vllm.parallel_config.pipeline_parallel_size = 1
    vllm.cache_config = SimpleNamespace(block_size=BLOCK, mamba_cache_mode="align")
    vllm.model_config.model = "m"
    vllm.model_config.dtype = torch.bfloat16
    settings = ConnectorSettings.from_extra_config({"host_gib": 0.01})
    return Shape.of(vllm, config, settings)  # type: ignore[arg-type]


def test_shape_reads_dense_pages_at_any_size_and_window_pages_at_their_own() -> None:
    dense = {tp: _shape(tp, _dense(4 // tp)) for tp in (1, 2)}
    assert dense[1].namespace == dense[2].namespace
    assert dense[2].heads == TpHeads(4)
    full = _dense(2).kv_cache_groups[0].kv_cache_spec
    window = SlidingWindowSpec(
        block_size=BLOCK, num_kv_heads=2, head_size=64, dtype=torch.bfloat16, sliding_window=64
    )
    sliding = _config(KVCacheGroupSpec(["a"], full), KVCacheGroupSpec(["w"], window))
    shape = _shape(2, sliding)
    assert shape.layout.window_groups == (1,)
    assert shape.heads is None  # the window pages are not sliced: this size only


def _shape_under(layout: str | None) -> Shape:
    config = _dense(2)
    config.kv_cache_layout = layout
    return _shape(2, config)


def test_pages_whose_block_bytes_lie_in_another_order_have_another_namespace() -> None:
    unresolved = _shape_under(None)
    heads_first = {_shape_under(m).namespace for m in ("LBHNC", "BLHNC")}
    tokens_first = {_shape_under(m).namespace for m in ("LBNHC", "BLNHC")}
    # where a layer's blocks lie does not change a block's bytes; their inner order does
    assert len(heads_first) == 1
    assert len(tokens_first) == 1
    assert heads_first != tokens_first
    # pages stored before the order was recorded are heads-first (vLLM's CPU layout)
    assert heads_first == {unresolved.namespace}
    assert _shape_under("BLNHC").block_order == "NHC"
    assert unresolved.block_order is None


@pytest.mark.parametrize("layout", ["LHBNC", "BHLNC"])
def test_a_layout_whose_blocks_are_not_one_run_is_refused_at_start(layout: str) -> None:
    with pytest.raises(ConfigError, match=f"layout {layout} keeps the heads outside"):
        _shape_under(layout)


def test_a_layout_this_vllm_does_not_name_is_refused_at_start() -> None:
    with pytest.raises(ConfigError, match="'NOPE' is not one this vLLM names"):
        _shape_under("NOPE")
