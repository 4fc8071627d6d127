"""Which of vLLM's KV cache group layouts HiCacheConnector saves (built from vLLM's own spec
classes, no engine): dense, one attention group beside state and sliding-window groups, and
what it refuses."""

from __future__ import annotations

import pytest

from tests.integrations.vllm.vllm_support import require_vllm

require_vllm()

import torch  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
    SlidingWindowSpec,
)

from hicache.domain import ConfigError  # noqa: E402
from hicache.integrations.vllm.layout import layout_of  # noqa: E402

pytestmark = pytest.mark.vllm
BLOCK = 160


def attn() -> FullAttentionSpec:
    return FullAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)


def mamba() -> MambaSpec:
    return MambaSpec(
        block_size=BLOCK,
        shapes=((3, 1024), (8, 64, 64)),
        dtypes=(torch.bfloat16, torch.bfloat16),
        page_size_padded=81920,
        mamba_cache_mode="align",
    )


def config(*groups: KVCacheGroupSpec) -> KVCacheConfig:
    return KVCacheConfig(num_blocks=16, kv_cache_tensors=[], kv_cache_groups=list(groups))


def test_one_attention_group_is_a_dense_layout() -> None:
    layout = layout_of(config(KVCacheGroupSpec(["l0", "l1"], attn())))
    assert [name for name, _ in layout.kv] == ["l0", "l1"]
    assert layout.state == ()
    assert layout.page_bytes == 2 * attn().page_size_bytes


def test_state_groups_beside_attention_are_saved_without_their_padding() -> None:
    layout = layout_of(
        config(
            KVCacheGroupSpec(["g0"], mamba()),
            KVCacheGroupSpec(["g1"], mamba()),
            KVCacheGroupSpec(["a"], attn()),
        )
    )
    assert layout.attn_group == 2
    assert layout.state_groups == (0, 1)
    used = (3 * 1024 + 8 * 64 * 64) * 2  # conv + recurrent state, bf16: 71,680 of 81,920
    assert layout.state == (("g0", 0, used), ("g1", 1, used))


def window(size: int = 128, block: int = BLOCK) -> SlidingWindowSpec:
    return SlidingWindowSpec(
        block_size=block, num_kv_heads=2, head_size=64, dtype=torch.bfloat16, sliding_window=size
    )


def test_sliding_window_groups_beside_full_attention_are_window_pages() -> None:
    layout = layout_of(
        config(
            KVCacheGroupSpec(["w0", "w2"], window()),
            KVCacheGroupSpec(["a1", "a3"], attn()),
            KVCacheGroupSpec(["w4", "w6"], window()),
        )
    )
    assert layout.attn_group == 1
    assert [name for name, _ in layout.kv] == ["a1", "a3"]
    assert layout.window_groups == (0, 2)
    block = window().page_size_bytes
    assert layout.window == (("w0", 0, block), ("w2", 0, block), ("w4", 1, block), ("w6", 1, block))
    assert layout.window_bytes == 4 * block
    assert layout.window_tokens == 127  # the next token reads the 127 before it


def test_sliding_window_beside_state_groups_is_one_hybrid_layout() -> None:
    layout = layout_of(
        config(
            KVCacheGroupSpec(["g0"], mamba()),
            KVCacheGroupSpec(["a"], attn()),
            KVCacheGroupSpec(["w"], window()),
        )
    )
    assert (layout.attn_group, layout.state_groups, layout.window_groups) == (1, (0,), (2,))


@pytest.mark.parametrize(
    ("second", "match"),
    [(window(size=256), "different windows"), (window(block=BLOCK // 2), "one block size")],
    ids=["windows", "blocks"],
)
def test_sliding_window_groups_that_disagree_are_refused(
    second: SlidingWindowSpec, match: str
) -> None:
    groups = [KVCacheGroupSpec(["a"], attn()), KVCacheGroupSpec(["w0"], window())]
    groups.append(KVCacheGroupSpec(["w1"], second))
    with pytest.raises(ConfigError, match=match):
        layout_of(config(*groups))


def test_two_full_attention_groups_are_refused_naming_the_way_out() -> None:
    with pytest.raises(ConfigError, match="disable_hybrid_kv_cache_manager"):
        layout_of(config(KVCacheGroupSpec(["a"], attn()), KVCacheGroupSpec(["b"], attn())))


def test_hybrid_without_prefix_caching_of_states_is_refused() -> None:
    groups = (KVCacheGroupSpec(["g0"], mamba()), KVCacheGroupSpec(["a"], attn()))
    with pytest.raises(ConfigError, match="mamba_cache_mode 'none'"):
        layout_of(config(*groups), "none")


def test_a_layout_without_sliding_windows_keeps_its_repr_and_so_its_store_namespace() -> None:
    """Shape.namespace hashes the layout's repr: the sliding-window fields appear only when
    set, so stores written before them stay reachable."""
    block = attn().page_size_bytes
    dense = layout_of(config(KVCacheGroupSpec(["l0"], attn())))
    assert repr(dense) == f"Layout(attn_group=0, kv=(('l0', {block}),), state_groups=(), state=())"
    sliding = layout_of(config(KVCacheGroupSpec(["a"], attn()), KVCacheGroupSpec(["w"], window())))
    assert "window_tokens=127" in repr(sliding)


def test_one_sliding_window_group_is_a_dense_layout_over_vllms_null_blocks() -> None:
    layout = layout_of(config(KVCacheGroupSpec(["w0", "w1"], window())))
    assert [name for name, _ in layout.kv] == ["w0", "w1"]
    assert layout.attn_sliding
    assert not layout_of(config(KVCacheGroupSpec(["l0"], attn()))).attn_sliding


def test_one_sliding_window_group_beside_state_groups_is_its_attention_group() -> None:
    """NemotronH with a sliding_window: every attention layer slides, no full-attention group;
    the sliding group is saved as the attention group over vLLM's null blocks, with states."""
    layout = layout_of(
        config(KVCacheGroupSpec(["m0", "m1"], mamba()), KVCacheGroupSpec(["w0", "w1"], window()))
    )
    assert (layout.attn_group, layout.state_groups, layout.window_groups) == (1, (0,), ())
    assert [name for name, _ in layout.kv] == ["w0", "w1"]
    assert layout.attn_sliding
    assert [name for name, _, _ in layout.state] == ["m0", "m1"]
    assert layout.window_tokens == 127  # a hit needs the blocks of the 127 tokens before it
    assert "window_tokens=127" in repr(layout)  # in the store namespace


def test_two_sliding_window_groups_beside_state_groups_without_full_attention_are_refused() -> None:
    groups = [
        KVCacheGroupSpec(["m0"], mamba()),
        KVCacheGroupSpec(["w0"], window()),
        KVCacheGroupSpec(["w1"], window()),
    ]
    with pytest.raises(ConfigError, match="one sliding-window group beside state groups"):
        layout_of(config(*groups))
