"""Which of vLLM's KV cache groups the connector saves, and the host tier's shape from them.

- Layout / layout_of(kv_cache_config, mamba_cache_mode): the attention group, its layers and
  bytes per block, (hybrid models) the state groups and each state layer's used bytes, and
  (vLLM's hybrid KV cache manager on a sliding-window model) the sliding-window groups, each
  sliding layer's bytes per block and the tokens a sliding layer needs before a boundary; one
  sliding-window group with no full-attention group (every layer slides, or state groups beside
  it) is the attention group over vLLM's null blocks (attn_sliding); ConfigError for group
  layouts the connector cannot save.
- Shape.of(vllm_config, kv_cache_config, settings): the Layout plus what follows from it and
  the settings: block size, host slots for KV pages and for states, the rank count and the
  namespace of store keys (model, dtype, block size, layout; the tensor parallel size only
  where pages cannot be read at another size: hicache.integrations.vllm.tp_shape).

Reference: vllm/v1/kv_cache_interface.py (AttentionSpec, FullAttentionSpec, MambaSpec,
SlidingWindowSpec), vllm/v1/core/single_type_kv_cache_manager.py (MambaManager, align mode;
SlidingWindowManager.get_num_skipped_tokens).
"""

from __future__ import annotations

import hashlib
import math
from typing import TYPE_CHECKING

import attrs
from vllm.v1.kv_cache_interface import (
    AttentionSpec,
    FullAttentionSpec,
    MambaSpec,
    SlidingWindowSpec,
)

from hicache.domain import ConfigError
from hicache.integrations.vllm.settings import ConnectorSettings
from hicache.integrations.vllm.tp_plan import TpHeads
from hicache.integrations.vllm.tp_shape import block_order_of, namespace_ident, tp_heads

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

STATE_SHARE = 0.25  # of host_gib, for a hybrid model's state pages


@attrs.frozen(repr=False)
class Layout:
    """Which of vLLM's KV cache groups hicache saves, and how many bytes each unit is.

    Its repr is part of the store namespace (Shape.namespace): the sliding-window fields appear
    in it only when set, so a layout without them keeps the namespace it had before them.
    """

    attn_group: int
    kv: tuple[tuple[str, int], ...]  # (attention layer, bytes per block)
    state_groups: tuple[int, ...] = ()  # hybrid: the state groups, in order
    state: tuple[tuple[str, int, int], ...] = ()  # (state layer, group position, used bytes)
    window_groups: tuple[int, ...] = ()  # sliding-window groups, in order
    window: tuple[tuple[str, int, int], ...] = ()  # (sliding layer, group position, bytes)
    # tokens before a boundary a sliding layer reads for the next token: window - 1 (+ vLLM's
    # extra retained tokens); vLLM keeps (and a hit needs) their blocks (hicache.integrations.
    # vllm.hybrid_hits.window_pages)
    window_tokens: int = 0
    # the attention group is a sliding-window group (every layer slides; or the only attention
    # group beside state groups): vLLM's null block (id 0) stands for its freed blocks, which
    # are neither saved nor loaded into
    attn_sliding: bool = False

    def __repr__(self) -> str:
        fields = [
            f"attn_group={self.attn_group!r}",
            f"kv={self.kv!r}",
            f"state_groups={self.state_groups!r}",
            f"state={self.state!r}",
        ]
        if self.window:
            fields += [
                f"window_groups={self.window_groups!r}",
                f"window={self.window!r}",
                f"window_tokens={self.window_tokens!r}",
            ]
        if self.attn_sliding:
            if self.window_tokens and not self.window:  # beside state groups
                fields.append(f"window_tokens={self.window_tokens!r}")
            fields.append("attn_sliding=True")
        return f"Layout({', '.join(fields)})"

    @property
    def page_bytes(self) -> int:
        return sum(n for _, n in self.kv)

    @property
    def state_bytes(self) -> int:
        return sum(n for _, _, n in self.state)

    @property
    def window_bytes(self) -> int:
        """A window page: one block of every sliding layer (0 without sliding groups)."""
        return sum(n for _, _, n in self.window)


