"""Model specs: which caches each layer of a model keeps, and their per-rank geometry.

- LayerKind: a layer's token mixer: full attention, sliding attention, linear attention, Mamba, none.
- Cache: the caches a layer can hold: full KV, sliding KV, indexer, state. A layer holds a SET.
- AttentionSpec / MLASpec / IndexerSpec: attention-like geometry (before TP).
- Mamba2Spec / GatedDeltaNetSpec / KimiDeltaSpec / ShortConvSpec: recurrent state (before TP).
- ModelSpec: layer kinds, which layers hold an indexer or state, the specs above;
  ModelSpec.from_hf_config(d) reads a config dict with the reader readers.py installs
  (install_hf_reader: readers imports this module, never the other way round).
- ModelSpec.rank_geometries(tp, ...): per-rank pool geometries for a tensor-parallel size.
- split_heads / split_strict / mamba_groups_per_rank: how heads and groups spread over TP ranks.
- layer_subset: the layer ids a per-layer 0/1 config list marks.
- stage_range: re-exported from stages.py (vLLM's pipeline split by default).

A layer's caches: a full-attention layer holds full KV, a sliding layer sliding KV, a linear or
Mamba layer state; ``indexer_layers`` (default: every full-attention layer) add an indexer and
``state_layers`` (default: every linear/Mamba layer) add state, also beside attention (Falcon-H1's
parallel Mamba heads, Inkling's short convolutions on every layer). A spec part that no layer
uses is a ConfigError.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs

from hicache.domain.dtypes import DType
from hicache.domain.errors import ConfigError
from hicache.domain.geometry import (
    IndexerGeometry,
    KVGeometry,
    MLAGeometry,
    StateGeometry,
    gated_deltanet_state,
    kimi_delta_state,
    mamba2_state,
    short_conv_state,
)
from hicache.domain.stages import stage_range
from hicache.domain.validators import optional_positive_int, positive_int

__all__ = ["stage_range"]


class LayerKind(enum.Enum):
    FULL_ATTENTION = "full_attention"
    SLIDING_ATTENTION = "sliding_attention"
    LINEAR_ATTENTION = "linear_attention"
    MAMBA = "mamba"
    NONE = "none"

    @property
    def has_cache(self) -> bool:
        return self is not LayerKind.NONE


class Cache(enum.Enum):
    FULL = "full"
    SLIDING = "sliding"
    INDEXER = "indexer"
    STATE = "state"


def _kinds(value: object) -> tuple[LayerKind, ...]:
    if not isinstance(value, (tuple, list)) or not all(isinstance(k, LayerKind) for k in value):
        raise ConfigError(f"layer_kinds must be a sequence of LayerKind, got {value!r}")
    return tuple(value)


def _layer_ids(value: object) -> tuple[int, ...] | None:
    if value is None:
        return None
    if not isinstance(value, (tuple, list, range)) or not all(
        isinstance(i, int) and not isinstance(i, bool) for i in value
    ):
        raise ConfigError(f"a layer subset must be a sequence of layer ids, got {value!r}")
    ids = tuple(value)
    if len(set(ids)) != len(ids):
        raise ConfigError(f"a layer subset names a layer more than once: {list(ids)}")
    return tuple(sorted(ids))


@attrs.frozen(kw_only=True)
class AttentionSpec:
    """MHA/GQA attention: total KV heads (before TP) and head dims."""

    kv_heads: int = attrs.field(validator=positive_int)
    head_dim: int = attrs.field(validator=positive_int)
    v_head_dim: int | None = attrs.field(default=None, validator=optional_positive_int)


@attrs.frozen(kw_only=True)
class MLASpec:
    """Multi-head latent attention: one replicated latent row per token."""

    kv_lora_rank: int = attrs.field(validator=positive_int)
    qk_rope_head_dim: int = attrs.field(validator=positive_int)
    row_width: int | None = attrs.field(default=None, validator=optional_positive_int)


@attrs.frozen(kw_only=True)
class IndexerSpec:
    """A K-only sparse-attention indexer, a sidecar of the full-attention KV pool.

    ``heads`` counts K heads (DeepSeek-V3.2 and MiniMax keep one K head, replicated on every
    rank). ``dtype`` None means the KV dtype. ``scale_block`` set means fp8 with float32 block
    scales.
    """

    heads: int = attrs.field(validator=positive_int)
    head_dim: int = attrs.field(validator=positive_int)
    dtype: DType | None = None
    scale_block: int | None = attrs.field(default=None, validator=optional_positive_int)


@attrs.frozen(kw_only=True)
class Mamba2Spec:
    """Mamba2 mixer. ``intermediate`` (d_ssm) defaults to heads x head_dim."""

    heads: int = attrs.field(validator=positive_int)
    head_dim: int = attrs.field(validator=positive_int)
    state_size: int = attrs.field(validator=positive_int)
    n_groups: int = attrs.field(validator=positive_int)
    conv_kernel: int = attrs.field(validator=positive_int)
    intermediate: int | None = attrs.field(default=None, validator=optional_positive_int)


@attrs.frozen(kw_only=True)
class GatedDeltaNetSpec:
    key_heads: int = attrs.field(validator=positive_int)
    value_heads: int = attrs.field(validator=positive_int)
    key_dim: int = attrs.field(validator=positive_int)
    value_dim: int = attrs.field(validator=positive_int)
    conv_kernel: int = attrs.field(validator=positive_int)


@attrs.frozen(kw_only=True)
class KimiDeltaSpec:
    """Kimi Delta Attention: ``heads`` K/V heads of ``head_dim`` and a short convolution."""

    heads: int = attrs.field(validator=positive_int)
    head_dim: int = attrs.field(validator=positive_int)
    conv_kernel: int = attrs.field(validator=positive_int)


@attrs.frozen(kw_only=True)
class ShortConvSpec:
    """Inkling's short convolutions: conv-only state for K and V of full and sliding attention
    (KV heads x head dim, split over TP or replicated) and the attention and MLP outputs
    (hidden size, not split), on every layer."""

    kv_heads: int = attrs.field(validator=positive_int)
    head_dim: int = attrs.field(validator=positive_int)
    swa_kv_heads: int = attrs.field(validator=positive_int)
    swa_head_dim: int = attrs.field(validator=positive_int)
    hidden_size: int = attrs.field(validator=positive_int)
    conv_kernel: int = attrs.field(validator=positive_int)


StateSpec = Mamba2Spec | GatedDeltaNetSpec | KimiDeltaSpec | ShortConvSpec


@attrs.frozen(kw_only=True)
class RankGeometries:
    """Per-rank geometries of a model's pools (None where the model has no such pool)."""

    kv: KVGeometry | MLAGeometry | None
    swa: KVGeometry | None
    state: StateGeometry | None
    indexer: IndexerGeometry | None