def layout_of(kv_cache_config: KVCacheConfig, mamba_cache_mode: str = "align") -> Layout:
    """The Layout of ``kv_cache_config``; ConfigError for groups hicache cannot save."""
    groups = kv_cache_config.kv_cache_groups
    kinds = [type(g.kv_cache_spec).__name__ for g in groups]
    if len(groups) == 1 and isinstance(groups[0].kv_cache_spec, AttentionSpec):
        spec = groups[0].kv_cache_spec
        return Layout(
            0,
            tuple((name, spec.page_size_bytes) for name in groups[0].layer_names),
            attn_sliding=isinstance(spec, SlidingWindowSpec),
        )
    attn = [i for i, g in enumerate(groups) if isinstance(g.kv_cache_spec, FullAttentionSpec)]
    sliding = [i for i, g in enumerate(groups) if isinstance(g.kv_cache_spec, SlidingWindowSpec)]
    mamba = [i for i, g in enumerate(groups) if isinstance(g.kv_cache_spec, MambaSpec)]
    # state groups beside one sliding-window group and no full-attention one (NemotronH with
    # a sliding_window: every attention layer slides): that group is the attention group, over
    # vLLM's null blocks as in a model whose every layer slides
    sliding_only = not attn and len(sliding) == 1 and bool(mamba)
    if len(sliding) + len(mamba) + len(attn) != len(groups) or not (len(attn) == 1 or sliding_only):
        raise ConfigError(
            f"HiCacheConnector: the model has KV cache groups {kinds}; supported are one "
            "attention group (dense models) or one full-attention group beside sliding-window "
            "groups and Mamba / linear attention state groups (hybrid models such as Gemma-3 "
            "or Qwen3-Next), or one sliding-window group beside state groups; for other "
            "layouts start vLLM with disable_hybrid_kv_cache_manager=True "
            "(--disable-hybrid-kv-cache-manager): one attention group"
        )
    if mamba and mamba_cache_mode != "align":
        raise ConfigError(
            f"HiCacheConnector: a hybrid model with mamba_cache_mode {mamba_cache_mode!r}; "
            "expected 'align' (vLLM's prefix caching of states: enable_prefix_caching=True)"
        )
    state: list[tuple[str, int, int]] = []
    for pos, g in enumerate(mamba):
        mspec = groups[g].kv_cache_spec
        used = sum(
            math.prod(shape) * dtype.itemsize
            for shape, dtype in zip(mspec.shapes, mspec.dtypes, strict=True)
        )
        state.extend((name, pos, used) for name in groups[g].layer_names)
    if sliding_only:
        (g,) = sliding
        spec = groups[g].kv_cache_spec
        extra = int(getattr(spec, "extra_retained_tokens", 0))
        return Layout(
            g,
            tuple((name, spec.page_size_bytes) for name in groups[g].layer_names),
            tuple(mamba),
            tuple(state),
            window_tokens=max(1, int(spec.sliding_window) - 1 + extra),
            attn_sliding=True,
        )
    spec = groups[attn[0]].kv_cache_spec
    window: list[tuple[str, int, int]] = []
    reach: set[tuple[int, int]] = set()
    for pos, g in enumerate(sliding):
        wspec = groups[g].kv_cache_spec
        if wspec.block_size != spec.block_size:
            raise ConfigError(
                f"HiCacheConnector: sliding-window group {g} has blocks of {wspec.block_size} "
                f"tokens, the full-attention group {spec.block_size}; expected one block size"
            )
        reach.add((int(wspec.sliding_window), int(getattr(wspec, "extra_retained_tokens", 0))))
        window.extend((name, pos, wspec.page_size_bytes) for name in groups[g].layer_names)
    if len(reach) > 1:
        raise ConfigError(
            f"HiCacheConnector: sliding-window groups with different windows "
            f"(window, extra retained tokens) {sorted(reach)}; expected one window for all"
        )
    window_tokens = 0
    if reach:
        ((size, extra),) = reach
        window_tokens = max(1, size - 1 + extra)
    return Layout(
        attn[0],
        tuple((name, spec.page_size_bytes) for name in groups[attn[0]].layer_names),
        tuple(mamba),
        tuple(state),
        tuple(sliding),
        tuple(window),
        window_tokens,
    )