def split_heads(heads: int, tp: int, what: str) -> int:
    """Heads per rank: split when tp divides them, replicated (1) when heads divide tp."""
    if heads % tp == 0:
        return heads // tp
    if tp % heads == 0:
        return 1
    raise ConfigError(
        f"{what}: {heads} heads can be neither split over nor replicated across tp={tp} ranks "
        f"(one of the two must divide the other)"
    )


def split_strict(heads: int, tp: int, what: str) -> int:
    if heads % tp:
        raise ConfigError(f"{what}: {heads} heads cannot be split over tp={tp} ranks")
    return heads // tp


def mamba_groups_per_rank(n_groups: int, tp: int) -> int:
    """Mamba2 groups per rank: split when tp divides them, else padded to tp (one per rank).

    SGLang (configs/mamba_utils.py extra_groups_for_head_shards) adds tp - n_groups groups when
    tp does not divide n_groups, so each rank keeps one group.
    """
    return n_groups // tp if n_groups % tp == 0 else 1


_STATE_KINDS = {
    LayerKind.LINEAR_ATTENTION: (GatedDeltaNetSpec, KimiDeltaSpec),
    LayerKind.MAMBA: (Mamba2Spec,),
}


@attrs.frozen(kw_only=True)
class ModelSpec:
    """What a model caches per layer. Build with from_hf_config or directly in Python."""

    model_type: str
    layer_kinds: tuple[LayerKind, ...] = attrs.field(converter=_kinds)
    attention: AttentionSpec | MLASpec | None = None
    sliding_window: int | None = attrs.field(default=None, validator=optional_positive_int)
    sliding_attention: AttentionSpec | None = None
    indexer: IndexerSpec | None = None
    indexer_layers: tuple[int, ...] | None = attrs.field(default=None, converter=_layer_ids)
    state: StateSpec | None = None
    state_layers: tuple[int, ...] | None = attrs.field(default=None, converter=_layer_ids)
    dtype: DType = DType.BF16
    _caches: tuple[frozenset[Cache], ...] = attrs.field(init=False, repr=False, eq=False)

    def __attrs_post_init__(self) -> None:
        name = f"model {self.model_type!r}"
        n = len(self.layer_kinds)
        kinds = set(self.layer_kinds)
        if not n:
            raise ConfigError(f"{name} has no layers")
        attn_kinds = {LayerKind.FULL_ATTENTION, LayerKind.SLIDING_ATTENTION}
        if kinds & attn_kinds and self.attention is None:
            raise ConfigError(f"{name} has attention layers but no attention spec")
        if LayerKind.FULL_ATTENTION not in kinds:
            raise ConfigError(f"{name} has no full-attention layer to anchor a host group")
        sliding = LayerKind.SLIDING_ATTENTION in kinds
        if sliding:
            if self.sliding_window is None:
                raise ConfigError(f"{name} has sliding layers but no window")
            if isinstance(self.attention, MLASpec) and self.sliding_attention is None:
                raise ConfigError(
                    f"{name}: sliding layers need an MHA spec (sliding_attention) when full "
                    f"attention is MLA"
                )
        elif self.sliding_attention is not None or self.sliding_window is not None:
            raise ConfigError(
                f"{name} has a sliding-attention spec or window but no sliding layer uses it"
            )
        full = [i for i, k in enumerate(self.layer_kinds) if k is LayerKind.FULL_ATTENTION]
        for label, ids in (
            ("indexer_layers", self.indexer_layers),
            ("state_layers", self.state_layers),
        ):
            bad = [i for i in ids or () if not 0 <= i < n]
            if bad:
                raise ConfigError(f"{name}: {label} {bad} are not layers of its {n} layers")
        # Indexer: a sidecar of the full KV pool, so only on full-attention layers.
        if self.indexer is None:
            if self.indexer_layers is not None:
                raise ConfigError(f"{name} names indexer_layers but has no indexer spec")
            indexer_ids: tuple[int, ...] = ()
        else:
            indexer_ids = tuple(full) if self.indexer_layers is None else self.indexer_layers
            not_full = [
                i for i in indexer_ids if self.layer_kinds[i] is not LayerKind.FULL_ATTENTION
            ]
            if not_full:
                raise ConfigError(
                    f"{name}: indexer layers {not_full} are not full-attention layers; an "
                    f"indexer shares the full-attention KV pool's pages"
                )
            if not indexer_ids:
                raise ConfigError(f"{name} has an indexer spec but no layer holds an indexer")
        # State: on linear/Mamba layers by default, or on the layers named.
        state_kinds = kinds & set(_STATE_KINDS)
        if len(state_kinds) > 1:
            raise ConfigError(f"{name} mixes Mamba2 and linear-attention layers")
        for kind in state_kinds:
            if not isinstance(self.state, _STATE_KINDS[kind]):
                want = " or ".join(t.__name__ for t in _STATE_KINDS[kind])
                label = "Mamba" if kind is LayerKind.MAMBA else "linear-attention"
                got = type(self.state).__name__ if self.state else "none"
                raise ConfigError(f"{name} has {label} layers but no {want} (state spec: {got})")
        mixer_state = tuple(i for i, k in enumerate(self.layer_kinds) if k in _STATE_KINDS)
        if self.state is None:
            if self.state_layers is not None:
                raise ConfigError(f"{name} names state_layers but has no state spec")
            state_ids: tuple[int, ...] = ()
        else:
            state_ids = mixer_state if self.state_layers is None else self.state_layers
            missing = sorted(set(mixer_state) - set(state_ids))
            if missing:
                raise ConfigError(f"{name}: state layers {missing} are missing from state_layers")
            if not state_ids:
                raise ConfigError(
                    f"{name} has a state spec ({type(self.state).__name__}) but no layer holds "
                    f"state; name its layers in state_layers"
                )
        caches: list[set[Cache]] = []
        for k in self.layer_kinds:
            c: set[Cache] = set()
            if k is LayerKind.FULL_ATTENTION:
                c.add(Cache.FULL)
            elif k is LayerKind.SLIDING_ATTENTION:
                c.add(Cache.SLIDING)
            caches.append(c)
        for i in indexer_ids:
            caches[i].add(Cache.INDEXER)
        for i in state_ids:
            caches[i].add(Cache.STATE)
        object.__setattr__(self, "_caches", tuple(frozenset(c) for c in caches))

    @property
    def num_layers(self) -> int:
        return len(self.layer_kinds)

    @property
    def layer_caches(self) -> tuple[frozenset[Cache], ...]:
        """The set of caches each layer holds, in layer order."""
        return self._caches

    def layers_of(self, kind: LayerKind, start: int = 0, end: int | None = None) -> tuple[int, ...]:
        stop = self.num_layers if end is None else end
        return tuple(i for i in range(start, stop) if self.layer_kinds[i] is kind)

    def layers_holding(
        self, cache: Cache, start: int = 0, end: int | None = None
    ) -> tuple[int, ...]:
        """Model layer ids in [start, end) that hold ``cache``."""
        stop = self.num_layers if end is None else end
        return tuple(i for i in range(start, stop) if cache in self._caches[i])

    def cached_layers(self, start: int = 0, end: int | None = None) -> tuple[int, ...]:
        """Model layer ids in [start, end) that hold any cache (the stage's transfer layers)."""
        stop = self.num_layers if end is None else end
        return tuple(i for i in range(start, stop) if self._caches[i])

    def rank_geometries(
        self,
        tp_size: int = 1,
        *,
        kv_dtype: DType | None = None,
        ssm_dtype: DType = DType.FP32,
        conv_dtype: DType | None = None,
    ) -> RankGeometries:
        """Per-rank geometries for ``tp_size`` tensor-parallel ranks."""
        if not isinstance(tp_size, int) or isinstance(tp_size, bool) or tp_size < 1:
            raise ConfigError(f"tp_size must be a positive integer, got {tp_size!r}")
        kvd = kv_dtype or self.dtype
        mt = self.model_type
        kv: KVGeometry | MLAGeometry | None = None
        if isinstance(self.attention, MLASpec):
            kv = MLAGeometry(
                kv_lora_rank=self.attention.kv_lora_rank,
                qk_rope_head_dim=self.attention.qk_rope_head_dim,
                dtype=kvd,
                row_width=self.attention.row_width,
            )
        elif isinstance(self.attention, AttentionSpec):
            kv = KVGeometry(
                kv_heads=split_heads(self.attention.kv_heads, tp_size, f"{mt} KV"),
                head_dim=self.attention.head_dim,
                v_head_dim=self.attention.v_head_dim,
                dtype=kvd,
            )
        swa: KVGeometry | None = None
        if LayerKind.SLIDING_ATTENTION in self.layer_kinds:
            sa = self.sliding_attention or self.attention
            if not isinstance(sa, AttentionSpec):  # pragma: no cover - checked in post_init
                raise ConfigError(f"model {mt!r}: sliding layers need an MHA spec")
            swa = KVGeometry(
                kv_heads=split_heads(sa.kv_heads, tp_size, f"{mt} sliding KV"),
                head_dim=sa.head_dim,
                v_head_dim=sa.v_head_dim,
                dtype=kvd,
            )
        state = self._state_geometry(tp_size, conv_dtype, ssm_dtype)
        indexer: IndexerGeometry | None = None
        if self.indexer is not None:
            ix = self.indexer
            indexer = IndexerGeometry(
                heads=split_heads(ix.heads, tp_size, f"{mt} indexer"),
                head_dim=ix.head_dim,
                dtype=ix.dtype or kvd,
                scale_block=ix.scale_block,
            )
        return RankGeometries(kv=kv, swa=swa, state=state, indexer=indexer)

    def _state_geometry(self, tp: int, conv: DType | None, sd: DType) -> StateGeometry | None:
        mt = self.model_type
        s = self.state
        cd = conv or self.dtype
        if isinstance(s, Mamba2Spec):
            heads = split_strict(s.heads, tp, f"{mt} Mamba")
            groups = mamba_groups_per_rank(s.n_groups, tp)
            intermediate = s.heads * s.head_dim if s.intermediate is None else s.intermediate
            if intermediate % tp:
                raise ConfigError(
                    f"{mt} Mamba: intermediate size {intermediate} cannot be split over tp={tp}"
                )
            return mamba2_state(
                heads=heads,
                head_dim=s.head_dim,
                state_size=s.state_size,
                n_groups=groups,
                conv_kernel=s.conv_kernel,
                conv_dtype=cd,
                ssm_dtype=sd,
                intermediate=intermediate // tp,
            )
        if isinstance(s, GatedDeltaNetSpec):
            return gated_deltanet_state(
                key_heads=split_strict(s.key_heads, tp, f"{mt} linear-attention key"),
                value_heads=split_strict(s.value_heads, tp, f"{mt} linear-attention value"),
                key_dim=s.key_dim,
                value_dim=s.value_dim,
                conv_kernel=s.conv_kernel,
                conv_dtype=cd,
                ssm_dtype=sd,
            )
        if isinstance(s, KimiDeltaSpec):
            return kimi_delta_state(
                heads=split_strict(s.heads, tp, f"{mt} Kimi delta attention"),
                head_dim=s.head_dim,
                conv_kernel=s.conv_kernel,
                conv_dtype=cd,
                ssm_dtype=sd,
            )
        if isinstance(s, ShortConvSpec):
            # SGLang (configs/inkling.py): max(1, kv_heads // tp) x head_dim channels per rank.
            full = max(1, s.kv_heads // tp) * s.head_dim
            local = max(1, s.swa_kv_heads // tp) * s.swa_head_dim
            return short_conv_state(
                streams=(
                    ("k_full", full),
                    ("v_full", full),
                    ("k_sliding", local),
                    ("v_sliding", local),
                    ("attn_out", s.hidden_size),
                    ("mlp_out", s.hidden_size),
                ),
                conv_kernel=s.conv_kernel,
                dtype=conv or DType.BF16,  # SGLang's InklingStateDType: bf16 whatever the model's
            )
        return None

    @classmethod
    def from_hf_config(cls, config: Mapping[str, Any]) -> ModelSpec:
        """Read a HuggingFace config.json dict; raises UnsupportedModelError for unknown types
        (hicache.domain.readers.read_hf_config, installed below)."""
        reader = _HF_READER.get("read")
        if reader is None:  # only while hicache.domain's own __init__ is still importing
            raise ConfigError(
                "ModelSpec.from_hf_config: no HuggingFace reader installed; "
                "import hicache.domain (it installs hicache.domain.readers)"
            )
        return reader(config)


# The reader behind ModelSpec.from_hf_config. hicache.domain.readers builds ModelSpecs, so it
# imports this module and this module does not import it (no import circle): readers installs
# read_hf_config here when it is imported, and hicache.domain's __init__ imports readers. Python
# runs a package's __init__ before any of its modules, so the reader is in place before a caller
# of ``import hicache.domain.models`` gets the module.
_HF_READER: dict[str, Callable[[Mapping[str, Any]], ModelSpec]] = {}


def install_hf_reader(reader: Callable[[Mapping[str, Any]], ModelSpec]) -> None:
    """Make ``reader`` the one ModelSpec.from_hf_config calls (hicache.domain.readers does)."""
    _HF_READER["read"] = reader


def layer_subset(flags: Sequence[object], n: int, what: str) -> tuple[int, ...]:
    """Layer ids whose flag is truthy (1/True) in a per-layer 0/1 list of at least n entries."""
    if not isinstance(flags, (list, tuple)) or len(flags) < n:
        raise ConfigError(f"{what} must list at least {n} layers, got {flags!r}")
    bad = [f for f in flags[:n] if type(f) not in (int, bool) or f not in (0, 1)]
    if bad:
        raise ConfigError(f"{what} must hold 0/1 per layer, got {bad[:3]}")
    return tuple(i for i, f in enumerate(flags[:n]) if f)