@attrs.frozen(kw_only=True)
class Shape:
    """The host tier and store keys of one connector (both roles compute the same)."""

    layout: Layout
    block_size: int
    host_slots: int  # KV pages (one block of every attention layer)
    state_slots: int  # hybrid: states (one state of every state layer); 0 for dense models
    state_host_bytes: int
    window_slots: int = 0  # sliding-window models: window pages (as many as KV pages)
    ranks: int  # tensor parallel ranks: one store object per rank and page (pp is refused)
    namespace: str
    # how pages split into KV heads across ranks; None: read only at this TP size (tp_shape)
    heads: TpHeads | None = None
    # the order of an attention block's bytes ("HNC", "NHC"; tp_shape.block_order_of); None:
    # vLLM resolved no layout (a hand-built config), read as heads-first
    block_order: str | None = None

    @property
    def page_bytes(self) -> int:
        return self.layout.page_bytes

    @classmethod
    def of(
        cls, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, settings: ConnectorSettings
    ) -> Shape:
        par = vllm_config.parallel_config
        pp = int(par.pipeline_parallel_size)
        if pp != 1:
            # Each pipeline stage would save only its own layers under the same (tp rank, page)
            # store key, and a hit would wait for tp x pp ranks' reports of the same page.
            raise ConfigError(
                f"HiCacheConnector: pipeline_parallel_size = {pp}; expected 1 (pipeline "
                "parallelism is not supported: use tensor_parallel_size to split the model)"
            )
        block_size = int(vllm_config.cache_config.block_size)
        mode = str(getattr(vllm_config.cache_config, "mamba_cache_mode", "none"))
        layout = layout_of(kv_cache_config, mode)
        host = settings.host_bytes
        state_host = int(host * STATE_SHARE) if layout.state else 0
        # a KV page and its window page (sliding-window models) share the rest
        host_slots = (host - state_host) // (layout.page_bytes + layout.window_bytes)
        state_slots = state_host // layout.state_bytes if layout.state else 0
        if host_slots < 1 or (layout.state and state_slots < 1):
            raise ConfigError(
                f"kv_connector_extra_config 'host_gib' = {settings.host_gib}: less than one "
                f"page ({layout.page_bytes + layout.window_bytes} bytes: one block of every layer)"
                + (
                    f" or one state ({layout.state_bytes} bytes, in the "
                    f"{STATE_SHARE:.0%} of host_gib kept for states)"
                    if layout.state
                    else ""
                )
            )
        model = vllm_config.model_config
        tp = int(par.tensor_parallel_size)
        # window pages (sliding layers) and states are read only at the size that saved them
        others = bool(layout.state or layout.window_groups)
        heads = tp_heads(vllm_config, kv_cache_config, layout.attn_group, others)
        order = block_order_of(vllm_config, kv_cache_config)
        ident = namespace_ident(
            model.model, str(model.dtype), block_size, layout, layout.kv, tp, heads, order
        )
        return cls(
            layout=layout,
            block_size=block_size,
            host_slots=host_slots,
            state_slots=state_slots,
            state_host_bytes=state_host,
            window_slots=host_slots if layout.window else 0,
            ranks=tp,
            namespace="vllm-" + hashlib.sha256(ident.encode()).hexdigest()[:32],
            heads=heads,
            block_order=order,
        )
